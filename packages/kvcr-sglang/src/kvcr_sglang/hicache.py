"""`KVCRHiCacheStorage`: kvcr as an SGLang HiCache L3 storage backend (the SGLang seam:
this module imports SGLang and torch; `import kvcr_sglang` does not).

Load it with SGLang's own flags:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvcr",
        "module_path": "kvcr_sglang.hicache", "class_name": "KVCRHiCacheStorage",
        "interface_v1": 1, "mode": "guarded", "socket": "/run/kvcr/guard.sock"}'

SGLang builds it as `KVCRHiCacheStorage(storage_config, kwargs)` and then calls
`register_mem_pool_host`; only then are the page geometry and the kvcr namespace known, so
the connection to the Runner (embedded in this process, or a kvcr-guard) opens there.
`interface_v1: 1` selects the zero-copy path (pages copied straight between SGLang's host
pool and the kvcr pool); without it SGLang uses the generic get/set path (flat page tensors).
Both store the same bytes. Threads: SGLang's prefetch, prefetch-I/O and backup threads call
in concurrently; `PageStore` is thread-safe. Faults are misses (SGLang recomputes).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvcr_core.attach import EmbeddedRunner, Mode
from kvcr_sglang.hostpool import HostPages
from kvcr_sglang.pagestore import PageStore
from kvcr_sglang.settings import BackendSettings, namespace_for

log = logging.getLogger("kvcr_sglang")


class KVCRHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped
    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        self.is_writer = bool(storage_config.is_storage_writer)
        self.embedded: EmbeddedRunner | None = None  # started once the pool set is known
        self.pages: HostPages | None = None
        self.store: PageStore | None = None
        self.side: dict[str, tuple[Any, PageStore]] = {}  # v2 pools by name

    # -- registration --------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages(mem_pool_host, mla=bool(self.storage_config.is_mla_model))
        spec = namespace_for(self.storage_config, pages.geometry, self.settings)
        rank = f"tp{self.storage_config.tp_rank}-pp{self.storage_config.pp_rank}"
        identity = self.settings.identity or f"sglang-{rank}"
        if self.store is not None:
            self.store.close()
        self.pages = pages
        self.store = PageStore(self.settings, spec, pages.geometry.page_bytes,
                               identity=identity)
        log.info("kvcr HiCache backend: %s pages of %d bytes (%s), runner at %s",
                 pages.geometry.layout, pages.geometry.page_bytes, self.settings.mode.value,
                 self.settings.socket.replace("\0", "@"))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        old = self.side.pop(str(host_pool_name), None)
        if old is not None and old[1] is not self.store:
            old[1].close()

    def _pool(self, name: Any) -> tuple[Any, PageStore]:
        """A v2 pool's host pool and store (KV shares the v1 store: same bytes per page)."""
        key = str(name)
        found = self.side.get(key)
        if found is not None:
            return found
        pages, store = self._ready()
        pool = getattr(self, "registered_pools", {}).get(name)
        if key == PoolName.KV.value and (pool is None or pool is pages.pool):
            found = (pages.pool, store)
        elif pool is None:
            raise KeyError(f"SGLang registered no host pool named {key!r}")
        else:
            page_bytes = int(pool.get_dummy_flat_data_page().numel() *
                             pool.get_dummy_flat_data_page().element_size())
            spec = dataclasses.replace(store.spec, extra={
                **store.spec.extra, "pool": key, "pool_kind": type(pool).__name__,
                "page_bytes": str(page_bytes)})
            found = (pool, PageStore(self.settings, spec, page_bytes,
                                     identity=f"{store.client.identity}-{key}", hinted=False))
        self.side[key] = found
        return found

    def on_host_pools_registered(self) -> None:
        self._start_runner()

    def _start_runner(self) -> None:
        """Embedded mode: the Runner starts when SGLang has registered its host pools (or at
        first use). With side pools (hybrid models) and no `namespace_pool_bytes` set, the KV
        namespace gets 7/8 of the pool, so side pools have room by default."""
        if self.settings.mode is not Mode.EMBEDDED or self.embedded is not None:
            return
        runner = self.settings.runner
        side = [n for n in getattr(self, "registered_pools", {}) if str(n) != PoolName.KV.value]
        if side and runner.namespace_pool_bytes is None:
            runner = dataclasses.replace(runner, namespace_pool_bytes=runner.pool_bytes * 7 // 8)
            log.info("kvcr: side pools %s: KV takes 7/8 of the embedded pool",
                     ", ".join(map(str, side)))
        self.embedded = EmbeddedRunner(self.settings, runner=runner,
                                       metrics_offset=self.storage_config.tp_rank)
        # its socket's name ends in a random part: this process's stores attach there
        self.settings = dataclasses.replace(self.settings, socket=self.embedded.socket_path)
        if self.store is not None:
            self.store.client.retarget(self.embedded.socket_path)

    def _ready(self) -> tuple[HostPages, PageStore]:
        if self.pages is None or self.store is None:
            raise RuntimeError("register_mem_pool_host was not called: SGLang registers the "
                               "host pool right after building the backend")
        self._start_runner()
        return self.pages, self.store

    # -- zero-copy v1 --------------------------------------------------------------------------

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pages, store = self._ready()
        if not self.is_writer:  # replicated (MLA) KV: one rank writes for all
            return [True] * len(keys)
        return store.write(keys, pages.segments(host_indices, len(keys)))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pages, store = self._ready()
        return store.read(keys, pages.segments(host_indices, len(keys)))

    # -- generic -------------------------------------------------------------------------------

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        pages, store = self._ready()
        targets = (list(target_locations) if target_locations is not None
                   else [pages.pool.get_dummy_flat_data_page() for _ in keys])
        filled = store.read(keys, HostPages.tensor_segments(targets))
        return [t if ok else None for t, ok in zip(targets, filled, strict=True)]

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        targets = None if target_location is None else [target_location]
        return self.batch_get([key], targets)[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        _, store = self._ready()
        if values is None or len(values) != len(keys):
            return False
        if not self.is_writer:
            return True
        flat = [v.detach().reshape(-1).contiguous() for v in values]
        return all(store.write(keys, HostPages.tensor_segments(flat)))

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], None if value is None else [value])

    # -- v2 (hybrid models: KV plus side pools such as Mamba / SWA state) -----------------------

    def _offsets(self, pool: Any, transfer: PoolTransfer) -> list[int] | None:
        keys, page = transfer.keys or [], int(getattr(pool, "page_size", 1) or 1)
        indices = transfer.host_indices
        if indices is None or indices.numel() != len(keys) * page:
            log.error("kvcr v2 %s: %s host indices for %d pages of %d tokens", transfer.name,
                      None if indices is None else indices.numel(), len(keys), page)
            return None
        return [int(indices[i * page]) for i in range(len(keys))]

    def _each_v2(self, transfers: list[PoolTransfer],
                 io: Callable[[Any, PageStore, list[str], list[int]], list[bool]],
                 ) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            pool, store = self._pool(transfer.name)
            offsets = self._offsets(pool, transfer)
            results[transfer.name] = ([False] * len(keys) if offsets is None
                                      else io(pool, store, keys, offsets))
        return results

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        def store_pages(pool: Any, store: PageStore, keys: list[str],
                        offsets: list[int]) -> list[bool]:
            if not self.is_writer:
                return [True] * len(keys)
            flat = [pool.get_data_page(o, flat=True).contiguous() for o in offsets]
            return store.write(keys, HostPages.tensor_segments(flat))

        return self._each_v2(transfers, store_pages)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        def load_pages(pool: Any, store: PageStore, keys: list[str],
                       offsets: list[int]) -> list[bool]:
            targets = [pool.get_dummy_flat_data_page() for _ in keys]
            filled = store.read(keys, HostPages.tensor_segments(targets))
            for offset, target, ok in zip(offsets, targets, filled, strict=True):
                if ok:
                    pool.set_from_flat_data_page(offset, target)
            return filled

        return self._each_v2(transfers, load_pages)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None,
                        ) -> PoolTransferResult:
        """SGLang's v2 rule: the KV prefix, cut to the lengths at which every side pool
        satisfies its hit policy (all pages, or a trailing window ending there)."""
        _, store = self._ready()
        kv_pages = store.prefix_hits(keys)
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            have = self._pool(transfer.name)[1].present(keys[:kv_pages])
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = next((i for i, ok in enumerate(have) if not ok), kv_pages)
                allowed = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                allowed = {n for n in range(1, kv_pages + 1)
                           if all(have[max(0, n - window):n])}
            else:
                raise ValueError(f"kvcr supports the all_pages and trailing_pages hit policies, "
                                 f"not {transfer.hit_policy} (pool {transfer.name})")
            if allowed:
                hit_count[transfer.name] = max(allowed)
            restorable &= allowed
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hit_count, ordered)

    # -- queries -------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        _, store = self._ready()
        return store.present([key])[0]

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        _, store = self._ready()
        return store.prefix_hits(keys)

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` (with --enable-storage-metrics): pages and GB/s of each
        prefetch (read) and backup (write) call since the last call."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        stores = [] if self.store is None else [self.store]
        stores += [s for _, s in self.side.values() if s is not self.store]
        for store in stores:
            reads, writes = store.io.drain()
            metrics.prefetch_pgs.extend(p for p, _ in reads)
            metrics.prefetch_bandwidth.extend(g for _, g in reads)
            metrics.backup_pgs.extend(p for p, _ in writes)
            metrics.backup_bandwidth.extend(g for _, g in writes)
        return metrics

    def kvcr_stats(self) -> dict[str, int]:
        """kvcr's own counters for this backend (lookups, hits, stores, hinted fetches...)."""
        return {} if self.store is None else self.store.stats.as_dict()

    def clear(self) -> None:
        if self.store is not None:
            self.store.clear()

    def close(self) -> None:
        for _, store in self.side.values():
            if store is not self.store:
                store.close()
        self.side.clear()
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.embedded is not None:
            self.embedded.stop()
            self.embedded = None
