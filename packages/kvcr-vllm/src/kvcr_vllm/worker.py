"""`KVCRConnectorWorker`: the connector's worker side (one per TP rank, in vLLM's worker).

Copies whole block pages as opaque bytes (vLLM's CPU page layout depends on the ISA) between
vLLM's KV tensors and the kvcr pool mapped from the Runner (embedded or kvcr-guard). A block's
slot holds every layer's page back to back, in vLLM's layer order.

Asynchronous: plans from the scheduler are queued to one copy thread (torch copies release
the GIL), so copies overlap the next forward pass; `get_finished` reports what completed.
Loads are queued before the forward (their blocks are not used until reported); saves after
it (`wait_for_save`: the step's KV is written). A save reserves its keys, copies the granted
blocks and commits them itself, so a block is READY only after all its bytes landed; a failed
save is aborted, never published. Before vLLM reuses a preempted request's blocks
(`handle_preemptions`) the copy queue is drained. Runs of consecutive blocks and slots move in
one strided copy per layer. A load that cannot complete reports its blocks through
`get_block_ids_with_load_errors` (vLLM recomputes them).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvcr_core.guard_client import GuardClient, GuardUnavailable
from kvcr_core.keys import NamespaceSpec
from kvcr_vllm.metadata import KVCRConnectorMetadata, LoadPlan, SavePlan
from kvcr_vllm.settings import ConnectorSettings
from kvcr_vllm.stats import StatsRecorder

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvcr_vllm")
_SHUTDOWN_WAIT_S = 10.0


def runs(block_ids: tuple[int, ...], slots: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """(first block, first slot, length) of maximal runs where both advance by one."""
    i, n = 0, len(block_ids)
    while i < n:
        j = i + 1
        while j < n and block_ids[j] == block_ids[j - 1] + 1 and slots[j] == slots[j - 1] + 1:
            j += 1
        yield block_ids[i], slots[i], j - i
        i = j


class KVCRConnectorWorker:
    def __init__(self, settings: ConnectorSettings, spec: NamespaceSpec, tp_rank: int,
                 block_bytes: int, num_blocks: int, stats: StatsRecorder,
                 engine_id: str) -> None:
        self.settings = settings
        self.tp_rank = tp_rank
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.stats = stats
        identity = settings.identity or f"vllm-worker-{engine_id[:12]}-tp{tp_rank}"
        self.client = GuardClient(settings.socket, spec, block_bytes, identity=identity,
                                  timeout_s=settings.timeout_s)
        self._planes: list[tuple[torch.Tensor, int, int]] = []  # (bytes [blocks, page], off, n)
        self._pool_rows: torch.Tensor | None = None
        self._pool_attach = -1
        self._jobs: queue.Queue[LoadPlan | SavePlan | None] = queue.Queue()
        self._lock = threading.Lock()
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._saves_pending: dict[str, int] = {}  # req -> save jobs not yet done
        self._finished_seen: set[str] = set()
        self._disabled = ""
        self._thread = threading.Thread(target=self._copy_loop, name="kvcr-copy", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)  # an engine that exits still lands its queued saves

    # -- registration --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Views every layer's KV tensor as [num_blocks, page bytes] (no copy)."""
        import torch

        planes: list[tuple[torch.Tensor, int, int]] = []
        offset = 0
        for name, tensor in kv_caches.items():
            if tensor.shape[0] == self.num_blocks:
                parts = [tensor]
            elif tensor.dim() > 1 and tensor.shape[0] == 2 and tensor.shape[1] == self.num_blocks:
                parts = [tensor[0], tensor[1]]  # K and V planes (GPU layouts)
            else:
                self._disable(f"layer {name} has shape {tuple(tensor.shape)}: no block axis")
                return
            for part in parts:
                try:
                    as_bytes = part.view(torch.uint8).view(self.num_blocks, -1)
                except RuntimeError as exc:
                    self._disable(f"layer {name} pages are not contiguous ({exc})")
                    return
                page = as_bytes.shape[1]
                planes.append((as_bytes, offset, page))
                offset += page
        if offset != self.block_bytes:
            self._disable(f"KV pages add up to {offset} bytes per block, the KV cache spec "
                          f"says {self.block_bytes}")
            return
        self._planes = planes
        log.info("kvcr worker tp%d: %d planes, %d bytes per block, pool at %s", self.tp_rank,
                 len(planes), offset, self.settings.socket)

    def _disable(self, why: str) -> None:
        self._disabled = why
        self.stats.failure("config")
        log.error("kvcr disabled on this worker: %s (requests recompute)", why)

    # -- per step ------------------------------------------------------------------------------

    def start_load_kv(self, metadata: KVCRConnectorMetadata) -> None:
        for plan in metadata.loads:
            self._jobs.put(plan)

    def wait_for_save(self, metadata: KVCRConnectorMetadata) -> None:
        with self._lock:
            for plan in metadata.saves:
                self._saves_pending[plan.req_id] = self._saves_pending.get(plan.req_id, 0) + 1
        for plan in metadata.saves:
            self._jobs.put(plan)

    def handle_preemptions(self, metadata: KVCRConnectorMetadata) -> None:
        """vLLM is about to reuse preempted requests' blocks: finish copies reading them."""
        if metadata.preempted_req_ids:
            with self._lock:
                busy = bool(metadata.preempted_req_ids & set(self._saves_pending))
            if busy:
                self._jobs.join()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            self._finished_seen |= finished_req_ids & set(self._saves_pending)
            sending = {r for r in self._finished_seen if self._saves_pending[r] == 0}
            for req_id in sending:
                del self._saves_pending[req_id]
            self._finished_seen -= sending
            recving, self._done_recving = self._done_recving, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Finishes queued copies (bounded wait), then detaches. Idempotent."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=_SHUTDOWN_WAIT_S)
        with contextlib.suppress(GuardUnavailable):
            if self.client.attached:
                self.client.flush()
        self.client.close()

    # -- copy thread ---------------------------------------------------------------------------

    def _pool(self) -> torch.Tensor:
        import torch

        pool = self.client.pool  # attaches (or re-attaches) as needed; GuardUnavailable if not
        if self._pool_rows is None or self._pool_attach != self.client.attach_count:
            rows = torch.frombuffer(pool.region.view, dtype=torch.uint8)
            self._pool_rows = rows[:pool.capacity_slots * pool.stride_bytes].view(
                pool.capacity_slots, pool.stride_bytes)
            self._pool_attach = self.client.attach_count
        return self._pool_rows

    def _copy_loop(self) -> None:
        while (plan := self._jobs.get()) is not None:
            try:
                if isinstance(plan, LoadPlan):
                    self._load(plan)
                else:
                    self._save(plan)
            finally:
                self._jobs.task_done()

    def _load(self, plan: LoadPlan) -> None:
        start = time.perf_counter()
        errors = set(plan.failed_block_ids)
        slots = plan.slots_by_rank[self.tp_rank] if plan.block_ids else ()
        try:
            if plan.block_ids:
                if self._disabled or not self._planes:
                    raise RuntimeError(self._disabled or "KV caches not registered")
                rows = self._pool()
                for block, slot, length in runs(plan.block_ids, slots):
                    for plane, off, page in self._planes:
                        plane[block:block + length].copy_(rows[slot:slot + length, off:off + page])
        except GuardUnavailable:
            self.stats.failure("guard_unavailable")
            errors.update(plan.block_ids)
        except Exception:
            log.exception("kvcr load of %s failed; recomputing", plan.req_id)
            self.stats.failure("load_copy")
            errors.update(plan.block_ids)
        else:
            loaded = len(plan.block_ids)
            if loaded:
                self.stats.add("loaded_blocks", loaded)
                self.stats.add("loaded_tokens", loaded * self._block_tokens())
                self.stats.load_seconds(time.perf_counter() - start)
        with self._lock:
            self._load_errors |= errors
            self._done_recving.add(plan.req_id)

    def _save(self, plan: SavePlan) -> None:
        keys = plan.keys_by_rank[self.tp_rank]
        res = None
        try:
            if self._disabled or not self._planes:
                raise RuntimeError(self._disabled or "KV caches not registered")
            res = self.client.reserve(keys)  # type: ignore[arg-type]
            if res.refused:
                self.stats.failure("save_refused", res.refused)
            pairs = [(b, s) for b, s in zip(plan.block_ids, res.slots, strict=True)
                     if s is not None]
            if pairs:
                rows = self._pool()
                blocks, slot_ids = zip(*pairs, strict=True)
                for block, slot, length in runs(blocks, slot_ids):
                    for plane, off, page in self._planes:
                        rows[slot:slot + length, off:off + page].copy_(plane[block:block + length])
                self.client.commit_nowait(res.op)
                self.stats.add("stored_blocks", len(pairs))
                self.stats.add("stored_tokens", len(pairs) * self._block_tokens())
        except GuardUnavailable:
            self.stats.failure("guard_unavailable")
        except Exception:
            log.exception("kvcr save of %s failed; nothing was published", plan.req_id)
            self.stats.failure("save_copy")
            if res is not None:
                with contextlib.suppress(GuardUnavailable):
                    self.client.abort(res.op)
        with self._lock:
            self._saves_pending[plan.req_id] -= 1

    def _block_tokens(self) -> int:
        return self.client.namespace.block_size_tokens
