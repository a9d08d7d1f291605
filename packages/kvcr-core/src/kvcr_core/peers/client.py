"""`PeerClient`: fetches blocks from another node's Runner into reserved local slots.

Destination-initiated: the destination asks for the keys it lacks and reserves slots for them
while the source looks them up (a key stored here meanwhile, or one without room, is not
read), the source says which it holds, and their bytes land straight in those slots: over TCP
(`recv_into`, no copy), or, when both sides run NIXL and TLS is off, by a NIXL READ from the
source's leased slots (the control messages stay on the authenticated TCP connection). Every
block's xxh3-64 is verified against the source's checksum before it is published; a block
that does not match is dropped and counted. Per-key results carry reasons (`FetchStatus`).

Deadlines: every fetch ends by its deadline whatever the peer does (each socket wait and each
NIXL poll is bounded by the time left; a NIXL fetch moves in READs of at most `chunk_bytes`, in
the sizes of `read_plan`, which the NIXL engine's read lanes take in turn, each hashing the
chunk it read; no lane is left writing once the fetch returns); on timeout or cancel nothing
half-written becomes READY, and a connection whose stream could be out of step is dropped.
`fetch_async` returns a handle (poll / result / cancel) and runs on a bounded pool of threads;
beyond the bound it refuses at once (CAPACITY) instead of queueing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence

import msgspec

from kvcr_core.framing import FrameError, recv_exact_into, recv_frame
from kvcr_core.hints import Endpoint
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.auth import PeerSecret, new_nonce
from kvcr_core.peers.lanes import LaneJob, ReadLanes
from kvcr_core.peers.metrics import FetchStatus, PeerMetrics
from kvcr_core.peers.nixl_transport import (
    NixlEngine,
    NixlError,
    NixlRequestRefused,
    nixl_installed,
)
from kvcr_core.peers.protocol import Transport
from kvcr_core.peers.tls import PeerTLS
from kvcr_core.runner import NamespaceStore
from kvcr_core.types import BlockKey, OpId, SlotId

_MAX_IDLE_PER_PEER = 4
_FEATURES = (pp.LATE_CHECKSUMS,)  # offered with NIXL (tests turn it off to act older)
_NIXL_LAST_READ_BYTES = 512 << 10  # see read_plan
_ALONE = ReadLanes(0)  # a fetch READ by its own thread (parallel_reads off)
_MAX_KNOWN_PEERS = 256
# a block a NIXL fetch reads: key index, local slot, source address, place among the found
# blocks (that of its checksum)
_Block = tuple[int, SlotId, int, int]
_TCP_ANSWER_BACKOFF_S = 30.0  # a peer that answered an offer of NIXL with TCP: ask again later
_NIXL_FAILURE_BACKOFF_S = 300.0  # a peer whose NIXL metadata did not load here


class PeerRefused(ConnectionError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"peer refused ({reason}): {detail}")
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class FetchResult:
    statuses: tuple[FetchStatus, ...]  # aligned with the keys asked for
    received_bytes: int
    detail: str = ""
    transport: Transport | None = None  # None: nothing was asked of the peer

    @property
    def fetched(self) -> int:
        return sum(s is FetchStatus.OK for s in self.statuses)

    def ready_prefix(self) -> int:
        """How many keys from the start are now READY locally (fetched or already there)."""
        n = 0
        for status in self.statuses:
            if status not in (FetchStatus.OK, FetchStatus.PRESENT):
                break
            n += 1
        return n


class FetchHandle:
    """An asynchronous fetch: `poll()` (non-blocking), `result(timeout)`, `cancel()`."""

    def __init__(self, future: concurrent.futures.Future[FetchResult] | None,
                 cancel: threading.Event, immediate: FetchResult | None = None) -> None:
        self._future = future
        self._cancel = cancel
        self._immediate = immediate

    def poll(self) -> FetchResult | None:
        if self._immediate is not None:
            return self._immediate
        assert self._future is not None
        return self._future.result() if self._future.done() else None

    def result(self, timeout: float | None = None) -> FetchResult:
        if self._immediate is not None:
            return self._immediate
        assert self._future is not None
        return self._future.result(timeout)

    def cancel(self) -> None:
        self._cancel.set()


class _Connection:
    def __init__(self, sock: socket.socket, transport: Transport, nixl_peer: str = "") -> None:
        self.sock = sock
        self.transport = transport
        self.nixl_peer = nixl_peer  # the source's NIXL agent, on a NIXL connection
        self.late_checksums = False  # NIXL: checksums may follow NixlBlocks
        self.seq = 0


@dataclasses.dataclass
class _Fetch:
    """One fetch in flight: what was asked, where it lands, what became of each key."""

    keys: Sequence[BlockKey]
    slots: list[SlotId | None]  # where each lands, once reserved (after the Fetch is sent)
    wanted: list[int]  # the keys asked of the peer (those not READY here when asked)
    statuses: list[FetchStatus]
    keep: list[BlockKey]
    deadline: float
    cancel: threading.Event | None
    received: int = 0
    reservation: OpId | None = None

    def fail(self, status: FetchStatus) -> None:
        for i in self.wanted:
            if self.statuses[i] is FetchStatus.TIMEOUT:
                self.statuses[i] = status

    def cancelled(self) -> bool:
        if self.cancel is not None and self.cancel.is_set():
            self.fail(FetchStatus.CANCELLED)
            return True
        return False


class PeerClient:
    """Fetches into one local namespace store from peers that share its secret.
    `nixl=True` (opt-in) moves connections to NIXL when both sides have it; its fetches are
    READ and checked by the NIXL engine's read lanes (`parallel_reads`), or else by the
    fetching thread alone."""

    def __init__(self, store: NamespaceStore, secret: PeerSecret, metrics: PeerMetrics, *,
                 max_concurrent: int = 8, tls: PeerTLS | None = None, nixl: bool = False,
                 parallel_reads: bool = True) -> None:
        self.store = store
        self.secret = secret
        self.metrics = metrics
        self._tls = tls.client_context() if tls is not None else None
        self.nixl = NixlEngine.shared() if nixl and tls is None and nixl_installed() else None
        if self.nixl is not None:
            self.nixl.start()
        self._nixl_region: int | None = None  # our pool's address, once registered
        self._nixl_failed = False
        self._parallel_reads = parallel_reads
        self._tcp_until: dict[str, float] = {}  # endpoint -> when to offer it NIXL again
        self._valid: set[str] = set()  # endpoints already parsed
        self._idle: dict[str, list[_Connection]] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrent,
                                                           thread_name_prefix="kvcr-fetch")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            idle, self._idle = self._idle, {}
            region, self._nixl_region = self._nixl_region, None
        for conns in idle.values():
            for conn in conns:
                self._drop(conn)
        if self.nixl is not None and region is not None:
            self.nixl.deregister(region, self.store.pool.region.size_bytes)

    # -- public --------------------------------------------------------------------------------

    def fetch_async(self, endpoint: str, keys: Sequence[BlockKey],
                    deadline_s: float) -> FetchHandle:
        cancel = threading.Event()
        if not self._slots.acquire(blocking=False):
            statuses = (FetchStatus.CAPACITY,) * len(keys)
            self.metrics.on_fetch(Counter(statuses), 0)
            return FetchHandle(None, cancel, FetchResult(statuses, 0, "too many fetches"))

        def run() -> FetchResult:
            try:
                return self.fetch(endpoint, keys, deadline_s, cancel)
            finally:
                self._slots.release()

        return FetchHandle(self._pool.submit(run), cancel)

    def fetch(self, endpoint: str, keys: Sequence[BlockKey], deadline_s: float,
              cancel: threading.Event | None = None) -> FetchResult:
        self._check_endpoint(endpoint)
        present = self.store.contains(keys)
        statuses = [FetchStatus.PRESENT if p else FetchStatus.TIMEOUT for p in present]
        job = _Fetch(keys, [None] * len(keys), [i for i, p in enumerate(present) if not p],
                     statuses, [], time.monotonic() + deadline_s, cancel)
        detail = ""
        transport = None
        if job.wanted:
            try:
                transport = self._transfer(endpoint, job)
            except PeerRefused as exc:
                job.fail(FetchStatus.REFUSED)
                detail = str(exc)
            except (msgspec.MsgspecError, FrameError, NixlRequestRefused) as exc:
                job.fail(FetchStatus.PROTOCOL)
                detail = f"malformed answer: {exc}"
            except TimeoutError:
                detail = "deadline passed"  # statuses still TIMEOUT where not settled
            except (OSError, NixlError) as exc:
                job.fail(FetchStatus.UNREACHABLE)
                detail = f"{endpoint}: {exc}"
            finally:
                if job.reservation is not None:
                    self.store.settle(job.reservation, job.keep)
        self.metrics.on_fetch(Counter(statuses), job.received)
        return FetchResult(tuple(statuses), job.received, detail, transport)

    def _check_endpoint(self, endpoint: str) -> None:
        """A bad endpoint is the caller's bug (HintRejected); good ones are remembered."""
        if endpoint not in self._valid:
            Endpoint.parse(endpoint, where="peer endpoint")
            with self._lock:
                if len(self._valid) >= _MAX_KNOWN_PEERS:
                    self._valid.clear()
                self._valid.add(endpoint)

    # -- transfer ------------------------------------------------------------------------------

    def _transfer(self, endpoint: str, job: _Fetch) -> Transport:
        conn = self._checkout(endpoint, job.deadline)
        reusable = False
        try:
            conn.seq += 1
            self._timeout(conn, job.deadline)
            conn.sock.sendall(pp.encode(pp.Fetch(conn.seq, [job.keys[i] for i in job.wanted])))
            self._reserve(job)  # while the peer looks the keys up
            self._timeout(conn, job.deadline)
            reply = pp.decode_to_client(recv_frame(conn.sock)[0])
            if isinstance(reply, pp.Refused):
                raise PeerRefused(reply.reason, reply.detail)
            if isinstance(reply, pp.Blocks) and conn.transport is Transport.TCP:
                reusable = self._receive_tcp(conn, reply, job)
            elif isinstance(reply, pp.NixlBlocks) and conn.transport is Transport.NIXL:
                reusable = self._read_nixl(conn, reply, job)
            else:
                raise FrameError(f"a {type(reply).__name__} reply on a {conn.transport.value} "
                                 "connection")
            return conn.transport
        finally:
            if reusable:
                self._checkin(endpoint, conn)
            else:
                self._drop(conn)

    def _reserve(self, job: _Fetch) -> None:
        """Reserves slots for the keys asked of the peer. One stored (or being fetched)
        meanwhile is PRESENT, one beyond the pool's room CAPACITY: neither is read."""
        res = self.store.reserve([job.keys[i] for i in job.wanted])
        job.reservation = res.op if res.granted else None
        slots = job.slots
        for i, slot in zip(job.wanted, res.slots, strict=True):
            slots[i] = slot
        if res.granted < len(job.wanted):
            refused_from = len(job.wanted) - res.refused
            for n, i in enumerate(job.wanted):
                if slots[i] is None:
                    job.statuses[i] = (FetchStatus.CAPACITY if n >= refused_from
                                       else FetchStatus.PRESENT)

    def _receive_tcp(self, conn: _Connection, reply: pp.Blocks, job: _Fetch) -> bool:
        """Receives the found blocks; False when cancelled midway (the stream is out of step)."""
        if reply.seq != conn.seq or len(reply.found) != len(job.wanted):
            raise FrameError("a Blocks reply that does not match the Fetch")
        view, checksum, unpack = self.store.pool.view, pp.checksum, pp.CHECKSUM.unpack
        trailer = bytearray(pp.CHECKSUM.size)
        skipped: memoryview | None = None
        for i, found in zip(job.wanted, reply.found, strict=True):
            slot = job.slots[i]
            if not found:
                if slot is not None:
                    job.statuses[i] = FetchStatus.MISSING
                continue
            if job.cancelled():
                return False
            self._timeout(conn, job.deadline)
            if slot is None:  # stored here meanwhile, or no room: its bytes go nowhere
                skipped = skipped or memoryview(bytearray(self.store.pool.slot_bytes))
                recv_exact_into(conn.sock, skipped)
                recv_exact_into(conn.sock, memoryview(trailer))
                continue
            target = view(slot)
            recv_exact_into(conn.sock, target)
            got = checksum(target)  # while the kernel receives what follows
            recv_exact_into(conn.sock, memoryview(trailer))
            job.received += len(target)
            if got == unpack(trailer)[0]:
                job.statuses[i] = FetchStatus.OK
                job.keep.append(job.keys[i])
            else:
                job.statuses[i] = FetchStatus.CHECKSUM
        return True

    def _read_nixl(self, conn: _Connection, reply: pp.NixlBlocks, job: _Fetch) -> bool:
        """READs the found blocks in the chunks of `read_plan` on the NIXL engine's read lanes
        (kvcr_core.peers.lanes: each lane READs a chunk, then hashes it while it is in its
        core's cache, then takes the next; this thread waits). Every READ is made from
        prepared lists (`NixlEngine.prepare_reads`: local slots by index in the pool's
        prepared slot list), so little Python runs between copies. Once no chunk is being read
        any more, FetchDone releases the source's leases, the checksums still owed arrive
        (late_checksums: the source may send them after the addresses), and each block is
        kept only if its digest matches."""
        found = sum(reply.found)
        if (reply.seq != conn.seq or len(reply.found) != len(job.wanted)
                or len(reply.addresses) != found or len(reply.checksums) > found
                or (len(reply.checksums) < found and not conn.late_checksums)):
            raise FrameError("a NixlBlocks reply that does not match the Fetch")
        assert self.nixl is not None and self._nixl_region is not None
        pool, deadline = self.store.pool, job.deadline
        todo: list[_Block] = []
        nth = 0
        for i, present in zip(job.wanted, reply.found, strict=True):
            slot = job.slots[i]
            if not present:
                if slot is not None:
                    job.statuses[i] = FetchStatus.MISSING
                continue
            if slot is not None:  # None: stored here meanwhile, or no room (not read)
                todo.append((i, slot, reply.addresses[nth], nth))
            nth += 1
        chunks: list[Sequence[_Block]] = []
        firsts: list[int] = []  # each chunk's first place in todo (and in the remote list)
        first = 0
        for count in read_plan(len(todo), pool.slot_bytes, self.nixl.chunk_bytes,
                               _NIXL_LAST_READ_BYTES):
            firsts.append(first)
            chunks.append(todo[first:first + count])
            first += count
        slots = [[t[1] for t in chunk] for chunk in chunks]
        sums = list(reply.checksums)
        view, checksum = pool.view, pp.checksum
        ours = self.nixl.slot_list(self._nixl_region, pool.stride_bytes, pool.slot_bytes,
                                   pool.capacity_slots)
        reads = self.nixl.prepare_reads(conn.nixl_peer, ours, [t[2] for t in todo],
                                        pool.slot_bytes)

        waited: list[int] = []  # chunks whose READ was not done when posted

        def read_and_hash(n: int) -> list[int] | None:
            if job.cancelled():
                lane_job.stop()
                return None
            request = reads.make(slots[n], firsts[n])
            try:
                request.start(deadline)
                if request.state != "DONE":  # not copied within the post (not cma)
                    waited.append(n)
                    request.wait(deadline)
            finally:
                request.release()
            return [checksum(view(slot)) for slot in slots[n]]

        lane_job = LaneJob(len(chunks), read_and_hash)
        runner = self.nixl.read_lanes if self._parallel_reads else _ALONE
        try:
            try:
                runner.run(lane_job, deadline, job.cancelled)
            finally:
                reads.release()
                job.received += pool.slot_bytes * sum(
                    len(chunk) for chunk, got in zip(chunks, lane_job.digests, strict=True) if got)
            self._timeout(conn, deadline)
            # the source's leases can go; and, if every READ copied as it was posted (cma),
            # the source need not drive NIXL progress for us
            inline = not waited and any(got is not None for got in lane_job.digests)
            conn.sock.sendall(pp.encode(pp.FetchDone(reply.seq, inline)))
            while len(sums) < found:  # all it owes, even if we stopped early: the stream
                self._more_checksums(conn, reply.seq, sums, found, deadline)
        except (FrameError, msgspec.MsgspecError, NixlRequestRefused):
            raise  # a source that breaks the protocol gets nothing published
        except BaseException:  # deadline, cancel, a source gone: what was checked is kept
            _take_verdicts(job, chunks, lane_job.digests, sums)
            raise
        _take_verdicts(job, chunks, lane_job.digests, sums)
        return True

    def _more_checksums(self, conn: _Connection, seq: int, sums: list[int], found: int,
                        deadline: float) -> None:
        """Appends the next NixlChecksums message's checksums to `sums`. Raises FrameError for
        one out of order or too many."""
        self._timeout(conn, deadline)
        more = pp.decode_to_client(recv_frame(conn.sock)[0])
        if (not isinstance(more, pp.NixlChecksums) or more.seq != seq
                or more.start != len(sums) or len(sums) + len(more.checksums) > found
                or not more.checksums):
            raise FrameError("expected the next NixlChecksums of this fetch")
        sums.extend(more.checksums)

    @staticmethod
    def _timeout(conn: _Connection, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        conn.sock.settimeout(left)

    # -- connections ---------------------------------------------------------------------------

    def _checkout(self, endpoint: str, deadline: float) -> _Connection:
        with self._lock:
            idle = self._idle.get(endpoint)
            conn = idle.pop() if idle else None
        if conn is not None and conn.transport is Transport.TCP and self._nixl_ready(endpoint):
            self._drop(conn)  # made before NIXL was running here: connect again, offering it
            conn = None
        return conn if conn is not None else self._connect(endpoint, deadline)

    def _checkin(self, endpoint: str, conn: _Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            if len(idle) < _MAX_IDLE_PER_PEER:
                idle.append(conn)
                return
        self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        conn.sock.close()
        if conn.nixl_peer and self.nixl is not None:
            self.nixl.drop_peer(conn.nixl_peer)

    def _connect(self, endpoint: str, deadline: float) -> _Connection:
        target = Endpoint.parse(endpoint)
        left = max(0.001, deadline - time.monotonic())
        sock = socket.create_connection((target.host, target.port), timeout=left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=target.host)
            conn = _Connection(sock, Transport.TCP)
            self._timeout(conn, deadline)
            offer = (Transport.NIXL.value,) if self._nixl_ready(endpoint) else ()
            ready = authenticate(sock, self.secret, self.store.digest, self.store.block_bytes,
                                 endpoint, offer, _FEATURES if offer else ())
            if ready.transport == Transport.NIXL.value and offer:
                assert self.nixl is not None
                try:
                    conn.nixl_peer = self.nixl.add_peer(ready.nixl_agent)
                except NixlError:
                    self._offer_later(endpoint, _NIXL_FAILURE_BACKOFF_S)
                    sock.close()
                    return self._connect(endpoint, deadline)  # again, offering TCP only
                conn.transport = Transport.NIXL
                conn.late_checksums = (pp.LATE_CHECKSUMS in ready.features
                                       and pp.LATE_CHECKSUMS in _FEATURES)  # only if offered
            elif ready.transport != Transport.TCP.value:
                raise FrameError(f"the peer chose transport {ready.transport!r}, not offered")
            elif offer:  # the peer has no NIXL (yet): keep TCP for a while
                self._offer_later(endpoint, _TCP_ANSWER_BACKOFF_S)
            return conn
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise

    def _offer_later(self, endpoint: str, backoff_s: float) -> None:
        with self._lock:
            if len(self._tcp_until) >= _MAX_KNOWN_PEERS:
                self._tcp_until.clear()
            self._tcp_until[endpoint] = time.monotonic() + backoff_s

    def _nixl_ready(self, endpoint: str) -> bool:
        """Whether to offer NIXL to `endpoint`: running here, our pool registered, and the peer
        neither answered an offer with TCP nor failed to load lately."""
        if (self.nixl is None or not self.nixl.ready() or self._nixl_failed
                or time.monotonic() < self._tcp_until.get(endpoint, 0.0)):
            return False
        with self._lock:
            if self._nixl_region is None:
                region = self.store.pool.region
                try:
                    self.nixl.register(region.address, region.size_bytes)
                except NixlError:
                    self._nixl_failed = True  # this pool cannot be a NIXL target: TCP it is
                    return False
                self._nixl_region = region.address
        return True


def read_plan(blocks: int, block_bytes: int, largest_bytes: int, last_bytes: int) -> list[int]:
    """How many blocks each NIXL READ of one fetch moves, in order: the last about
    `last_bytes`, each one before it twice the next, up to `largest_bytes`; a small remainder
    joins the READ after it (never the last). Why: the read lanes take READs in turn and each
    hashes its READ right after copying it, so READs of about 1 MiB keep the hash in the
    lane's cache and let the lanes share the work evenly, short last READs let both finish at
    about the same time, and prepared READs cost a few us each. Measured at 256 KiB blocks,
    16 MiB fetches, two lanes (docs/peers.md): 1 MiB READs ending in 512 KiB (2, 4 x 15, 2
    blocks) 0.905 and 0.917 of raw NIXL against 0.888 and 0.891 for 2 MiB ending in 1 MiB;
    4 MiB READs 0.84, 512 KiB ones 0.89."""
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


def _take_verdicts(job: _Fetch, chunks: Sequence[Sequence[_Block]],
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
                keep.append(keys[i])
            else:
                statuses[i] = bad


def authenticate(sock: socket.socket, secret: PeerSecret, namespace: bytes, block_bytes: int,
                 endpoint: str, transports: Sequence[str] = (),
                 features: Sequence[str] = ()) -> pp.Ready:
    """The client half of the handshake (docs/peers.md); the socket's timeout bounds it.
    An empty `namespace` asks for an inventory-only session; `transports` offers extras
    beyond TCP, `features` protocol features. Returns the source's Ready (which transport it
    chose, which features it accepted)."""
    nonce = new_nonce()
    sock.sendall(pp.encode(pp.Hello(pp.PEER_PROTOCOL_VERSION, nonce)))
    challenge = pp.decode_to_client(recv_frame(sock)[0])
    if isinstance(challenge, pp.Refused):
        raise PeerRefused(challenge.reason, challenge.detail)
    if not isinstance(challenge, pp.Challenge):
        raise FrameError("expected Challenge")
    if not secret.check(b"server", challenge.nonce, nonce, challenge.mac):
        raise PeerRefused("auth", f"{endpoint} does not know the shared peer secret")
    sock.sendall(pp.encode(pp.Auth(secret.prove(b"client", nonce, challenge.nonce), namespace,
                                   block_bytes, list(transports), list(features))))
    ready = pp.decode_to_client(recv_frame(sock)[0])
    if isinstance(ready, pp.Refused):
        raise PeerRefused(ready.reason, ready.detail)
    if not isinstance(ready, pp.Ready):
        raise FrameError("expected Ready")
    return ready
