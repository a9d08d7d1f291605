"""`KVCRConnectorWorker`: the connector's worker side (one per TP rank, in vLLM's worker).

Copies whole block pages as opaque bytes (vLLM's CPU page layout depends on the ISA) between
vLLM's KV tensors and the kvcr pool mapped from the Runner (embedded or kvcr-guard). A block's
slot holds every layer's page back to back, in vLLM's layer order.

Copies go through a copy engine (kvcr_core.copyengine), chosen from the KV tensors' device:
- CPU: inline, at memcpy speed (measured here: a separate copy thread ran 5-100x slower,
  starved by the engine's OpenMP threads; inline, 32 MiB move in ~5 ms). Loads are
  synchronous: `start_load_kv` copies before the forward pass of the very step that runs the
  request, and reports them done in its `WorkerReport` (with the saves it committed); saves
  run in `wait_for_save` after the forward wrote the step's KV.
- CUDA: the pool mapping pinned, copies on kvcr's own stream; saves layer by layer through
  `save_kv_layer`, overlapping the forward (`saves.SavePipeline`); loads asynchronous (the
  request waits in WAITING_FOR_REMOTE_KVS), reported through `get_finished`.
Either way a save reserves its keys (one overlapped round trip for all of the step's plans),
copies what it was granted and commits with each block's checksum (hashed from the slot once
every layer is in) only after its copies completed, so a block is READY only after all its
bytes landed; a failed save is aborted, never published. A load is reported done only once
its copies completed. Runs of consecutive blocks and slots move in
one strided copy per layer. A load that cannot complete, or (with `verify_loads`) a block whose
slot no longer matches its committed checksum, reports its blocks through
`get_block_ids_with_load_errors`, and vLLM recomputes them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from kvcr_core import SlotId
from kvcr_core.attach import AttachClient, Mode, RunnerError
from kvcr_core.checksums import block_checksum, parts_checksum
from kvcr_core.copyengine import (
    CopyEngine,
    CopyFailed,
    CopyJob,
    PoolBinding,
    copy_blocks,
    engine_for,
)
from kvcr_core.keys import NamespaceSpec
from kvcr_core.sealing import Sealer, hash_thread_count
from kvcr_vllm.metadata import KVCRConnectorMetadata, LoadPlan, WorkerReport
from kvcr_vllm.saves import SavePipeline, save_failed
from kvcr_vllm.settings import ConnectorSettings
from kvcr_vllm.stats import StatsRecorder

if TYPE_CHECKING:
    import torch

    from kvcr_core.copyengine import Plane

log = logging.getLogger("kvcr_vllm")


class KVCRConnectorWorker:
    def __init__(self, settings: ConnectorSettings, specs: NamespaceSpec | list[NamespaceSpec],
                 tp_rank: int, block_bytes: int, num_blocks: int, stats: StatsRecorder,
                 engine_id: str, *, groups: list[tuple[str, ...]] | None = None,
                 writes: list[bool] | None = None,
                 copy_engine: CopyEngine | None = None) -> None:
        """`specs`: this rank's namespace of each KV cache group; `groups`: each group's layer
        names (None: one group, every layer); `writes`: per group, whether this rank saves it
        (not an MLA group's on ranks other than 0: rank 0 writes the namespace every rank
        reads); `copy_engine`: None picks one from the KV tensors' device at registration."""
        specs = [specs] if isinstance(specs, NamespaceSpec) else list(specs)
        self.settings = settings
        self.tp_rank = tp_rank
        self.block_bytes = block_bytes
        self.groups = groups
        self.writes = writes or [True] * len(specs)
        self.block_tokens = specs[0].block_size_tokens
        self.num_blocks = num_blocks
        self.stats = stats
        identity = settings.identity or f"vllm-worker-{engine_id[:12]}-tp{tp_rank}"
        self.client = AttachClient(settings.socket, specs, block_bytes, identity=identity,
                                  timeout_s=settings.timeout_s, map_pages=True,
                                  runner_uids=settings.trusted_runner_uids)
        self.copy_engine = copy_engine
        self.sealer = Sealer(hash_thread_count(settings.runner.hash_threads),
                              name=f"kvcr-sealer-tp{tp_rank}")
        self._planes: list[list[Plane]] = []  # per group: (bytes [blocks, page], offset in
        # the slot, page)
        self._binding: PoolBinding | None = None
        self._saves: SavePipeline | None = None
        self._loads: list[tuple[LoadPlan, CopyJob, float]] = []  # issued, not yet complete
        self._open_loads: dict[str, int] = {}  # a request's plans (one per group) not finished
        self._loaded: dict[str, int] = {}  # the most blocks one of its plans loaded, so far
        self._done_recving: set[str] = set()
        self._done_sync: set[str] = set()
        self._load_errors: set[int] = set()
        self._disabled = ""
        self._cuda_failures = 0  # the copy engine's failed CUDA calls counted so far

    # -- registration --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Views every layer's KV tensor as [num_blocks, page bytes] (no copy), grouped by KV
        cache group. (Layers of several groups may share one tensor: their blocks are
        different blocks of it.)"""
        import torch

        group_of = {name: g for g, names in enumerate(self.groups or ()) for name in names}
        layers: list[dict[str, list[Plane]]] = [{} for _ in self.groups or [()]]
        offsets = [0] * len(layers)
        for name, tensor in kv_caches.items():
            g = group_of.get(name, 0) if self.groups else 0
            if self.groups and name not in group_of:
                continue  # no KV cache group: nothing vLLM's block tables address
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
                layers[g].setdefault(name, []).append((as_bytes, offsets[g], page))
                offsets[g] += page
        if any(offset != self.block_bytes for offset in offsets):
            self._disable(f"KV pages add up to {offsets} bytes per block (per KV cache group), "
                          f"the KV cache spec says {self.block_bytes}")
            return
        self._planes = [[plane for planes in group.values() for plane in planes]
                        for group in layers]
        offset = self.block_bytes
        engine = self.copy_engine or engine_for(self._planes[0][0][0].device)
        self.copy_engine = engine
        self._binding = PoolBinding(engine, self.client,
                                    on_pin_failed=lambda: self.stats.failure("pin_failed"))
        self._saves = SavePipeline(self.client, self._binding, layers, self.tp_rank,
                                   self.block_tokens, self.stats, self.sealer, self.writes)
        if engine.asynchronous and self.settings.mode is Mode.GUARDED:  # pin now, not in the
            with contextlib.suppress(RunnerError), self._binding.use():  # first step's copies
                pass  # (an embedded Runner is not up yet: the first copy pins)
        log.info("kvcr worker tp%d: %d KV cache groups of %d planes, %d bytes per block, %s "
                 "copies, pool at %s", self.tp_rank, len(self._planes), len(self._planes[0]),
                 offset, type(engine).__name__,
                 self.settings.socket.replace("\0", "@"))

    def _disable(self, why: str) -> None:
        self._disabled = why
        self.stats.failure("config")
        log.error("kvcr disabled on this worker: %s (requests recompute)", why)

    def _ready(self) -> PoolBinding:
        if self._disabled or self._binding is None:
            raise RuntimeError(self._disabled or "KV caches not registered")
        return self._binding

    # -- per step ------------------------------------------------------------------------------

    def bind(self, metadata: KVCRConnectorMetadata) -> None:
        """The step's metadata is bound: its saves' reservations go out now (to the Runner
        the scheduler side names)."""
        if metadata.runner_socket:
            self.client.retarget(metadata.runner_socket)
        if self._saves is not None and metadata.saves:
            self._saves.begin(metadata)

    def start_load_kv(self, metadata: KVCRConnectorMetadata) -> None:
        began = time.perf_counter()  # (a CPU load copies while it is issued)
        for plan in metadata.loads:
            self._open_loads[plan.req_id] = self._open_loads.get(plan.req_id, 0) + 1
        issued = [plan for plan in metadata.loads if self._issue_load(plan)]
        if issued:
            assert self.copy_engine is not None
            job = self.copy_engine.record()
            self._loads += [(plan, job, began) for plan in issued]
            if any(plan.synchronous for plan in issued):
                with contextlib.suppress(CopyFailed):  # (the poll reports a failed copy)
                    job.wait()  # this step's forward pass reads these blocks
        self._poll()

    def save_kv_layer(self, metadata: KVCRConnectorMetadata, layer_name: str) -> None:
        if (self._saves is not None and self.copy_engine is not None
                and self.copy_engine.asynchronous):
            self._saves.save_layer(metadata, layer_name)

    def wait_for_save(self, metadata: KVCRConnectorMetadata) -> None:
        if self._saves is None:
            for plan in metadata.saves:
                if not self._disabled:
                    save_failed(self.stats, plan, RuntimeError("KV caches not registered"))
            return
        self._saves.finish(metadata)
        self._poll()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._poll()
        recving, self._done_recving = self._done_recving, set()
        return None, recving or None

    def report(self) -> WorkerReport | None:
        """The synchronous loads this step copied (or failed: their blocks are load errors)
        and the keys this worker committed since its last report (None: nothing to say)."""
        done, self._done_sync = self._done_sync, set()
        saved, suspect = self._saves.take_report() if self._saves is not None else ((), False)
        if not (done or saved or suspect):
            return None
        return WorkerReport(frozenset(done), frozenset(saved), suspect)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Finishes what is in flight, unpins the pool, then detaches (which unmaps it)."""
        for _, job, _ in self._loads:
            with contextlib.suppress(CopyFailed):
                job.wait()  # a failed copy is reported by the poll
        if self._saves is not None:
            self._saves.drain()
        self._poll_loads()
        with contextlib.suppress(RunnerError):
            self.client.flush()  # the last commits/releases reach the Runner
        self.sealer.close(timeout_s=0.0)  # drained above: only stops its threads
        if self._binding is not None:
            self._binding.release()
        self.client.close()

    def _poll(self) -> None:
        self._poll_loads()
        if self._saves is not None:
            self._saves.poll()
        failed = getattr(self.copy_engine, "cuda_failures", 0)  # the CUDA engine's
        if failed > self._cuda_failures:
            self.stats.failure("cuda_call", failed - self._cuda_failures)
            self._cuda_failures = failed

    # -- loads ---------------------------------------------------------------------------------

    def _issue_load(self, plan: LoadPlan) -> bool:
        """Issues the plan's copies; False if it is settled already (nothing to load, or
        failed: its blocks are load errors)."""
        self._load_errors.update(plan.failed_block_ids)
        if not plan.block_ids:
            self._finished(plan)
            return False
        try:
            binding = self._ready()
            with binding.use(plan.group) as rows:
                copy_blocks(binding.engine, self._planes[plan.group], rows,
                            [(plan.block_ids, plan.slots_by_rank[self.tp_rank])],
                            into_pool=False)
        except Exception as exc:
            self._load_failed(plan, exc)
            return False
        return True

    def _poll_loads(self) -> None:
        """Loads whose copies completed: verified (with `verify_loads`), then finished."""
        pending, self._loads = self._loads, []
        for plan, job, start in pending:
            try:
                if not job.done():
                    self._loads.append((plan, job, start))
                    continue
                if plan.checksums_by_rank:
                    self._verify(plan, plan.slots_by_rank[self.tp_rank],
                                 plan.checksums_by_rank[self.tp_rank])
            except Exception as exc:
                self._load_failed(plan, exc)
                continue
            self.stats.add("loaded_blocks", len(plan.block_ids))  # every group's
            self._finished(plan, len(plan.block_ids), start)

    def _load_failed(self, plan: LoadPlan, exc: Exception) -> None:
        """The plan's blocks are load errors (vLLM recomputes them); the load is finished."""
        if isinstance(exc, RunnerError):
            self.stats.failure("guard_unavailable")
        else:
            log.error("kvcr load of %s failed (%s); recomputing", plan.req_id, exc)
            self.stats.failure("load_copy")
        self._load_errors.update(plan.block_ids)
        self._finished(plan)

    def _finished(self, plan: LoadPlan, loaded: int = 0, start: float | None = None) -> None:
        """Reported done where vLLM looks, once every group's plan of its request is: a
        synchronous load with the step's output (`report`), an asynchronous one through
        `get_finished`; counted then, once per request (its tokens: those of the group that
        loaded the most blocks)."""
        req = plan.req_id
        if loaded:
            self._loaded[req] = max(self._loaded.get(req, 0), loaded)
        left = self._open_loads.pop(req, 1) - 1
        if left > 0:
            self._open_loads[req] = left
            return
        blocks = self._loaded.pop(req, 0)
        if blocks and start is not None:
            self.stats.add("loaded_tokens", blocks * self.block_tokens)
            self.stats.load_seconds(time.perf_counter() - start)
        (self._done_sync if plan.synchronous else self._done_recving).add(plan.req_id)

    def _verify(self, plan: LoadPlan, slots: tuple[int, ...], sums: tuple[int, ...]) -> None:
        """Blocks loaded with other bytes than those committed (changed in the pool since)
        are load errors: vLLM recomputes them."""
        bad = [block for block, slot, want in zip(plan.block_ids, slots, sums, strict=True)
               if self._loaded_checksum(plan.group, block, slot) != want]
        if bad:
            self.stats.failure("load_checksum", len(bad))
            self._load_errors.update(bad)
            log.warning("kvcr: %d blocks of %s changed in the pool since their commit; "
                        "recomputing them", len(bad), plan.req_id)

    def _loaded_checksum(self, group: int, block: int, slot: int) -> int:
        """The checksum of what the KV cache now holds in `block` (host caches: so a writer
        racing the copy cannot slip by); of the pool slot after the copy (device caches:
        checking them would cost a copy back)."""
        if self._planes[group][0][0].device.type != "cpu":
            return block_checksum(self.client.pool(group).view(SlotId(slot)))
        return parts_checksum(plane[block].numpy().data for plane, _, _ in self._planes[group])
