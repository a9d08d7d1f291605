"""The Runner: one object per process that owns pool memory, block indexes and metrics.

Each namespace (kvcr_core.keys) gets its own `NamespaceStore`: a `SlotPool` (page-aligned
slots of the namespace's block size), a `BlockIndex` and an eviction policy, behind one lock.
Callers copy bytes themselves between `reserve`/`commit` (writes) and `acquire`/`release`
(reads); the store only hands out slots, so copies run outside the lock and in parallel.
A commit fixes each block's checksum (kvcr_core.checksums): given by the writer, or hashed
here for in-process writers that give none. Engines never see another namespace's blocks.

Pool memory is backed in this process when asked: all of it when a namespace opens
(`prefault`), or as the pool fills, `back_ahead` bytes ahead of the slots in use
(kvcr_core.memory: `HostRegion.back_ahead`).

Threading: every public method is thread-safe. Nothing here spins; the only threads are a
region's page backer (`back_ahead`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry

from kvcr_core.blockcopy import load_blocks, store_blocks
from kvcr_core.checksums import SlotChecksums, block_checksum
from kvcr_core.config import KVCRConfig, MemoryBacking
from kvcr_core.errors import CapacityError, ClosedError, UnknownNamespaceError
from kvcr_core.eviction import make_policy, resolve_policy
from kvcr_core.hintboard import HintBoard
from kvcr_core.hints import HintIntake, HintLimits
from kvcr_core.index import BlockIndex, Lease, Reservation
from kvcr_core.inventory import InventoryLog
from kvcr_core.keys import NamespaceSpec
from kvcr_core.logs import ThrottledLog
from kvcr_core.memory import HostRegion, RegionKind, SlotPool
from kvcr_core.metrics import CapacityResource, NamespaceUsage, RunnerMetrics
from kvcr_core.types import LOCAL_OWNER, BlockKey, NamespaceDigest, OpId, OwnerId, SlotId

log = logging.getLogger("kvcr_core")
_warn = ThrottledLog(log)
_REGION_KIND = {MemoryBacking.MEMFD: RegionKind.MEMFD,
                MemoryBacking.ANONYMOUS: RegionKind.ANONYMOUS}


class NamespaceStore:
    """Pool + index + policy of one namespace. All index calls hold `lock`."""

    def __init__(self, digest: NamespaceDigest, pool: SlotPool, index: BlockIndex,
                 metrics: RunnerMetrics) -> None:
        self.digest = digest
        self.pool = pool
        self.index = index
        self.checksums = SlotChecksums(index, pool.view)
        self.lock = threading.Lock()
        self.check_holes = pool.region.hole_fd is not None
        """Leases check their slots for punched holes (memfd pools other processes map)."""
        self._metrics = metrics
        self._clock = time.perf_counter
        self.spec: NamespaceSpec | None = None
        """What the namespace is (None when it was opened by digest alone): `kvcr status`
        names what keeps two engines' namespaces of one model apart."""

    @property
    def block_bytes(self) -> int:
        return self.pool.slot_bytes

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        start = self._clock()
        with self.lock:
            hit = self.index.lookup(keys)
        self._metrics.on_lookup(self._clock() - start, hit, len(keys) - hit)
        return hit

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self.lock:
            return self.index.contains(keys)

    def op_size(self, op: OpId) -> int:
        """Slots reservation or lease `op` holds (0: no such op)."""
        with self.lock:
            return self.index.op_size(op)

    def clear(self) -> int:
        """Drops every READY block not being read; returns how many went."""
        with self.lock:
            return self.index.discard(self.index.ready_keys())

    def reserve(self, keys: Sequence[BlockKey], owner: OwnerId = LOCAL_OWNER, *,
                limit: int | None = None) -> Reservation:
        """FILLING slots for `keys` (see BlockIndex.reserve; `limit`: the owner's quota)."""
        start = self._clock()
        with self.lock:
            index = self.index
            table_full = index.open_reservations >= index.max_reservations
            res = index.reserve(keys, owner, limit=limit)
            high_water = index.fresh_slots
        region = self.pool.region
        if region.ahead_bytes:  # the pages of what was just handed out are backed first
            region.note_used(high_water * self.pool.stride_bytes)
        self._metrics.on_reserve(
            self._clock() - start, res.refused,
            CapacityResource.RESERVATIONS if table_full else CapacityResource.SLOTS)
        return res

    def commit(self, op: OpId, owner: OwnerId | None = None,
               checksums: Sequence[int] | None = None) -> int:
        """Publishes reservation `op` with its blocks' `checksums` (the writer's, one per
        reserved slot in order; None: hashed here now). Returns the blocks published (0 for
        an unknown or foreign op). Raises ValueError, changing nothing, for a wrong count of
        checksums."""
        start = self._clock()
        with self.lock:
            slots = self.index.reserved_slots(op, owner)
            if slots is None:
                return 0
            if checksums is None:
                checksums = [block_checksum(self.pool.view(slot)) for slot in slots]
            elif len(checksums) != len(slots):
                raise ValueError(f"{len(checksums)} checksums for a reservation of "
                                 f"{len(slots)} blocks")
            n = self.index.commit(op, owner)
            self.checksums.record(slots, checksums)
        self._metrics.on_commit(self._clock() - start, n, self.pool.slot_bytes)
        return n

    def settle(self, op: OpId, keep: Mapping[BlockKey, int]) -> tuple[int, int]:
        """Publishes the reserved blocks in `keep` (key -> the checksum its bytes were verified
        against), frees the rest (see BlockIndex.settle)."""
        start = self._clock()
        with self.lock:
            published, dropped = self.index.settle(op, keep)
            slot_of = self.index.slot_of
            kept = [(slot, value) for key, value in keep.items()
                    if (slot := slot_of(key)) is not None]
            self.checksums.record([k[0] for k in kept], [k[1] for k in kept])
        self._metrics.on_commit(self._clock() - start, published, self.pool.slot_bytes)
        if dropped:
            self._metrics.on_reclaimed(dropped)
        return published, dropped

    def abort(self, op: OpId, owner: OwnerId | None = None) -> int:
        start = self._clock()
        with self.lock:
            n = self.index.abort(op, owner)
        self._metrics.on_abort(self._clock() - start, n)
        return n

    def acquire(self, keys: Sequence[BlockKey], owner: OwnerId = LOCAL_OWNER, *,
                prefix_only: bool = True, limit: int | None = None) -> Lease:
        """Leases READY slots (see BlockIndex.acquire; `limit`: the owner's quota)."""
        start = self._clock()
        with self.lock:
            table_full = self.index.open_leases >= self.index.max_leases
            lease = self.index.acquire(keys, owner, prefix_only=prefix_only, limit=limit)
            if lease.granted and self.check_holes:
                lease = self._without_holes(lease, keys, owner, prefix_only, limit)
        self._metrics.on_acquire(self._clock() - start, lease.granted, self.pool.slot_bytes,
                                 refused=table_full and not lease.granted)
        return lease

    def _without_holes(self, lease: Lease, keys: Sequence[BlockKey], owner: OwnerId,
                       prefix_only: bool, limit: int | None) -> Lease:
        """`lease`, unless a leased slot has a hole (its pages were punched out of the
        memfd by a process that maps it, and read as zeros): those blocks are dropped as
        corrupt and the keys leased again (they miss now)."""
        holed = self.pool.holed([s for s in lease.slots if s is not None])
        if not holed:
            return lease
        self.index.release(lease.op, owner)
        bad = [k for k in (self.index.key_of(s) for s in holed) if k is not None]
        self.index.discard(bad)
        self._metrics.on_holed(len(bad))
        _warn.log(logging.ERROR, "holes", "namespace %s: %d READY blocks had holes punched in "
                  "their pool pages (a process that maps the pool called fallocate?): "
                  "dropped, their prompts recompute", self.digest.hex(), len(bad))
        return self.index.acquire(keys, owner, prefix_only=prefix_only, limit=limit)

    def release(self, op: OpId, owner: OwnerId | None = None) -> bool:
        start = self._clock()
        with self.lock:
            ok = self.index.release(op, owner)
        self._metrics.on_release(self._clock() - start)
        return ok

    def drop_owner(self, owner: OwnerId) -> tuple[int, int]:
        """Aborts the reservations and releases the leases of a departed owner; returns
        (blocks aborted, leases released)."""
        with self.lock:
            aborted, released = self.index.drop_owner(owner)
        self._metrics.on_reclaimed(aborted)
        return aborted, released

    def view(self, slot: SlotId) -> memoryview:
        return self.pool.view(slot)

    def store(self, keys: Sequence[BlockKey], blocks: Sequence[bytes | memoryview]) -> int:
        """Copies `blocks[i]` in for every key not already present; returns blocks stored."""
        return store_blocks(self, self.pool, keys, blocks)

    def load(self, keys: Sequence[BlockKey]) -> list[bytes]:
        """Bytes of the longest READY prefix of `keys` (copied out under a lease)."""
        return load_blocks(self, self.pool, keys)

    def close(self) -> None:
        self.pool.close()


class _NamespaceEvents:
    """Feeds one namespace's index events into the Runner's inventory log."""

    def __init__(self, log: InventoryLog, digest: NamespaceDigest) -> None:
        self.log, self.digest = log, digest

    def stored(self, keys: list[BlockKey]) -> None:
        self.log.stored(self.digest, keys)

    def removed(self, keys: list[BlockKey]) -> None:
        self.log.removed(self.digest, keys)


class Runner:
    """Owns every namespace's pool within `config.pool_bytes`, the metrics, and the hint
    intake (`runner.hints.accept(raw)`: a validated `KVHint`, or None, counted)."""

    def __init__(self, config: KVCRConfig | None = None, *,
                 registry: CollectorRegistry | None = None) -> None:
        self.config = config or KVCRConfig()
        resolve_policy(self.config.eviction_policy)  # fail at construction, not first write
        self.metrics = RunnerMetrics(registry if registry is not None else CollectorRegistry())
        self.hints = HintIntake(self.metrics, HintLimits(
            max_actions=self.config.max_hint_actions, max_hashes=self.config.max_hint_hashes,
            max_bytes=self.config.max_hint_bytes))
        self.hint_board = HintBoard()
        self._stores: dict[NamespaceDigest, NamespaceStore] = {}
        self._backed: HostRegion | None = None  # pre-backed for the first namespace
        self.inventory = InventoryLog()
        self._lock = threading.Lock()
        self._closed = False
        self.metrics.bind_pool_gauges(self._usage)
        self.metrics.bind_hint_board(self.hint_board)

    def post_hint(self, raw: object, poster: str = "") -> int:
        """A hint for requests still to come (see `HintBoard`): validated and counted like any
        hint; returns the block hashes remembered (0 if it was rejected). `poster`: who
        posted it (a uid, a peer), each with its own share of the board."""
        hint = self.hints.accept(raw)
        return 0 if hint is None else self.hint_board.post(hint, poster)

    def back_first_pool(self, ahead_bytes: int = 0) -> int:
        """Creates and backs (prefaults) the memory of the first namespace's pool now (a
        daemon's start-up), so the first engine's attach does not wait for the backing and
        the daemon's loop is not held by it; that namespace takes it when it opens (if its
        pool is this size: the per-namespace size within `pool_bytes`). With `ahead_bytes`,
        backs only that much now and the rest as the pool fills (`HostRegion.back_ahead`).
        Returns the bytes backed."""
        cfg = self.config
        with self._lock:
            if self._closed or self._stores or self._backed is not None:
                return 0
            size = min(cfg.namespace_pool_bytes or cfg.pool_bytes, cfg.pool_bytes)
            region = HostRegion.create(size, _REGION_KIND[cfg.memory_backing], "kvcr-pool")
            if ahead_bytes:
                region.back_ahead(ahead_bytes, wait=True)
            else:
                region.prefault()
            self._backed = region
            return region.backed_bytes

    def open_namespace(self, namespace: NamespaceSpec | NamespaceDigest, block_bytes: int, *,
                       pool_bytes: int | None = None, prefault: bool = False,
                       back_ahead: int = 0) -> NamespaceStore:
        """The namespace's store, created on first use with slots of `block_bytes`.

        A new pool is backed here whole (`prefault`), or as it fills, `back_ahead` bytes
        ahead of the slots in use, on a background thread (the first ones included).

        Its pool takes `pool_bytes` (default: the config's per-namespace size), bounded by
        what is left of `config.pool_bytes`. Opening again with the same block size returns
        the same store; another block size is an error (the bytes would not be compatible).
        """
        digest = namespace.digest() if isinstance(namespace, NamespaceSpec) else namespace
        with self._lock:
            if self._closed:
                raise ClosedError("runner is closed")
            store = self._stores.get(digest)
            if store is not None and store.spec is None and isinstance(namespace, NamespaceSpec):
                store.spec = namespace
            if store is not None:
                if store.block_bytes != block_bytes:
                    raise ValueError(f"namespace {digest.hex()} holds blocks of "
                                     f"{store.block_bytes} bytes, not {block_bytes}")
                return store
            cfg = self.config
            want = pool_bytes or cfg.namespace_pool_bytes or cfg.pool_bytes
            left = cfg.pool_bytes - sum(s.pool.region.size_bytes for s in self._stores.values())
            region, self._backed = self._backed, None
            if region is not None and region.size_bytes > min(want, left):
                region.close()  # backed for a namespace of another size: not this one's
                region = None
            room = region.size_bytes if region is not None else min(want, left)
            slots = room // SlotPool.region_bytes_for(1, block_bytes)
            if slots < 1:
                if region is not None:
                    region.close()
                self.metrics.refused(CapacityResource.SLOTS)
                raise CapacityError(
                    f"no pool room for namespace {digest.hex()}: {left} of {cfg.pool_bytes} "
                    f"bytes left, a block needs {block_bytes}; raise pool_bytes, or set "
                    "namespace_pool_bytes so several namespaces fit")
            if region is None:
                region = HostRegion.create(SlotPool.region_bytes_for(slots, block_bytes),
                                           _REGION_KIND[cfg.memory_backing],
                                           f"kvcr-{digest.hex()[:12]}")
                if prefault:
                    region.prefault()
                elif back_ahead:
                    region.back_ahead(back_ahead)
            index = BlockIndex(slots, make_policy(cfg.eviction_policy, slots),
                               max_reservations=cfg.max_reservations,
                               max_leases=cfg.max_leases)
            index.listener = _NamespaceEvents(self.inventory, digest)
            store = NamespaceStore(digest, SlotPool(region, block_bytes), index, self.metrics)
            store.spec = namespace if isinstance(namespace, NamespaceSpec) else None
            self._stores[digest] = store
            return store

    def release_namespace(self, digest: NamespaceDigest) -> bool:
        """Forgets a namespace nobody uses: its READY blocks leave the inventory (removed)
        and its pool memory is given back (once no other process maps it either). False if
        it was not open."""
        with self._lock:
            store = self._stores.pop(digest, None)
        if store is None:
            return False
        with store.lock:
            store.index.discard(store.index.ready_keys())
        with contextlib.suppress(BufferError):  # a view still exported: unmapped with it
            store.close()
        return True

    def namespace(self, digest: NamespaceDigest) -> NamespaceStore:
        try:
            return self._stores[digest]
        except KeyError:
            raise UnknownNamespaceError(digest.hex()) from None

    @property
    def namespaces(self) -> tuple[NamespaceDigest, ...]:
        return tuple(self._stores)

    def _usage(self) -> list[NamespaceUsage]:
        return [NamespaceUsage(s.digest.hex()[:16], s.index.used_slots * s.pool.stride_bytes,
                               s.pool.capacity_slots * s.pool.stride_bytes, s.index.evictions)
                for s in list(self._stores.values())]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            stores, self._stores = self._stores, {}
            backed, self._backed = self._backed, None
        if backed is not None:
            backed.close()
        for store in stores.values():
            store.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
