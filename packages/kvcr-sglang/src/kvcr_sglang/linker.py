"""`KVCRUnifiedCacheLinker`: kvcr as SGLang's unified-cache external linker (direct L3: the
device KV pool <-> the kvcr pool, no host tier). The SGLang seam for the linker.

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "KVCRUnifiedCacheLinker",
        "linker_module_path": "kvcr_sglang.linker",
        "linker_extra_config": {"mode": "guarded", "socket": "/run/kvcr/guard.sock"}}'

Contract (SGLang 0.5.23 `UnifiedCacheLinker`): `lookup` answers every restorable prefix
length from the kvcr index; `load` queues a request's pages and `start_layer_wise_loading`
leases them all (all or nothing) and hands them to the load thread, which copies layer by
layer and completes each layer on `layer_done_counter` (the forward waits per layer); a page
that vanished fails the batch, so SGLang aborts those requests instead of reading stale
slots. `offload` queues pages for the offload thread (reserve + copy + commit, all layers);
results come back in order through `pop_completed_offload`. Full-attention KV only (the
`KV` pool); plain MHA models get their pool view from SGLang's own `DevicePoolEntry`.
Threads: SGLang's scheduler thread calls in; one load thread and one offload thread copy.
Copies go through kvcr's copy engine (kvcr_core.copyengine), chosen from the device pool's
device: inline tensor copies on CPU pools; on CUDA the pool mapping pinned once per attach
(unpinned before it is unmapped) and copies on the engine's stream, each layer's event
synchronised before the layer is reported done, and each offload's before its pages are hashed
and committed (offloads first wait for SGLang's `record_offload_ready` events).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from kvcr_core.attach import EmbeddedRunner, Mode
from kvcr_core.copyengine import PoolBinding, engine_for
from kvcr_core.keys import NamespaceSpec
from kvcr_sglang.pagestore import PageStore
from kvcr_sglang.settings import BackendSettings

log = logging.getLogger("kvcr_sglang")
FIELD = "unified_cache_external_linker_config.linker_extra_config"


def _kv_pool_entry(params: Any, components: Any) -> tuple[Any, bool]:
    """SGLang's zero-copy view of the device KV pool, and whether KV is rank-replicated."""
    from sglang.srt.mem_cache.hybrid_cache import linker_pool_assembler as assembler

    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    try:
        group = assembler.resolve_hybrid_device_pool_group(
            kvcache=kvcache, page_size=params.page_size, params=params, components=components)
    except ValueError:  # SGLang 0.5.23 builds no linker view for plain full-attention pools
        if not hasattr(kvcache, "k_buffer"):
            raise
        layers = {layer: layer for layer in range(len(kvcache.k_buffer))}
        return assembler._mha_device_pool_entry(PoolName.KV, kvcache, layers,
                                                params.page_size), False
    extra = sorted(str(name) for name in group.entry_map if name != PoolName.KV)
    if extra:
        raise ValueError(f"kvcr's linker moves full-attention KV only; this model also has "
                         f"{', '.join(extra)} pools: use kvcr as a HiCache storage backend")
    return group.entry_map[PoolName.KV], bool(group.rank_replicated)


class KVCRUnifiedCacheLinker(UnifiedCacheLinker):  # type: ignore[misc]  # SGLang is untyped
    def __init__(self, server_args: Any, params: Any, *, components: Any,
                 extra_config: dict[str, Any] | None = None, forward_stream: Any = None,
                 **_: Any) -> None:
        self.forward_stream = forward_stream
        self.settings = BackendSettings.from_extra_config(extra_config, field=FIELD)
        self.page_tokens = int(params.page_size)
        self.entry, replicated = _kv_pool_entry(params, components)
        self.pools = {PoolName.KV: self.entry}
        kvcache = self.entry.device_pool
        self.num_layers = len(kvcache.k_buffer)
        tp_rank, tp_size = 0, 1
        group = getattr(params, "attn_tp_cache_group", None) or getattr(
            params, "tp_cache_group", None)
        if group is not None and torch.distributed.is_initialized():
            tp_rank = torch.distributed.get_rank(group=group)
            tp_size = torch.distributed.get_world_size(group=group)
        self.offload_owner = not replicated or tp_rank == 0
        k0 = kvcache.k_buffer[0]
        self.layer_bytes = int(k0[0].numel() * k0.element_size()) * self.page_tokens
        spec = self._namespace(kvcache, params, replicated, tp_rank, tp_size)
        self.embedded: EmbeddedRunner | None = None
        if self.settings.mode is Mode.EMBEDDED:
            self.embedded = EmbeddedRunner(self.settings, metrics_offset=tp_rank)
            self.settings = dataclasses.replace(self.settings, socket=self.embedded.socket_path)
        self.store = PageStore(self.settings, spec, 2 * self.num_layers * self.layer_bytes,
                               identity=self.settings.identity or f"sglang-linker-tp{tp_rank}")
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        self.copies = engine_for(kvcache.k_buffer[0].device)
        self.binding = PoolBinding(self.copies, self.store.client, self._pin_failed)
        self.pending: dict[str, list[PoolTransfer]] = {}
        self._loads: queue.Queue[tuple[int, list[PoolTransfer]] | None] = queue.Queue()
        self._offloads: queue.Queue[tuple[list[PoolTransfer], list[Any]] | None] = (
            queue.Queue())
        self._offload_results: queue.Queue[bool] = queue.Queue()
        self._threads = [threading.Thread(target=self._load_loop, daemon=True,
                                          name=f"kvcr-linker-load-tp{tp_rank}"),
                         threading.Thread(target=self._offload_loop, daemon=True,
                                          name=f"kvcr-linker-offload-tp{tp_rank}")]
        for thread in self._threads:
            thread.start()

    def _namespace(self, kvcache: Any, params: Any, replicated: bool, tp_rank: int,
                   tp_size: int) -> NamespaceSpec:
        import sglang

        dtype = str(kvcache.store_dtype).removeprefix("torch.")
        return NamespaceSpec(
            model_id=self.settings.model_id or "sglang-model", dtype=dtype, kv_dtype=dtype,
            block_size_tokens=self.page_tokens, num_layers=self.num_layers,
            num_kv_heads=int(kvcache.head_num), head_dim=int(kvcache.head_dim),
            layout=f"sglang-{sglang.__version__}/linker/{type(kvcache).__name__}",
            tp_size=1 if replicated else tp_size, tp_rank=0 if replicated else tp_rank,
            tenant=self.settings.tenant,
            extra={"pp": f"{params.pp_rank}/{params.pp_size}"})

    # -- lookup and load -----------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or not kv.keys:
            return []
        return list(range(1, self.store.prefix_hits(list(kv.keys)) + 1))

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = [t for t in transfers if t.name == PoolName.KV and t.keys]
        if not kv:
            return False
        if rid in self.pending:
            raise RuntimeError(f"kvcr linker: a load for rid={rid} is already queued")
        self.pending[rid] = kv
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self.pending:
            return -1
        batch = [t for transfers in self.pending.values() for t in transfers]
        self.pending = {}
        index = int(self.layer_done_counter.update_producer())
        self._loads.put((index, batch))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return bool(self.layer_done_counter.finish(counter_index))

    def _pin_failed(self) -> None:
        self.store.stats.failures += 1  # the engine logged it; copies go on, pageable

    def _page_views(self, transfer: PoolTransfer) -> list[list[torch.Tensor]]:
        """Per page: the byte views of its K rows of every layer, then its V rows (block order),
        on the pool's device (CPU here, GPU memory in production)."""
        indices = self._device_indices(transfer)
        kvcache = self.entry.device_pool
        buffers = [*kvcache.k_buffer, *kvcache.v_buffer]
        views = []
        for start in indices[::self.page_tokens].tolist():
            views.append([b[start:start + self.page_tokens].view(torch.uint8).reshape(-1)
                          for b in buffers])
        return views

    def _load_loop(self) -> None:
        while (task := self._loads.get()) is not None:
            index, batch = task
            leases: list[tuple[int, list[int]]] = []
            try:
                plans = []
                for transfer in batch:
                    leased = self.store.lease(list(transfer.keys))
                    if leased is None:
                        raise LookupError(f"{len(transfer.keys)} pages are no longer in kvcr")
                    leases.append(leased)
                    plans.append((leased[1], self._page_views(transfer)))
                self._copy_layers(index, plans)
            except BaseException as exc:
                log.warning("kvcr linker load failed (%s); SGLang aborts those requests", exc)
                self.layer_done_counter.fail(index, exc)
            finally:
                for op, slots in leases:
                    self.store.unlease(op, len(slots))

    def _copy_layers(self, index: int, plans: list[tuple[list[int], list[list[torch.Tensor]]]]
                     ) -> None:
        """Layer by layer, so the forward starts on layer 0 while later layers still load;
        a layer is reported done only once its copies completed."""
        n, size = self.num_layers, self.layer_bytes
        for layer in range(n):
            with self.binding.use() as rows:
                pool = rows.view(-1)
                self.copies.copy([(views[part], pool[offset + part * size:
                                                     offset + (part + 1) * size])
                                  for offsets, pages in plans
                                  for offset, views in zip(offsets, pages, strict=True)
                                  for part in (layer, n + layer)])  # K, then V of this layer
                job = self.copies.record()
            job.wait()
            self.layer_done_counter.complete(index, layer)

    def _device_indices(self, transfer: PoolTransfer) -> torch.Tensor:
        indices = transfer.device_indices if transfer.device_indices is not None else (
            transfer.host_indices)
        if indices is None:
            raise ValueError("a KV transfer without device indices")
        result: torch.Tensor = indices[: len(transfer.keys) * self.page_tokens].cpu()
        return result

    # -- offload -------------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        kv = [t for t in transfers if t.name == PoolName.KV and t.keys]
        ready = self.record_offload_ready() if self.copies.asynchronous else []
        self._offloads.put((kv, ready))
        return True

    def _offload_loop(self) -> None:
        while (task := self._offloads.get()) is not None:
            batch, ready = task
            ok = True
            try:
                for event in ready:  # the forward finished writing these pages
                    event.synchronize()
                for transfer in batch if self.offload_owner else []:
                    ok = self._offload_one(transfer) and ok
            except Exception as exc:
                log.warning("kvcr linker offload failed (%s)", exc)
                ok = False
            self._offload_results.put(ok)

    def _offload_one(self, transfer: PoolTransfer) -> bool:
        keys = list(transfer.keys)
        reserved = self.store.reserve(keys)
        if reserved is None:
            return False
        op, offsets, refused = reserved
        size = self.layer_bytes
        try:
            pages = [(offset, views) for offset, views in
                     zip(offsets, self._page_views(transfer), strict=True) if offset is not None]
            with self.binding.use() as rows:
                pool = rows.view(-1)
                self.copies.copy([(pool[offset + part * size:offset + (part + 1) * size], view)
                                  for offset, views in pages
                                  for part, view in enumerate(views)])
                job = self.copies.record()
            job.wait()  # the bytes are in the pool: now they can be hashed
        except BaseException:
            self.store.abort(op)
            raise
        return self.store.seal(op, [offset for offset, _ in pages]) and refused == 0

    def num_completed_offloads(self) -> int:
        return self._offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self._offload_results.get_nowait()

    # -- lifecycle -----------------------------------------------------------------------------

    def _quiesce(self) -> None:
        self.pending = {}
        self._loads.put(None)  # after what is queued: the threads finish it, then stop
        self._offloads.put(None)
        for thread in self._threads:
            thread.join(timeout=30)

    def reset(self) -> None:
        self._quiesce()
        while not self._offload_results.empty():
            self._offload_results.get_nowait()
        self.layer_done_counter.reset()
        self._threads = [threading.Thread(target=self._load_loop, daemon=True),
                         threading.Thread(target=self._offload_loop, daemon=True)]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self._quiesce()
        self.binding.release()  # unpinned before the attachment unmaps the pool
        self.store.close()
        if self.embedded is not None:
            self.embedded.stop()
            self.embedded = None
