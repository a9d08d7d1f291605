"""Page-aligned host memory: regions (anonymous or memfd) and the fixed-size slot pool.

Data plane only: no policy, no block states. `HostRegion` owns one mapping; `SlotPool` cuts a
region into equal slots whose starts are 4 KiB-aligned (misaligned copies measured 3x slower
here). A memfd region can be handed to another process (`fd`, `HostRegion.map_fd`), which is
how a Runner shares a namespace's pool with the engines that attach to it; memfd memory
disappears with its last holder, so nothing is ever left in /dev/shm.

A memfd region is sealed against shrinking and growing (and against changing its seals)
before anyone else can see it: a process holding the fd cannot `ftruncate` it, so no holder
of a mapping can ever be hit by SIGBUS because another one cut the file short. `map_fd`
refuses an fd that is not sealed so, or whose size is not the one announced.

Backing: `prefault` backs every page now; `back_ahead` backs pages as the pool fills, a fixed
number of bytes ahead of the highest byte in use (`note_used`), on a daemon thread, so the
holder's memory grows with its content and never holds what nobody stored yet (a virtual
machine that hands free memory back to its host makes every other process's first touches
slower while a large backed pool is held). A reservation that outruns the thread backs its
own pages before it is handed out: whoever writes into the pool never backs a page itself.

Page tables: an engine that maps a pool another process backed still pays a page fault the
first time it touches each page (measured here: a 64 MiB copy out of a freshly mapped pool
7.5 ms against 4 ms, into it 25 ms against 4 ms). `map_pages_in_background` maps them ahead
of use, in order, each range once its holder backed it (`mincore`): it never backs a page.

Threading: mapping and closing are not thread-safe (except against the background page
mapper and backer, which `close` stops first); `note_used` may be called from any thread
(backing a page twice is harmless); slot views may be used from any thread as long as the
index (which owns slot states) grants them.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import fcntl
import functools
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Final

from kvcr_core.errors import ClosedError
from kvcr_core.types import SlotId

PAGE_BYTES: Final = mmap.PAGESIZE
SLOT_ALIGN_BYTES: Final = 4096
_MADV_POPULATE_READ: Final = 22  # Linux 5.14+; not exported by the mmap module
_MADV_POPULATE_WRITE: Final = 23
_MAP_CHUNK_BYTES: Final = 32 << 20
_MAP_WAIT_S: Final = (0.02, 0.5)  # the mapper's wait for its holder to back the next range
_PREFAULT_CHUNK_BYTES: Final = 8 << 20
_BACK_CHUNK_BYTES: Final = 4 << 20  # the back-ahead thread's step (it checks for close between)
SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""What every shared pool memfd carries: its size is fixed, and so are its seals."""


class RegionKind(enum.Enum):
    ANONYMOUS = "anonymous"
    MEMFD = "memfd"


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


_MINCORE_GAP_BYTES = 1 << 20  # slots closer than this share one mincore call
_BIT0 = bytes(b & 1 for b in range(256))


def mincore(address: int, length: int) -> bytearray:
    """One byte per page of [address, address + length) (page-aligned start): 1 if the page
    is in memory, 0 if not."""
    pages = (length + PAGE_BYTES - 1) // PAGE_BYTES
    vec = bytearray(pages)
    buf = (ctypes.c_char * pages).from_buffer(vec)
    if _libc().mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    del buf
    return vec.translate(_BIT0)  # only bit 0 has a meaning


class HostRegion:
    """One page-aligned host mapping, anonymous or memfd-backed, read-write and shared."""

    def __init__(self, mapping: mmap.mmap, size_bytes: int, kind: RegionKind, fd: int | None):
        self._map: mmap.mmap | None = mapping
        self.size_bytes = size_bytes
        self.kind = kind
        self._fd = fd
        self._view: memoryview | None = memoryview(mapping)
        self._address: int | None = None
        self.backed = False
        """Every page backed by this process's `prefault` (the memory exists, charged here)."""
        self.ahead_bytes = 0
        """`back_ahead`'s margin (0: this process does not back pages as the region fills)."""
        self._backed_to = 0  # [0, _backed_to) backed by back_range/back_ahead (a lower bound)
        self._want = 0  # where the back-ahead thread is asked to reach
        self._backer: threading.Thread | None = None
        self._backing = threading.Condition()
        self._mapper: threading.Thread | None = None
        self._stop_mapping = threading.Event()

    @classmethod
    def create(cls, size_bytes: int, kind: RegionKind = RegionKind.MEMFD,
               name: str = "kvcr-pool") -> HostRegion:
        """Maps `size_bytes` (rounded up to whole pages) of zeroed memory."""
        if size_bytes <= 0:
            raise ValueError(f"region size must be positive, got {size_bytes}")
        size = round_up(size_bytes, PAGE_BYTES)
        if kind is RegionKind.ANONYMOUS:
            return cls(mmap.mmap(-1, size), size, kind, None)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        return cls(mapping, size, kind, fd)

    @classmethod
    def map_fd(cls, fd: int, size_bytes: int) -> HostRegion:
        """Maps a memfd received from another process and closes `fd` (the mapping keeps the
        memory alive on its own, so a client holds no descriptor that could leak). Raises
        ValueError for an fd that is not sealed against shrinking and growing, or whose size
        is not `size_bytes`: mapping it could end in SIGBUS."""
        try:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0  # not a memfd, or one created without sealing
            if seals & SEALS != SEALS:
                raise ValueError("the pool fd is not sealed against shrinking and growing; "
                                 "refusing to map it (is the server a kvcr of this version?)")
            actual = os.fstat(fd).st_size
            if actual != size_bytes:
                raise ValueError(f"the pool memfd holds {actual} bytes, the server announced "
                                 f"{size_bytes}; refusing to map it")
            mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(mapping, size_bytes, RegionKind.MEMFD, None)

    @property
    def view(self) -> memoryview:
        if self._view is None:
            raise ClosedError("host region is closed")
        return self._view

    @property
    def address(self) -> int:
        """Where the mapping starts in this process (to register it with a transport)."""
        if self._address is None:
            anchor = ctypes.c_char.from_buffer(self.view)
            self._address = ctypes.addressof(anchor)
            del anchor  # drop the buffer export at once, or the mapping could not close
        return self._address

    @property
    def hole_fd(self) -> int | None:
        """The memfd to look for holes in (None: anonymous, or mapped from another's fd)."""
        return self._fd

    @property
    def fd(self) -> int:
        """The memfd to pass to another process (SCM_RIGHTS). Anonymous regions have none."""
        if self._fd is None:
            raise ValueError("this region has no fd to share: create it with RegionKind.MEMFD "
                             "(a region mapped from a received fd cannot be passed on)")
        return self._fd

    def prefault(self) -> None:
        """Backs every page now, so first copies do not pay page faults on the hot path."""
        mapping = self._map
        if mapping is None:
            raise ClosedError("host region is closed")
        try:
            mapping.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            zeros = bytes(_PREFAULT_CHUNK_BYTES)
            view = self.view
            for start in range(0, self.size_bytes, _PREFAULT_CHUNK_BYTES):
                end = min(start + _PREFAULT_CHUNK_BYTES, self.size_bytes)
                view[start:end] = zeros[: end - start]
        self.backed = True

    @property
    def backs_pages(self) -> bool:
        """This process backs the region's pages: all of them (`prefault`) or as it fills."""
        return self.backed or self.ahead_bytes > 0

    @property
    def backed_bytes(self) -> int:
        """How far from the start every page is known backed here (all: the whole size)."""
        return self.size_bytes if self.backed else min(self._backed_to, self.size_bytes)

    def back_range(self, start: int, end: int) -> None:
        """Backs the pages of [start, end) now, keeping what they hold (a writer may be
        filling them). Pages already backed cost a page-table walk only. The GIL is released
        meanwhile (ctypes), so a daemon's loop goes on while a thread backs pages."""
        address = self.address
        start = start // PAGE_BYTES * PAGE_BYTES
        end = min(round_up(end, PAGE_BYTES), self.size_bytes)
        if end <= start:
            return
        if _libc().madvise(ctypes.c_void_p(address + start), ctypes.c_size_t(end - start),
                           _MADV_POPULATE_WRITE) != 0 and self._fd is not None:
            os.posix_fallocate(self._fd, start, end - start)  # before 5.14: contents kept

    def back_ahead(self, ahead_bytes: int, *, wait: bool = False) -> None:
        """From now on keeps every page up to `ahead_bytes` past the highest byte in use
        (`note_used`) backed, on a daemon thread; starts with the first `ahead_bytes` (in the
        caller first with `wait`). Stops at `close`."""
        if ahead_bytes <= 0:
            raise ValueError(f"back-ahead margin must be positive, got {ahead_bytes}")
        if wait:
            self.back_range(0, ahead_bytes)
            self._backed_to = max(self._backed_to, min(ahead_bytes, self.size_bytes))
        with self._backing:
            self.ahead_bytes = ahead_bytes
            self._want = max(self._want, min(ahead_bytes, self.size_bytes))
            if self._backer is None:
                self._backer = threading.Thread(target=self._back_pages, name="kvcr-back-pages",
                                                daemon=True)
                self._backer.start()
            self._backing.notify()

    def note_used(self, end_bytes: int) -> None:
        """Bytes [0, end_bytes) may be written now: backs any of them the thread has not
        reached yet before returning, and moves the thread's target `ahead_bytes` further."""
        if self.ahead_bytes <= 0 or self.backed:
            return
        if end_bytes > self._backed_to:
            self.back_range(self._backed_to, end_bytes)
            self._backed_to = max(self._backed_to, min(end_bytes, self.size_bytes))
        want = min(end_bytes + self.ahead_bytes, self.size_bytes)
        if want > self._want:
            with self._backing:
                self._want = max(self._want, want)
                self._backing.notify()

    def _back_pages(self) -> None:
        # Idle priority: backing pages ahead of use is work for spare CPU time. Measured under
        # load (two vLLM engines at concurrency 8 on 2 cores, a VM), backing 32 MiB at a time
        # at normal priority raised their p90 TTFT by about 30%, 4 MiB at idle priority by
        # about 17%. A reservation that outruns it still backs its own pages at once.
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        while True:
            with self._backing:
                while self._backed_to >= self._want and not self._stop_mapping.is_set():
                    self._backing.wait()
                if self._stop_mapping.is_set():
                    return
                start, want = self._backed_to, self._want
            end = min(start + _BACK_CHUNK_BYTES, want)
            try:
                self.back_range(start, end)
            except (ClosedError, ValueError):
                return  # closed meanwhile
            self._backed_to = max(self._backed_to, end)

    def map_pages_in_background(self) -> threading.Thread:
        """Maps the pages of a region another process backs into this process's page
        tables, on a daemon thread (the GIL is released in the kernel call), so this process's
        first copies into and out of each slot pay no faults. Goes in order, each range once
        it is backed (a holder backing pages as the pool fills gets there later); it never
        backs a page itself. Stops at `close`."""
        if self._mapper is None:
            self._mapper = threading.Thread(target=self._map_pages, name="kvcr-map-pages",
                                            daemon=True)
            self._mapper.start()
        return self._mapper

    def _map_pages(self) -> None:
        address, libc = self.address, _libc()
        start, wait = 0, _MAP_WAIT_S[0]
        while start < self.size_bytes:
            length = _resident_prefix(libc, address + start,
                                      min(_MAP_CHUNK_BYTES, self.size_bytes - start))
            if length == 0:
                if self._stop_mapping.wait(wait):
                    return
                wait = min(wait * 2, _MAP_WAIT_S[1])
                continue
            if self._stop_mapping.is_set():
                return
            wait = _MAP_WAIT_S[0]
            if libc.madvise(ctypes.c_void_p(address + start), ctypes.c_size_t(length),
                            _MADV_POPULATE_READ) != 0:  # kernel before 5.14: touch them
                view = self._view
                if view is None:
                    return
                bytes(view[start:start + length:PAGE_BYTES])
            start += length

    def close(self) -> None:
        """Unmaps and closes the fd. Callers must have dropped every slot view first."""
        self._stop_mapping.set()
        with self._backing:
            self._backing.notify_all()
        for thread in (self._mapper, self._backer):
            if thread is not None:
                thread.join()
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> HostRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.mincore.restype = ctypes.c_int
    return libc


def _resident_prefix(libc: ctypes.CDLL, address: int, length: int) -> int:
    """How many bytes from `address` on (up to `length`) exist in memory, page after page
    (for a shared mapping: its holder backed them), found without faulting any in."""
    pages = -(-length // PAGE_BYTES)
    vector = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vector) != 0:
        return 0
    first_missing = bytes(vector).find(0)
    return length if first_missing < 0 else first_missing * PAGE_BYTES


def copy_into(dst: memoryview, data: bytes | bytearray | memoryview) -> None:
    """`dst[:] = data`, with the GIL released where `ctypes.memmove` can read `data` (bytes,
    writable contiguous buffers), so other threads (a sealer's hashes) run beside the copy.
    Costs about 4 us more per 256 KiB block than the slice assignment (8% here), which
    holds the GIL: use it only where other threads need it."""
    if len(data) != len(dst):
        raise ValueError(f"block is {len(data)} bytes, slots hold {len(dst)}")
    source: bytes | int | None = data if isinstance(data, bytes) else None
    if source is None:
        with contextlib.suppress(TypeError, ValueError, BufferError):
            source = ctypes.addressof(ctypes.c_char.from_buffer(data))
    if source is None:
        dst[:] = data
    else:
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(dst)), source, len(dst))


class SlotPool:
    """Fixed-size slots over one region; slot `i` starts at `i * stride_bytes` (4 KiB-aligned).

    The pool only maps slot ids to bytes. Which slot is free, filling or ready is the block
    index's business.
    """

    def __init__(self, region: HostRegion, slot_bytes: int) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot size must be positive, got {slot_bytes}")
        self.region = region
        self.slot_bytes = slot_bytes
        self.stride_bytes = round_up(slot_bytes, SLOT_ALIGN_BYTES)
        self.capacity_slots = region.size_bytes // self.stride_bytes
        if self.capacity_slots < 1:
            raise ValueError(
                f"region of {region.size_bytes} bytes holds no slot of {self.stride_bytes} bytes")

    @classmethod
    def create(cls, capacity_slots: int, slot_bytes: int,
               kind: RegionKind = RegionKind.MEMFD, name: str = "kvcr-pool") -> SlotPool:
        stride = round_up(slot_bytes, SLOT_ALIGN_BYTES)
        return cls(HostRegion.create(capacity_slots * stride, kind, name), slot_bytes)

    @staticmethod
    def region_bytes_for(capacity_slots: int, slot_bytes: int) -> int:
        return capacity_slots * round_up(slot_bytes, SLOT_ALIGN_BYTES)

    def offset(self, slot: SlotId) -> int:
        if not 0 <= slot < self.capacity_slots:
            raise IndexError(f"slot {slot} outside 0..{self.capacity_slots - 1}")
        return slot * self.stride_bytes

    def view(self, slot: SlotId) -> memoryview:
        """Writable view of the slot's `slot_bytes` bytes (a zero-copy slice of the mapping)."""
        start = self.offset(slot)
        return self.region.view[start:start + self.slot_bytes]

    def write(self, slot: SlotId, data: bytes | bytearray | memoryview) -> None:
        start = self.offset(slot)
        if len(data) != self.slot_bytes:
            raise ValueError(f"block is {len(data)} bytes, slots hold {self.slot_bytes}")
        self.region.view[start:start + self.slot_bytes] = data

    def holed(self, slots: Sequence[SlotId]) -> list[SlotId]:
        """The slots among `slots` with a page missing from memory: punched out of the memfd
        (`fallocate(PUNCH_HOLE)` by a process that maps it: it reads as zeros) or swapped
        out. A block written here and in memory has every page. One `mincore` per cluster of
        nearby slots (about 8 us per 16 MiB); regions this process did not create as a
        memfd are not checked (their pages are this process's own)."""
        if self.region.hole_fd is None or not slots:
            return []
        holed: list[SlotId] = []
        ordered = sorted(set(slots))
        first = 0
        for i in range(1, len(ordered) + 1):
            if i < len(ordered) and (ordered[i] - ordered[i - 1]) * self.stride_bytes \
                    <= _MINCORE_GAP_BYTES:
                continue
            holed += self._holed_cluster(ordered[first:i])
            first = i
        return holed

    def _holed_cluster(self, slots: list[SlotId]) -> list[SlotId]:
        start = slots[0] * self.stride_bytes
        end = slots[-1] * self.stride_bytes + self.slot_bytes
        pages = mincore(self.region.address + start, end - start)
        out = []
        for slot in slots:
            a = (slot * self.stride_bytes - start) // PAGE_BYTES
            b = (slot * self.stride_bytes + self.slot_bytes - start + PAGE_BYTES - 1) \
                // PAGE_BYTES
            if pages.find(0, a, b) >= 0:
                out.append(slot)
        return out

    def read_into(self, slot: SlotId, out: bytearray | memoryview) -> None:
        start = self.offset(slot)
        memoryview(out)[: self.slot_bytes] = self.region.view[start:start + self.slot_bytes]

    def close(self) -> None:
        self.region.close()
