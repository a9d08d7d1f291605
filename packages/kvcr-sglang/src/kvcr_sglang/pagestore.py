"""`PageStore`: SGLang pages as kvcr blocks, for the HiCache backend and the linker.

Owns the key mapping (SGLang's 64-hex SHA-256 page hash -> its first 16 bytes, the kvcr
block key; any other string -> BLAKE2b-128 of it), the prefix lookup, and the copies between
SGLang page memory (addresses, as SGLang's zero-copy interface hands them out) and pool slots.
A block is one page's segments back to back, in a canonical order fixed by the caller.

Writes are reserve + copy + seal: a page is visible to any reader only after all its bytes
landed; a failed copy aborts; the sealer (kvcr_core.sealing) hashes the copied pages on its
threads and commits them with those checksums, so SGLang's thread never waits for a hash (a
write returns True for pages kept or being sealed). Reads are acquire + copy + release under a
lease, so eviction never recycles a slot being read; with `verify_loads` each page read is
checked against its committed checksum (a page changed in the pool since is a miss, counted in
`corrupt_pages`): `read` hashes what it copied into SGLang's page, `lease` (the linker, which
copies layer by layer afterwards) the leased slots. On a miss, pages a posted hint names a peer
for are fetched first; without one (`pull_on_miss`), the run a peer holds, as the Runner follows
its peers' inventories. Every kvcr fault (guard down, refused, protocol) becomes a miss or a
failed store: SGLang then recomputes, never reads wrong bytes. Thread-safe: SGLang's prefetch,
I/O and backup threads share one `AttachClient` (its own lock orders requests); copies run
outside it (ctypes.memmove releases the GIL).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import logging
import threading
import time
from collections.abc import Sequence
from hashlib import blake2b

from kvcr_core.attach import (
    AttachClient,
    EngineSettings,
    HintedFetcher,
    HintedRun,
    RunnerError,
    RunnerUnavailable,
    Skipped,
    hinted_run,
)
from kvcr_core.checksums import block_checksum, parts_checksum
from kvcr_core.config import verifies_loads
from kvcr_core.keys import NamespaceSpec
from kvcr_core.sealing import Sealer, hash_thread_count
from kvcr_core.types import KEY_BYTES, BlockKey, OpId

log = logging.getLogger("kvcr_sglang")

Segments = Sequence[tuple[int, int]]  # (address, bytes) of one page's pieces, in block order


def copy_segments(block_address: int, segments: Segments, *, into_slot: bool) -> None:
    """One page's segments to (or from) one contiguous block, back to back (memmove; releases
    the GIL)."""
    offset = block_address
    for address, size in segments:
        if into_slot:
            ctypes.memmove(offset, address, size)
        else:
            ctypes.memmove(address, offset, size)
        offset += size


def segments_checksum(segments: Segments) -> int:
    """The block checksum of a page as its segments now hold it (host memory)."""
    return parts_checksum(memoryview((ctypes.c_char * size).from_address(address))
                          for address, size in segments)


def router_hash(page_key: str) -> int | None:
    """The block hash routers and SGLang's KV events use for a page: the first 16 hex digits
    of its page hash, as an unsigned 64-bit int (events send it signed; hints normalise)."""
    try:
        return int(page_key[:16], 16) if len(page_key) == 64 else None
    except ValueError:
        return None


def block_key(page_key: str) -> BlockKey:
    """SGLang page hashes are already content addresses (SHA-256 chains): keep 16 bytes."""
    if len(page_key) == 64:
        try:
            return BlockKey(bytes.fromhex(page_key)[:KEY_BYTES])
        except ValueError:
            pass
    return BlockKey(blake2b(page_key.encode(), digest_size=KEY_BYTES).digest())


class PageStoreStats:
    """Plain counters (read by `kvcr_stats()` and the benchmark); updated under the GIL."""

    __slots__ = ("corrupt_pages", "failures", "hinted_fetched_pages", "hinted_fetches",
                 "hit_pages", "lookups", "miss_pages", "pulled_pages", "pulls", "read_pages",
                 "stored_pages")

    def __init__(self) -> None:
        self.lookups = self.hit_pages = self.miss_pages = 0
        self.stored_pages = self.read_pages = self.failures = self.corrupt_pages = 0
        self.hinted_fetches = self.hinted_fetched_pages = self.pulls = self.pulled_pages = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class IoSamples:
    """Pages and GB/s of each read / write call since the last `drain` (SGLang's storage
    metrics histograms); bounded, oldest dropped. Thread-safe."""

    def __init__(self, limit: int = 4096) -> None:
        self._lock = threading.Lock()
        self.reads: collections.deque[tuple[int, float]] = collections.deque(maxlen=limit)
        self.writes: collections.deque[tuple[int, float]] = collections.deque(maxlen=limit)

    def add(self, samples: collections.deque[tuple[int, float]], pages: int, nbytes: int,
            seconds: float) -> None:
        if pages:
            with self._lock:
                samples.append((pages, nbytes / max(seconds, 1e-9) / 1e9))

    def drain(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        with self._lock:
            reads, writes = list(self.reads), list(self.writes)
            self.reads.clear()
            self.writes.clear()
        return reads, writes


class PageStore:
    def __init__(self, settings: EngineSettings, spec: NamespaceSpec, block_bytes: int, *,
                 identity: str, hinted: bool = True) -> None:
        """Pages of `spec` in the Runner `settings` names; `hinted`: fetch what hints name
        from `settings.peer.peers`."""
        self.spec = spec
        self.block_bytes = block_bytes
        self.verify_setting = settings.runner.verify_loads
        self.client = AttachClient(settings.socket, spec, block_bytes, identity=identity,
                                   timeout_s=settings.timeout_s, map_pages=True,
                                   runner_uids=settings.trusted_runner_uids)
        self.fetcher = HintedFetcher(self.client,
                                     settings.peer.peers if hinted else frozenset(),
                                     settings.peer.fetch_deadline_s)
        self.pull_on_miss = settings.peer.pull_on_miss
        self.stats = PageStoreStats()
        self.sealer = Sealer(hash_thread_count(settings.runner.hash_threads),
                             name="kvcr-sealer-sglang")
        self._settle_s = settings.timeout_s
        self.io = IoSamples()
        self._base_lock = threading.Lock()
        self._base: tuple[int, int, object] | None = None  # (attach count, address, export)
        self._warned: set[str] = set()

    # -- lookups -------------------------------------------------------------------------------

    def prefix_hits(self, page_keys: Sequence[str]) -> int:
        """How many leading pages are READY (0 when kvcr is unavailable)."""
        if not page_keys:
            return 0
        self._settle()
        self.stats.lookups += 1
        keys = [block_key(k) for k in page_keys]
        try:
            hits = self.client.lookup(keys)
            if hits < len(keys) and self.fetcher.peers:
                hits = self._fetch_hinted(page_keys, keys, hits)
        except RunnerError as exc:
            self._fault("lookup", exc)
            hits = 0
        self.stats.hit_pages += hits
        self.stats.miss_pages += len(page_keys) - hits
        return hits

    def _fetch_hinted(self, page_keys: Sequence[str], keys: list[BlockKey], hits: int) -> int:
        """Pages missed here that a posted hint says a peer holds, or else (pull on miss) the
        run a peer holds as its inventory says: the Runner fetches that run right after the
        local prefix (core's `HintedFetcher`), then we look again. Runs in SGLang's prefetch
        thread, bounded by the fetch deadline."""
        hashes: list[int] = []
        for page_key in page_keys[hits:]:
            h = router_hash(page_key)
            if h is None:
                break
            hashes.append(h)
        sources = self.client.hint_sources(hashes) if hashes else []
        run = hinted_run(hits, sources)
        if run is None and self.pull_on_miss:
            found = self.client.remote_run(keys[hits:])
            run = None if found is None else HintedRun(found[0], hits, hits + found[1])
            pulled = run is not None
        else:
            pulled = False
        started = self.fetcher.start([keys], run)
        if isinstance(started, Skipped):
            if started is not Skipped.NO_RUN:  # e.g. kvcr-guard does not list the peer (--peer)
                self._fault("hinted_fetch", RunnerUnavailable(started.value, "no fetch"))
            return hits
        fetched = started.wait().fetched
        if pulled:
            self.stats.pulls += 1
            self.stats.pulled_pages += fetched
        else:
            self.stats.hinted_fetches += 1
            self.stats.hinted_fetched_pages += fetched
        return self.client.lookup(keys)

    def present(self, page_keys: Sequence[str]) -> list[bool]:
        self._settle()
        try:
            return self.client.contains([block_key(k) for k in page_keys])
        except RunnerError as exc:
            self._fault("contains", exc)
            return [False] * len(page_keys)

    # -- copies --------------------------------------------------------------------------------

    def write(self, page_keys: Sequence[str], pages: Sequence[Segments]) -> list[bool]:
        """Stores every page not already present; True where the page is (or is being) kept."""
        n = len(page_keys)
        start = time.perf_counter()
        reserved = self.reserve(page_keys) if n else None
        if reserved is None:
            return [False] * n
        op, offsets, refused = reserved
        seal, granted = self.sealer.batch(), 0
        try:
            base = self._pool_address()
            region = self.client.pool().region.view
            for offset, segments in zip(offsets, pages, strict=True):
                if offset is not None:
                    self._copy(base + offset, segments, into_slot=True)
                    seal.add(region[offset:offset + self.block_bytes])
                    granted += 1
        except (RunnerError, ValueError) as exc:  # ValueError: a page of the wrong size
            self.abort(op)
            self._fault("store", exc)
            return [False] * n
        except BaseException:
            self.abort(op)
            raise
        seal.publish(functools.partial(self._publish, op))
        self.io.add(self.io.writes, granted, granted * self.block_bytes,
                    time.perf_counter() - start)
        return [True] * (n - refused) + [False] * refused

    @property
    def verify_loads(self) -> bool:
        """Check each page read against its committed checksum (`verify_loads`; "auto": when
        processes of other uids map this pool too)."""
        return verifies_loads(self.verify_setting, self.client.shared)

    def read(self, page_keys: Sequence[str], pages: Sequence[Segments]) -> list[bool]:
        """Copies the longest READY prefix into `pages`; True for each page filled."""
        n = len(page_keys)
        if not n:
            return []
        self._settle()
        start = time.perf_counter()
        verify = self.verify_loads
        try:
            lease = self.client.acquire([block_key(k) for k in page_keys], checksums=verify)
        except RunnerError as exc:
            self._fault("read", exc)
            return [False] * n
        filled = [False] * n
        try:
            base = self._pool_address()
            stride = self.client.pool().stride_bytes
            for i, (slot, segments) in enumerate(zip(lease.slots, pages, strict=True)):
                if slot is None:
                    break
                self._copy(base + slot * stride, segments, into_slot=False)
                if verify and segments_checksum(segments) != lease.checksums[i]:
                    self.stats.corrupt_pages += 1
                    break  # changed in the pool since its commit: a miss from here on
                filled[i] = True
        except (RunnerError, ValueError) as exc:
            self._fault("read", exc)
            filled = [False] * n
        finally:
            with contextlib.suppress(RunnerError):  # a dead connection's leases are
                self.client.release_nowait(lease.op)  # reclaimed by the daemon
        done = sum(filled)
        self.stats.read_pages += done
        self.io.add(self.io.reads, done, done * self.block_bytes, time.perf_counter() - start)
        return filled

    def lease(self, page_keys: Sequence[str]) -> tuple[int, list[int]] | None:
        """Leases the pages (all of them or none): (op, byte offsets of their slots in the
        pool region); None on a miss, a fault, or (with `verify_loads`) a page changed in the
        pool since its commit. The caller copies out at its own pace (layer by layer) and then
        `unlease`s."""
        self._settle()
        verify = self.verify_loads
        try:
            lease = self.client.acquire([block_key(k) for k in page_keys], checksums=verify)
            stride = self.client.pool().stride_bytes
            offsets = [int(slot) * stride for slot in lease.slots if slot is not None]
            if lease.granted < len(page_keys) or (verify and any(
                    self.checksum_at(o) != s for o, s in zip(offsets, lease.checksums,
                                                               strict=True))):
                self.stats.corrupt_pages += lease.granted == len(page_keys)
                self.client.release_nowait(lease.op)
                return None
        except RunnerError as exc:
            self._fault("read", exc)
            return None
        return lease.op, offsets

    def reserve(self, page_keys: Sequence[str]) -> tuple[int, list[int | None], int] | None:
        """Slots to fill for pages not yet kept: (op, byte offset per page or None when
        already kept, pages refused); `commit` after copying every granted page."""
        try:
            res = self.client.reserve([block_key(k) for k in page_keys])
            stride = self.client.pool().stride_bytes
        except RunnerError as exc:
            self._fault("store", exc)
            return None
        return res.op, [None if s is None else int(s) * stride for s in res.slots], res.refused

    def seal(self, op: int, offsets: Sequence[int]) -> bool:
        """Publishes reservation `op` once the sealer hashed its pages (at byte `offsets` of
        the mapped pool, every granted page in order, all copied); False (aborted) if the
        pool is gone."""
        try:
            region = self.client.pool().region.view
        except RunnerError as exc:
            self.abort(op)
            self._fault("store", exc)
            return False
        views = [region[o:o + self.block_bytes] for o in offsets]
        self.sealer.seal(views, functools.partial(self._publish, op))
        return True

    def _settle(self) -> None:
        """Reads see this store's own writes: pages still being hashed are committed first
        (a lock check when none is; at most the hashing of what is queued otherwise)."""
        self.sealer.flush(self._settle_s)

    def _publish(self, op: int, checksums: list[int]) -> None:
        """On a sealer thread: the commit (a commit that publishes less, its op reclaimed,
        shows in the client's `deferred_shortfalls`)."""
        try:
            self.client.commit_nowait(OpId(op), checksums=checksums)
        except RunnerError as exc:
            self._fault("store", exc)
            return
        self.stats.stored_pages += len(checksums)

    def checksum_at(self, offset: int) -> int:
        """The checksum of the block at byte `offset` of the mapped pool."""
        return block_checksum(self.client.pool().region.view[offset:offset + self.block_bytes])

    def abort(self, op: int) -> None:
        with contextlib.suppress(RunnerError):
            self.client.abort(OpId(op))

    def unlease(self, op: int, pages: int) -> None:
        self.stats.read_pages += pages
        with contextlib.suppress(RunnerError):
            self.client.release_nowait(OpId(op))

    def _copy(self, slot_address: int, segments: Segments, *, into_slot: bool) -> None:
        total = sum(size for _, size in segments)
        if total != self.block_bytes:
            raise ValueError(f"a page of {total} bytes; this namespace stores "
                             f"{self.block_bytes}-byte pages")
        copy_segments(slot_address, segments, into_slot=into_slot)

    def _pool_address(self) -> int:
        """The mapped pool's base address, refreshed after a re-attach."""
        pool = self.client.pool()  # attaches if needed; RunnerError if it cannot
        with self._base_lock:
            count = self.client.attach_count
            if self._base is None or self._base[0] != count:
                export = ctypes.c_char.from_buffer(pool.region.view)
                self._base = (count, ctypes.addressof(export), export)
            return self._base[1]

    def _fault(self, where: str, exc: Exception) -> None:
        self.stats.failures += 1
        if where not in self._warned:
            self._warned.add(where)
            log.warning("kvcr %s failed (%s); SGLang recomputes those pages", where, exc)

    def clear(self) -> int:
        """Drops this namespace's pages (SGLang's `clear`); 0 when kvcr is unavailable."""
        self._settle()
        try:
            return self.client.clear()
        except RunnerError as exc:
            self._fault("clear", exc)
            return 0

    def close(self) -> None:
        self.sealer.close()  # what was sealed is committed before the connection goes
        with self._base_lock:
            self._base = None
        self.client.close()
