"""`Sealer`: the checksums of freshly written blocks, taken off the writer's path.

A writer copies its blocks into reserved slots and hands them over: `seal(views, publish)`.
Worker threads hash the views (xxh3-64, `kvcr_core.checksums.block_checksum_nogil`: the GIL is
released while a block is hashed, so hashes run beside the writer's next copies on other cores)
and then call `publish(checksums)`, which is the writer's commit. The writer never waits for a
hash. The order the design asks for holds by construction: a commit carries its checksums, so a
block is READY only once hashed, and never served to a peer or checked by `verify_loads` before.
The checksum is still the writer's, fixed at commit (a writer of the namespace could commit
wrong bytes outright, so hashing after the copy returns loses nothing).

Bounded: at most `max_pending_bytes` wait to be hashed. A seal that does not fit, or any seal
with `threads=0`, is hashed in the caller's thread (the in-line cost of before, counted as
`inline_blocks`): never dropped, never waited for. A writer that copies block by block (`batch`)
may do better hashing each block right after its copy, in the cache, than handing it to a
thread: on hosts under 4 cores it does (`hot_in_line`). A large seal is split into parts hashed
by several threads; the thread that finishes the last part publishes. A `publish` that raises is
counted and logged (throttled); the writer's reservation then dies with its connection or is
reclaimed, so nothing half-sealed is published.

Threading: `seal` from any thread; `flush` waits, within a deadline, for everything sealed
before it; `close` flushes and stops the threads (later seals run in line).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import xxhash

from kvcr_core.checksums import block_checksum, block_checksum_nogil
from kvcr_core.config import HASH_THREADS_AUTO, MAX_HASH_THREADS
from kvcr_core.logs import ThrottledLog
from kvcr_core.memory import copy_into

log = logging.getLogger("kvcr_core")
_warn = ThrottledLog(log)
MIB = 1 << 20
DEFAULT_MAX_PENDING_BYTES = 256 * MIB
PART_BYTES = 8 * MIB  # a seal larger than this is hashed by several threads
CHUNK_BYTES = 256 * 1024  # in line: copied and hashed piece by piece, in the cache
Publish = Callable[[list[int]], object]


def hash_thread_count(setting: int | str, cpus: int | None = None) -> int:
    """The threads of the `hash_threads` setting. "auto": a quarter of the host's cores, 1 to
    4 (one hashes about 7 GB/s out of memory, four about 28 GB/s on a GPU host; the engine
    keeps the rest). Measured on 2 vCPUs: a vLLM worker's saves, hashed after the step's
    copies (out of the cache), ran at 0.92-0.94 of the same saves unhashed with one thread,
    0.63 hashed in line."""
    if setting != HASH_THREADS_AUTO:
        return int(setting)
    cores = cpus if cpus is not None else (os.cpu_count() or 1)
    return max(1, min(4, cores // 4))


def hot_in_line_default(cpus: int | None = None) -> bool:
    """Whether a writer that copies block by block hashes each block in line, right after
    its copy, while it is in the cache: on hosts under 4 cores, where a hashing thread
    competes with the copy for the same cores (measured on 2 vCPUs, `kvcr bench pool`:
    0.78 of a copy in line against 0.59-0.74 through a thread)."""
    return (cpus if cpus is not None else (os.cpu_count() or 1)) < 4


@dataclasses.dataclass
class _Seal:
    views: Sequence[memoryview]
    publish: Publish
    nbytes: int
    sums: list[int]
    parts_left: int


@dataclasses.dataclass(frozen=True)
class _Part:
    seal: _Seal
    start: int
    stop: int


class Sealer:
    def __init__(self, threads: int, *, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 hot_in_line: bool | None = None, name: str = "kvcr-sealer") -> None:
        """`hot_in_line`: batches built block by block (`batch`) hash in line (default:
        `hot_in_line_default()`, and always with no threads)."""
        if not 0 <= threads <= MAX_HASH_THREADS:
            raise ValueError(f"threads must be 0..{MAX_HASH_THREADS}, not {threads}")
        self.threads = threads
        self.hot_in_line = threads == 0 or (
            hot_in_line_default() if hot_in_line is None else hot_in_line)
        self.max_pending_bytes = max_pending_bytes
        self._name = name
        self._parts: collections.deque[_Part] = collections.deque()
        self._cond = threading.Condition()
        self._pending_bytes = 0
        self._unfinished = 0  # seals queued and not yet published
        self._workers: list[threading.Thread] = []
        self._closed = False
        self.sealed_blocks = 0  # hashed by the threads
        self.inline_blocks = 0  # hashed in the caller's thread (no threads, or over the bound)
        self.publish_failures = 0
        self.hash_seconds = 0.0

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def seal(self, views: Sequence[memoryview], publish: Publish) -> None:
        """Hashes `views` (one block each, in the reservation's order) and calls
        `publish(checksums)`: on a thread, or now in this one when none has room."""
        nbytes = sum(v.nbytes for v in views)
        with self._cond:
            queued = (self.threads > 0 and not self._closed
                      and self._pending_bytes + nbytes <= self.max_pending_bytes)
            if queued:
                self._queue(views, publish, nbytes)
        if not queued:
            self._publish(publish, [self.hash_in_line(v) for v in views])

    def batch(self) -> SealBatch:
        """A seal built block by block, as the writer copies them (see `SealBatch`)."""
        return SealBatch(self)

    def hash_in_line(self, view: memoryview) -> int:
        """One block's checksum, now, in this thread (the one-shot hash: the fastest)."""
        began = time.perf_counter()
        value = block_checksum(view)
        self.count_in_line(time.perf_counter() - began)
        return value

    def count_in_line(self, seconds: float) -> None:
        with self._cond:
            self.inline_blocks += 1
            self.hash_seconds += seconds

    def flush(self, timeout_s: float) -> bool:
        """Waits until every seal made so far is published; False at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._unfinished:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Flushes (within `timeout_s`) and stops the threads; False if seals were left."""
        flushed = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join(timeout=max(0.0, timeout_s))
        return flushed

    # -- threads -------------------------------------------------------------------------------

    def _queue(self, views: Sequence[memoryview], publish: Publish, nbytes: int) -> None:
        """Under the condition: the seal's parts go on the queue."""
        n = len(views)
        parts = max(1, min(self.threads, nbytes // PART_BYTES, n))
        seal = _Seal(views, publish, nbytes, [0] * n, parts)
        bounds = [n * i // parts for i in range(parts + 1)]
        self._parts.extend(_Part(seal, bounds[i], bounds[i + 1]) for i in range(parts))
        self._pending_bytes += nbytes
        self._unfinished += 1
        if not self._workers:  # started with the first seal: none for a reader-only engine
            self._workers = [threading.Thread(target=self._work, daemon=True,
                                              name=f"{self._name}-{i}")
                             for i in range(self.threads)]
            for worker in self._workers:
                worker.start()
        self._cond.notify(parts)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._parts and not self._closed:
                    self._cond.wait()
                if not self._parts:
                    return
                part = self._parts.popleft()
            seal = part.seal
            began = time.perf_counter()
            seal.sums[part.start:part.stop] = [block_checksum_nogil(seal.views[i])
                                               for i in range(part.start, part.stop)]
            with self._cond:
                self.hash_seconds += time.perf_counter() - began
                seal.parts_left -= 1
                last = seal.parts_left == 0
                self.sealed_blocks += len(seal.views) if last else 0
            del part  # an idle thread holds no view: the mapping can close
            if not last:
                del seal
                continue
            self._publish(seal.publish, seal.sums)
            seal.views = ()  # flushed means no view of the pool is held here any more
            with self._cond:
                self._pending_bytes -= seal.nbytes
                self._unfinished -= 1
                if not self._unfinished:
                    self._cond.notify_all()
            del seal

    def _publish(self, publish: Publish, sums: list[int]) -> None:
        try:
            publish(sums)
        except Exception as exc:  # the writer's commit: its reservation is reclaimed
            with self._cond:
                self.publish_failures += 1
            _warn.log(logging.WARNING, "seal-publish", "kvcr: committing %d hashed blocks "
                      "failed (%s); they are not published and recompute", len(sums), exc)


class SealBatch:
    """One reservation's blocks, added right after each one's copy. Where the sealer hashes
    such batches in line (`hot_in_line`: no threads, or a host under 4 cores) each block is
    hashed as it is added, while its bytes are still in the cache; otherwise `publish` hands
    them all to the threads."""

    def __init__(self, sealer: Sealer) -> None:
        self._sealer = sealer
        self._views: list[memoryview] = []
        self._sums: list[int] | None = [] if sealer.hot_in_line else None

    def add(self, view: memoryview) -> None:
        """A block already copied into `view` (its slot)."""
        if self._sums is not None:
            self._sums.append(self._sealer.hash_in_line(view))
        else:
            self._views.append(view)

    def write(self, view: memoryview, data: bytes | bytearray | memoryview) -> None:
        """Copies one block into `view` (its slot) and adds it. In line: in cache-sized
        pieces, each hashed right after its copy (a 2 MiB block hashed after its whole copy
        is out of the cache: measured 0.78 of a plain copy, against 0.89 by pieces); with
        threads: one copy with the GIL released (`copy_into`)."""
        if len(data) != len(view):
            raise ValueError(f"block is {len(data)} bytes, slots hold {len(view)}")
        if self._sums is None:  # the threads hash while this thread copies the next block
            copy_into(view, data)
            self._views.append(view)
            return
        if len(view) <= CHUNK_BYTES:
            view[:] = data
            self._sums.append(self._sealer.hash_in_line(view))
            return
        source, state, hashing = memoryview(data).cast("B"), xxhash.xxh3_64(), 0.0
        clock = time.perf_counter
        for start in range(0, len(view), CHUNK_BYTES):
            piece = view[start:start + CHUNK_BYTES]
            piece[:] = source[start:start + CHUNK_BYTES]
            began = clock()
            state.update(piece)
            hashing += clock() - began
        self._sums.append(state.intdigest())
        self._sealer.count_in_line(hashing)

    def publish(self, publish: Publish) -> None:
        """Commits the blocks added (now, if they were hashed in line)."""
        if self._sums is not None:
            self._sealer._publish(publish, self._sums)
        else:
            self._sealer.seal(self._views, publish)
