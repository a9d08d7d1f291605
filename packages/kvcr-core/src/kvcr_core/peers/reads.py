"""`ReadTransport`: the destination READs a fetch's blocks from the source's leased slots, by
address, through a read engine; `NixlTransport` is it over NIXL (kvcr_core.peers.nixl_engine,
the module that imports nixl). kvcr_core.testing's `LoopbackTransport` is it over memmove.

Source: registers a namespace's pool with the engine once (`expose`; its metadata goes in
Ready), answers a Fetch with NixlBlocks (the found blocks' addresses and the checksums it
already knows; with late_checksums the others follow, 1 MiB of blocks at a time, while the
destination reads) and keeps the blocks leased until the destination's FetchDone. NIXL's
progress thread is off, so while a peer may be connecting or reading, the connection's
thread drives progress between polls of the socket: every 0.1 ms while the peer reads (UCX
over TCP moves bytes only then), else backing off to 50 ms, which is also the pace once the
peer's FetchDone says its READs copy in its own calls (UCX cma on one host).

Destination: READs the found blocks in the chunks of `read_plan` on the engine's read lanes
(kvcr_core.peers.lanes: each lane READs a chunk, then hashes it while it is in its core's
cache, then takes the next; the fetching thread waits), from prepared lists (a few us of work
per READ). Once no chunk is being read any more, FetchDone releases the source's leases, the
checksums still owed arrive, and each block is kept only if its digest matches. A deadline,
cancel or dead source keeps what was read and checked; a source that breaks the protocol
gets nothing published.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Final, Protocol

import msgspec

from kvcr_core.checksums import block_checksum
from kvcr_core.framing import FrameError, readable, recv_frame, send_all
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.connection import DestConnection, FetchJob, SourceConnection
from kvcr_core.peers.lanes import LaneJob, ReadLanes
from kvcr_core.peers.nixl_engine import NixlEngine
from kvcr_core.peers.tcp import SEND_GROUP_BYTES
from kvcr_core.peers.transport import PeerTransport, ReadRefused, TransportError
from kvcr_core.runner import NamespaceStore
from kvcr_core.types import FetchStatus, SlotId

log = logging.getLogger("kvcr_core.peers")
_READING_PROGRESS_S: Final = 0.0001  # a peer is reading: UCX over a network needs us often
_IDLE_PROGRESS_MAX_S: Final = 0.05  # between fetches: connection set-up and keep-alives only
_TCP_ANSWER_BACKOFF_S: Final = 30.0  # a peer that answered an offer with TCP: ask again later
_FAILURE_BACKOFF_S: Final = 300.0  # a peer whose transport end did not load here
_MAX_KNOWN_PEERS: Final = 256
_ALONE = ReadLanes(0)  # a fetch READ by its own thread (parallel_reads off)
# a block a fetch reads: key index, local slot, source address, place among the found blocks
# (that of its checksum)
_Block = tuple[int, SlotId, int, int]


class Read(Protocol):
    state: str  # "DONE" once the bytes landed (as soon as `start` returns, for a local copy)

    def start(self, deadline: float) -> None: ...

    def wait(self, deadline: float) -> None: ...

    def release(self) -> None: ...


class PreparedReads(Protocol):
    def make(self, local: Sequence[int], first: int) -> Read: ...

    def release(self) -> None: ...


class ReadEngine(Protocol):
    """What a `ReadTransport` needs of its engine (`NixlEngine` is the model)."""

    read_lanes: ReadLanes

    def start(self, *, wait: bool = False) -> bool: ...

    def ready(self) -> bool: ...

    def register(self, address: int, nbytes: int) -> bytes: ...

    def deregister(self, address: int, nbytes: int) -> None: ...

    def add_peer(self, metadata: bytes) -> str: ...

    def drop_peer(self, name: str) -> None: ...

    def progress(self) -> None: ...

    def slot_list(self, address: int, stride: int, nbytes: int, count: int) -> Any: ...

    def prepare_reads(self, peer: str, slots: Any, remote: Sequence[int],
                      nbytes: int) -> PreparedReads: ...


class ReadTransport(PeerTransport):
    """`largest_read_bytes` / `last_read_bytes`: see `read_plan`. `parallel_reads`: READ on
    the engine's lanes (else every READ of a fetch runs on the fetching thread)."""

    drives_progress = True  # the source polls the engine while waiting for its peer

    def __init__(self, engine: ReadEngine, *, features: Sequence[str] = (pp.LATE_CHECKSUMS,),
                 largest_read_bytes: int = 1 << 20, last_read_bytes: int = 512 << 10,
                 parallel_reads: bool = True) -> None:
        self.engine = engine
        self.features = tuple(features)
        self.largest_read_bytes = largest_read_bytes
        self.last_read_bytes = last_read_bytes
        self.parallel_reads = parallel_reads
        self._lock = threading.Lock()
        self._targets: set[tuple[int, int]] = set()  # pools registered as destinations
        self._failed: set[tuple[int, int]] = set()  # pools that cannot be destinations
        self._offer_after: dict[str, float] = {}  # endpoint -> when to offer it again
        engine.start()

    # -- source half -------------------------------------------------------------------------

    def expose(self, store: NamespaceStore) -> bytes | None:
        if not self.engine.ready():
            return None
        region = store.pool.region
        try:
            return self.engine.register(region.address, region.size_bytes)
        except TransportError as exc:
            log.warning("peers of %s use TCP: %s", store.digest.hex(), exc)
            return None

    def unexpose(self, store: NamespaceStore) -> None:
        region = store.pool.region
        self.engine.deregister(region.address, region.size_bytes)

    def send(self, conn: SourceConnection, fetch: pp.Fetch) -> None:
        """Tells where the blocks lie; the destination READs them, then says FetchDone (see
        the module docstring for late checksums and progress)."""
        store = conn.store
        base = store.pool.region.address
        lease = store.acquire(fetch.keys, conn.owner, prefix_only=False)  # type: ignore[arg-type]
        try:
            stride, sums = store.pool.stride_bytes, conn.checksums
            slots = [s for s in lease.slots if s is not None]  # leased: inside the pool
            late = pp.LATE_CHECKSUMS in conn.features
            origins = conn.origins_frame(fetch.seq, fetch.keys, lease.slots)
            known = sums.known(slots) if late else [sums.of(s) for s in slots]
            send_all(conn.sock, [*origins, pp.encode(pp.NixlBlocks(
                fetch.seq, [s is not None for s in lease.slots],
                [base + s * stride for s in slots], known))])
            per_group = max(1, SEND_GROUP_BYTES // store.block_bytes)
            for start in range(len(known), len(slots), per_group):
                group = [sums.of(s) for s in slots[start:start + per_group]]
                conn.sock.sendall(pp.encode(pp.NixlChecksums(fetch.seq, start, group)))
                if not conn.inline:
                    self.engine.progress()  # UCX over TCP serves the reads only when we do
            done = pp.decode_to_server(self.next_frame(conn, reading=not conn.inline))
            if not isinstance(done, pp.FetchDone) or done.seq != fetch.seq:
                raise FrameError(f"expected FetchDone({fetch.seq})")
            conn.metrics.on_served(len(slots), len(slots) * store.block_bytes)
            conn.inline = done.inline
        finally:
            store.release(lease.op)

    def next_frame(self, conn: SourceConnection, *, reading: bool = False) -> bytearray:
        """Drives the engine's progress while waiting: every 0.1 ms while the peer is
        `reading`, backing off to 50 ms when idle."""
        if not self.drives_progress:
            return recv_frame(conn.sock)[0]
        end = time.monotonic() + conn.io_timeout_s
        pause = _READING_PROGRESS_S if reading else 0.001
        while not readable(conn.sock, pause):
            self.engine.progress()
            if time.monotonic() >= end:
                raise TimeoutError("peer silent past the I/O deadline")
            if not reading:
                pause = min(pause * 2, _IDLE_PROGRESS_MAX_S)
        return recv_frame(conn.sock)[0]

    # -- destination half --------------------------------------------------------------------

    def usable(self, endpoint: str, store: NamespaceStore) -> bool:
        """Running here, `store`'s pool registered as a destination, and the peer neither
        answered an offer with TCP nor failed to load lately."""
        if not self.engine.ready() or time.monotonic() < self._offer_after.get(endpoint, 0.0):
            return False
        region = store.pool.region
        key = (region.address, region.size_bytes)
        with self._lock:
            if key in self._failed:
                return False
            if key not in self._targets:
                try:
                    self.engine.register(*key)
                except TransportError:
                    self._failed.add(key)  # this pool cannot be a destination: TCP it is
                    return False
                self._targets.add(key)
        return True

    def release(self, store: NamespaceStore) -> None:
        region = store.pool.region
        key = (region.address, region.size_bytes)
        with self._lock:
            if key not in self._targets:
                return
            self._targets.discard(key)
        self.engine.deregister(*key)

    def open(self, conn: DestConnection, ready: pp.Ready) -> None:
        try:
            conn.remote = self.engine.add_peer(ready.nixl_agent)
        except TransportError:
            self.offer_later(conn.endpoint, _FAILURE_BACKOFF_S)
            raise

    def declined(self, endpoint: str) -> None:
        self.offer_later(endpoint, _TCP_ANSWER_BACKOFF_S)

    def offer_later(self, endpoint: str, backoff_s: float) -> None:
        """Offers this transport to `endpoint` again only after `backoff_s`."""
        with self._lock:
            if len(self._offer_after) >= _MAX_KNOWN_PEERS:
                self._offer_after.clear()
            self._offer_after[endpoint] = time.monotonic() + backoff_s

    def drop(self, conn: DestConnection) -> None:
        if conn.remote:
            self.engine.drop_peer(conn.remote)

    def receive(self, conn: DestConnection, reply: pp.ToClient, job: FetchJob) -> bool:
        if not isinstance(reply, pp.NixlBlocks):
            raise FrameError(f"a {type(reply).__name__} reply on a {self.kind.value} "
                             "connection")
        found = sum(reply.found)
        late = pp.LATE_CHECKSUMS in conn.features
        if (reply.seq != conn.seq or len(reply.found) != len(job.wanted)
                or len(reply.addresses) != found or len(reply.checksums) > found
                or (len(reply.checksums) < found and not late)):
            raise FrameError("a NixlBlocks reply that does not match the Fetch")
        todo = _blocks_to_read(reply, job)
        pool = conn.store.pool
        chunks: list[Sequence[_Block]] = []
        firsts: list[int] = []  # each chunk's first place in todo (and in the remote list)
        first = 0
        for count in read_plan(len(todo), pool.slot_bytes, self.largest_read_bytes,
                               self.last_read_bytes):
            firsts.append(first)
            chunks.append(todo[first:first + count])
            first += count
        slots = [[t[1] for t in chunk] for chunk in chunks]
        ours = self.engine.slot_list(pool.region.address, pool.stride_bytes, pool.slot_bytes,
                                     pool.capacity_slots)
        reads = self.engine.prepare_reads(conn.remote, ours, [t[2] for t in todo],
                                          pool.slot_bytes)
        lanes = _ChunkReads(reads, slots, firsts, conn, job)
        sums = list(reply.checksums)
        try:
            try:
                (self.engine.read_lanes if self.parallel_reads else _ALONE).run(
                    lanes.job, job.deadline, job.cancelled)
            finally:
                reads.release()
                job.received += pool.slot_bytes * sum(
                    len(c) for c, got in zip(chunks, lanes.job.digests, strict=True) if got)
            conn.time_left(job.deadline)
            # the source's leases can go; and, if every READ copied as it was posted (cma),
            # the source need not drive progress for us
            inline = not lanes.waited and any(got is not None for got in lanes.job.digests)
            conn.sock.sendall(pp.encode(pp.FetchDone(reply.seq, inline)))
            while len(sums) < found:  # all it owes, even if we stopped early: the stream
                _more_checksums(conn, reply.seq, sums, found, job.deadline)
        except (FrameError, msgspec.MsgspecError, ReadRefused):
            raise  # a source that breaks the protocol gets nothing published
        except BaseException:  # deadline, cancel, a source gone: what was checked is kept
            _take_verdicts(job, chunks, lanes.job.digests, sums)
            raise
        _take_verdicts(job, chunks, lanes.job.digests, sums)
        return True


class _ChunkReads:
    """The work of a fetch's read lanes: READ chunk n into its slots, then hash it."""

    def __init__(self, reads: PreparedReads, slots: list[list[SlotId]], firsts: list[int],
                 conn: DestConnection, job: FetchJob) -> None:
        self.reads, self.slots, self.firsts, self.fetch = reads, slots, firsts, job
        self.view = conn.store.pool.view
        self.waited: list[int] = []  # chunks whose READ was not done when posted
        self.job = LaneJob(len(slots), self.read_and_hash)

    def read_and_hash(self, n: int) -> list[int] | None:
        if self.fetch.cancelled():
            self.job.stop()
            return None
        request = self.reads.make(self.slots[n], self.firsts[n])
        deadline = self.fetch.deadline
        try:
            request.start(deadline)
            if request.state != "DONE":  # not copied within the post (not cma)
                self.waited.append(n)
                request.wait(deadline)
        finally:
            request.release()
        view, checksum = self.view, block_checksum
        return [checksum(view(slot)) for slot in self.slots[n]]


def _blocks_to_read(reply: pp.NixlBlocks, job: FetchJob) -> list[_Block]:
    """The found blocks that have a slot here; a found key without one (stored here
    meanwhile, or no room) is not read; a key not found is MISSING."""
    todo: list[_Block] = []
    nth = 0
    for i, present in zip(job.wanted, reply.found, strict=True):
        slot = job.slots[i]
        if not present:
            if slot is not None:
                job.statuses[i] = FetchStatus.MISSING
            continue
        if slot is not None:
            todo.append((i, slot, reply.addresses[nth], nth))
        nth += 1
    return todo


def _more_checksums(conn: DestConnection, seq: int, sums: list[int], found: int,
                    deadline: float) -> None:
    """Appends the next NixlChecksums message's checksums to `sums`. Raises FrameError for
    one out of order or too many."""
    conn.time_left(deadline)
    more = pp.decode_to_client(recv_frame(conn.sock)[0])
    if (not isinstance(more, pp.NixlChecksums) or more.seq != seq
            or more.start != len(sums) or len(sums) + len(more.checksums) > found
            or not more.checksums):
        raise FrameError("expected the next NixlChecksums of this fetch")
    sums.extend(more.checksums)


def read_plan(blocks: int, block_bytes: int, largest_bytes: int, last_bytes: int) -> list[int]:
    """How many blocks each READ of one fetch moves, in order: the last about `last_bytes`,
    each one before it twice the next, up to `largest_bytes`; a small remainder joins the
    READ after it (never the last). Why: the read lanes take READs in turn and each hashes
    its READ right after copying it, so READs of about 1 MiB keep the hash in the lane's cache
    and let the lanes share the work evenly, short last READs let both finish at about the
    same time, and prepared READs cost a few us each. Measured at 256 KiB blocks, 16 MiB
    fetches, two lanes (docs/peers.md): 1 MiB READs ending in 512 KiB (2, 4 x 15, 2 blocks)
    0.905 and 0.917 of raw NIXL against 0.888 and 0.891 for 2 MiB ending in 1 MiB; 4 MiB
    READs 0.84, 512 KiB ones 0.89."""
    largest = max(1, largest_bytes // block_bytes)
    size = max(1, min(largest, last_bytes // block_bytes))
    plan: list[int] = []  # from the end
    left = blocks
    while left > 0:
        take = min(size, left)
        plan.append(take)
        left -= take
        size = min(largest, size * 2)
    if len(plan) > 2 and plan[-1] + plan[-2] <= largest:
        remainder = plan.pop()
        plan[-1] += remainder
    return plan[::-1]


def _take_verdicts(job: FetchJob, chunks: Sequence[Sequence[_Block]],
                   digests: Sequence[list[int] | None], sums: Sequence[int]) -> None:
    """Marks each block of a chunk that was read OK (kept) or CHECKSUM by its digest against
    the source's checksum; a block whose checksum never came keeps its status."""
    statuses, keys, keep = job.statuses, job.keys, job.keep
    ok, bad, known = FetchStatus.OK, FetchStatus.CHECKSUM, len(sums)
    for chunk, got in zip(chunks, digests, strict=True):
        if got is None:
            continue
        for block, digest in zip(chunk, got, strict=True):
            i, nth = block[0], block[3]
            if nth >= known:
                continue
            if digest == sums[nth]:
                statuses[i] = ok
                keep[keys[i]] = digest
            else:
                statuses[i] = bad


class NixlTransport(ReadTransport):
    """READs over NIXL (UCX). Opt-in: NIXL registers a namespace's whole pool with no
    read-only mode, so an authenticated peer could also write it: trusted nodes only. Never
    with TLS (NIXL moves bytes outside the TLS channel)."""

    kind = pp.TransportKind.NIXL

    def __init__(self, engine: NixlEngine | None = None, **options: Any) -> None:
        super().__init__(engine if engine is not None else NixlEngine.shared(), **options)
