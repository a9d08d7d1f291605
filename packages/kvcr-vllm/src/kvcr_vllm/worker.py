"""`KVCRConnectorWorker`: the connector's worker side (one per TP rank, in vLLM's worker).

Copies whole block pages as opaque bytes (vLLM's CPU page layout depends on the ISA) between
vLLM's KV tensors and the kvcr pool mapped from the Runner (embedded or kvcr-guard). A block's
slot holds every layer's page back to back, in vLLM's layer order.

Copies run inline in the engine thread, at memcpy speed: loads in `start_load_kv` (host KV
caches: synchronous, before the forward pass of the very step that runs the request, reported
done through `loads_done`; device caches: the request waits in WAITING_FOR_REMOTE_KVS and is
reported through `get_finished`), saves in `wait_for_save` after the forward pass wrote the
step's KV. Measured here: a separate copy thread ran 5-100x slower, starved by the engine's
OpenMP threads; inline, 32 MiB move in ~5 ms. A save reserves its keys (one overlapped round
trip for all of the step's plans), copies what it was granted and commits with each block's
checksum (hashed from the slot once every layer is in), so a block is READY only after all its
bytes landed; a failed save is aborted, never published. Runs of consecutive blocks and slots
move in one strided copy per layer. A load that cannot complete, or (with `verify_loads`) a
block whose slot no longer matches its committed checksum, reports its blocks through
`get_block_ids_with_load_errors`, and vLLM recomputes them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast

from kvcr_core import BlockKey, Reservation, SlotId
from kvcr_core.attach import AttachClient, Handle, RunnerUnavailable
from kvcr_core.checksums import block_checksum, parts_checksum
from kvcr_core.keys import NamespaceSpec
from kvcr_vllm.metadata import KVCRConnectorMetadata, LoadPlan, LoadsDone, SavePlan
from kvcr_vllm.settings import ConnectorSettings
from kvcr_vllm.stats import StatsRecorder

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvcr_vllm")


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
        self.block_tokens = spec.block_size_tokens
        self.num_blocks = num_blocks
        self.stats = stats
        identity = settings.identity or f"vllm-worker-{engine_id[:12]}-tp{tp_rank}"
        self.client = AttachClient(settings.socket, spec, block_bytes, identity=identity,
                                  timeout_s=settings.timeout_s)
        self._planes: list[tuple[torch.Tensor, int, int]] = []  # (bytes [blocks, page], off, n)
        self._pool_rows: torch.Tensor | None = None
        self._pool_attach = -1
        self._done_recving: set[str] = set()
        self._done_sync: set[str] = set()
        self._load_errors: set[int] = set()
        self._disabled = ""

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

    def _pool(self) -> torch.Tensor:
        import torch

        pool = self.client.pool  # attaches (or re-attaches) as needed; RunnerUnavailable if not
        if self._pool_rows is None or self._pool_attach != self.client.attach_count:
            rows = torch.frombuffer(pool.region.view, dtype=torch.uint8)
            self._pool_rows = rows[:pool.capacity_slots * pool.stride_bytes].view(
                pool.capacity_slots, pool.stride_bytes)
            self._pool_attach = self.client.attach_count
        return self._pool_rows

    def _ready(self) -> None:
        if self._disabled or not self._planes:
            raise RuntimeError(self._disabled or "KV caches not registered")

    # -- per step ------------------------------------------------------------------------------

    def start_load_kv(self, metadata: KVCRConnectorMetadata) -> None:
        for plan in metadata.loads:
            self._load(plan)

    def wait_for_save(self, metadata: KVCRConnectorMetadata) -> None:
        if not metadata.saves:
            return
        pending: list[tuple[SavePlan, Handle[Reservation] | None]] = []
        for plan in metadata.saves:  # all reservations in flight at once
            try:
                self._ready()
                keys = cast("Sequence[BlockKey]", plan.keys_by_rank[self.tp_rank])
                pending.append((plan, self.client.reserve_async(keys)))
            except (RunnerUnavailable, RuntimeError) as exc:
                self._save_failed(plan, exc)
                pending.append((plan, None))
        for plan, reservation in pending:
            if reservation is not None:
                self._save(plan, reservation)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving, self._done_recving = self._done_recving, set()
        return None, recving or None

    def loads_done(self) -> LoadsDone | None:
        """The synchronous loads this step copied (or failed: their blocks are load errors)."""
        done, self._done_sync = self._done_sync, set()
        return LoadsDone(frozenset(done)) if done else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        with contextlib.suppress(RunnerUnavailable):
            if self.client.attached:
                self.client.flush()  # the last commits/releases reach the Runner
        self.client.close()

    # -- copies --------------------------------------------------------------------------------

    def _load(self, plan: LoadPlan) -> None:
        start = time.perf_counter()
        self._load_errors.update(plan.failed_block_ids)
        (self._done_sync if plan.synchronous else self._done_recving).add(plan.req_id)
        if not plan.block_ids:
            return
        try:
            self._ready()
            rows = self._pool()
            slots = plan.slots_by_rank[self.tp_rank]
            for block, slot, length in runs(plan.block_ids, slots):
                for plane, off, page in self._planes:
                    plane[block:block + length].copy_(rows[slot:slot + length, off:off + page])
            if plan.checksums_by_rank:
                self._verify(plan, slots, plan.checksums_by_rank[self.tp_rank])
        except RunnerUnavailable:
            self.stats.failure("guard_unavailable")
            self._load_errors.update(plan.block_ids)
        except Exception:
            log.exception("kvcr load of %s failed; recomputing", plan.req_id)
            self.stats.failure("load_copy")
            self._load_errors.update(plan.block_ids)
        else:
            self.stats.add("loaded_blocks", len(plan.block_ids))
            self.stats.add("loaded_tokens", len(plan.block_ids) * self.block_tokens)
            self.stats.load_seconds(time.perf_counter() - start)

    def _verify(self, plan: LoadPlan, slots: tuple[int, ...], sums: tuple[int, ...]) -> None:
        """Blocks loaded with other bytes than those committed (changed in the pool since)
        are load errors: vLLM recomputes them."""
        bad = [block for block, slot, want in zip(plan.block_ids, slots, sums, strict=True)
               if self._loaded_checksum(block, slot) != want]
        if bad:
            self.stats.failure("load_checksum", len(bad))
            self._load_errors.update(bad)
            log.warning("kvcr: %d blocks of %s changed in the pool since their commit; "
                        "recomputing them", len(bad), plan.req_id)

    def _loaded_checksum(self, block: int, slot: int) -> int:
        """The checksum of what the KV cache now holds in `block` (host caches: so a writer
        racing the copy cannot slip by); of the pool slot after the copy (device caches:
        checking them would cost a copy back)."""
        if self._planes[0][0].device.type != "cpu":
            return block_checksum(self.client.pool.view(SlotId(slot)))
        return parts_checksum(plane[block].numpy().data for plane, _, _ in self._planes)

    def _save(self, plan: SavePlan, reservation: Handle[Reservation]) -> None:
        res = None
        try:
            res = reservation.result()
            if res.refused:
                self.stats.failure("save_refused", res.refused)
            pairs = [(b, s) for b, s in zip(plan.block_ids, res.slots, strict=True)
                     if s is not None]
            if not pairs:
                return
            rows = self._pool()
            blocks, slot_ids = zip(*pairs, strict=True)
            for block, slot, length in runs(blocks, slot_ids):
                for plane, off, page in self._planes:
                    rows[slot:slot + length, off:off + page].copy_(plane[block:block + length])
            view = self.client.pool.view  # every plane copied: the blocks are whole
            self.client.commit_nowait(
                res.op, checksums=[block_checksum(view(slot)) for slot in slot_ids])
            self.stats.add("stored_blocks", len(pairs))
            self.stats.add("stored_tokens", len(pairs) * self.block_tokens)
        except Exception as exc:
            self._save_failed(plan, exc)
            if res is not None:
                with contextlib.suppress(RunnerUnavailable):
                    self.client.abort(res.op)

    def _save_failed(self, plan: SavePlan, exc: BaseException) -> None:
        if isinstance(exc, RunnerUnavailable):
            self.stats.failure("guard_unavailable")
        elif not self._disabled:
            log.error("kvcr save of %s failed (%s); nothing was published", plan.req_id, exc)
            self.stats.failure("save_copy")
