"""`PeerClient`: fetches blocks from another node's Runner into reserved local slots.

Destination-initiated: the destination asks for the keys it lacks and reserves slots for them
while the source looks them up (a key stored here meanwhile, or one without room, is not
read), the source says which it holds, and their bytes land straight in those slots by the
connection's transport (kvcr_core.peers.transport): streamed on the TCP connection
(`TcpTransport`), or, when both sides agree on it (`transport=`, e.g. NIXL with `nixl=True`;
never with TLS), READ from the source's leased slots. Every block's xxh3-64 is verified
against the source's checksum before it is published; a block that does not match is
dropped and counted. Per-key results carry reasons (`FetchStatus`).

Deadlines: every fetch ends by its deadline whatever the peer does (each socket wait and each
read is bounded by the time left); on timeout or cancel nothing half-written becomes READY,
and a connection whose stream could be out of step is dropped. `fetch_async` returns a handle
(poll / result / cancel) and runs on a bounded pool of threads; beyond the bound it refuses
at once (CAPACITY) instead of queueing. Idle connections are pooled per endpoint (bounded).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence

import msgspec

from kvcr_core.endpoint import Endpoint
from kvcr_core.framing import FrameError, recv_frame
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.connection import DestConnection, FetchJob, PeerRefused, authenticate
from kvcr_core.peers.fleet import FleetCredential, Identity, PeerCredential
from kvcr_core.peers.metrics import PeerMetrics
from kvcr_core.peers.nixl_engine import nixl_installed
from kvcr_core.peers.origins import Expected, OriginRegistry, expected_sums
from kvcr_core.peers.protocol import TransportKind
from kvcr_core.peers.tcp import TcpTransport
from kvcr_core.peers.tls import PeerTLS
from kvcr_core.peers.transport import PeerTransport, ReadRefused, TransportError, offered
from kvcr_core.runner import NamespaceStore
from kvcr_core.types import BlockKey, FetchStatus

_MAX_IDLE_PER_PEER = 4
_MAX_KNOWN_PEERS = 256


@dataclasses.dataclass(frozen=True)
class FetchResult:
    statuses: tuple[FetchStatus, ...]  # aligned with the keys asked for
    received_bytes: int
    detail: str = ""
    transport: TransportKind | None = None  # None: nothing was asked of the peer

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


class PeerClient:
    """Fetches into one local namespace store from peers that share its secret. Blocks travel
    by `transport` when the source agrees to it (else, and always with TLS, by TCP);
    `nixl=True` is `transport=NixlTransport(parallel_reads=parallel_reads)` where nixl is
    installed."""

    def __init__(self, store: NamespaceStore, secret: PeerCredential, metrics: PeerMetrics, *,
                 max_concurrent: int = 8, tls: PeerTLS | None = None, nixl: bool = False,
                 parallel_reads: bool = True, transport: PeerTransport | None = None,
                 origins: OriginRegistry | None = None) -> None:
        """`origins`: the Runner's origin books (fleet credentials; one is made if None):
        each fetched block is kept only if a trusted node signed its bytes as its origin."""
        self.store = store
        self.secret = secret
        self.origins = origins if origins is not None or not isinstance(
            secret, FleetCredential) else OriginRegistry(secret)
        self.metrics = metrics
        self._tls = tls.client_context() if tls is not None else None
        if transport is None and nixl and tls is None and nixl_installed():
            from kvcr_core.peers.reads import NixlTransport

            transport = NixlTransport(parallel_reads=parallel_reads)
        # bytes outside the TLS channel would defeat it: TLS keeps every connection on TCP
        self.preferred = transport if tls is None else None
        self._tcp = TcpTransport()
        self._valid: set[str] = set()  # endpoints already parsed
        self._idle: dict[str, list[DestConnection]] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrent,
                                                           thread_name_prefix="kvcr-fetch")
        self._checks = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvcr-origin")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._checks.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                self._drop(conn)
        if self.preferred is not None:
            self.preferred.release(self.store)

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
        job = FetchJob(keys, [None] * len(keys), [i for i, p in enumerate(present) if not p],
                       statuses, {}, time.monotonic() + deadline_s, cancel)
        detail = ""
        transport = None
        if job.wanted:
            try:
                transport = self._transfer(endpoint, job)
            except PeerRefused as exc:
                job.fail(FetchStatus.REFUSED)
                detail = str(exc)
            except (msgspec.MsgspecError, FrameError, ReadRefused) as exc:
                job.fail(FetchStatus.PROTOCOL)
                detail = f"malformed answer: {exc}"
            except TimeoutError:
                detail = "deadline passed"  # statuses still TIMEOUT where not settled
            except (OSError, TransportError) as exc:
                job.fail(FetchStatus.UNREACHABLE)
                detail = f"{endpoint}: {exc}"
            finally:
                if job.reservation is not None:
                    self.store.settle(job.reservation, job.keep)
                    if self.origins is not None and job.origins:
                        self.origins.book(self.store.digest).record(job.keep, job.origins,
                                                                    self.store)
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

    def _transfer(self, endpoint: str, job: FetchJob) -> TransportKind:
        conn = self._checkout(endpoint, job.deadline)
        reusable = False
        try:
            conn.seq += 1
            conn.time_left(job.deadline)
            conn.sock.sendall(pp.encode(pp.Fetch(conn.seq, [job.keys[i] for i in job.wanted])))
            self._reserve(job)  # while the peer looks the keys up
            conn.time_left(job.deadline)
            reply = pp.decode_to_client(recv_frame(conn.sock)[0])
            if isinstance(reply, pp.Refused):
                raise PeerRefused(reply.reason, reply.detail)
            checked = None
            if self.origins is not None:  # a fleet: where each block comes from, first
                reply, checked = self._origins(conn, reply, job)
            reusable = conn.transport.receive(conn, reply, job)
            if checked is not None:
                self._keep_only_from_origins(job, checked.result())
            return conn.transport.kind
        finally:
            if reusable:
                self._checkin(endpoint, conn)
            else:
                self._drop(conn)

    def _origins(self, conn: DestConnection, origins: pp.ToClient, job: FetchJob
                 ) -> tuple[pp.ToClient, concurrent.futures.Future[Expected]]:
        """Reads the blocks' reply that follows `origins` and checks the origins on a helper
        thread while the bytes arrive."""
        if not isinstance(origins, pp.Origins) or origins.seq != conn.seq:
            raise FrameError("a fleet source sends Origins before its blocks")
        conn.time_left(job.deadline)
        reply = pp.decode_to_client(recv_frame(conn.sock)[0])
        found = getattr(reply, "found", None)
        if not isinstance(found, list) or len(found) != len(job.wanted):
            raise FrameError("a reply to Origins that does not match the Fetch")
        keys = [job.keys[i] for i, f in zip(job.wanted, found, strict=True) if f]
        assert self.origins is not None
        check = functools.partial(expected_sums, self.origins.credential, self.store.digest,
                                  origins, keys)
        return reply, self._checks.submit(check)

    def _keep_only_from_origins(self, job: FetchJob, expected: Expected) -> None:
        """Keeps a block only if its origin signed it and its bytes hash as signed."""
        where = {job.keys[i]: i for i in job.wanted}
        for key, got in list(job.keep.items()):
            signed = expected.get(key)
            if signed is None or signed[0] != got:
                del job.keep[key]
                job.statuses[where[key]] = FetchStatus.UNTRUSTED
        job.origins = {k: expected[k][1] for k in job.keep}

    def _reserve(self, job: FetchJob) -> None:
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

    # -- connections ---------------------------------------------------------------------------

    def _checkout(self, endpoint: str, deadline: float) -> DestConnection:
        with self._lock:
            idle = self._idle.get(endpoint)
            conn = idle.pop() if idle else None
        if conn is not None and conn.node and not self.secret.identify_again(Identity(conn.node)):
            self._drop(conn)  # its node was revoked since
            conn = None
        if (conn is not None and conn.transport is self._tcp and self.preferred is not None
                and self.preferred.usable(endpoint, self.store)):
            self._drop(conn)  # made before the preferred transport was usable: offer it now
            conn = None
        return conn if conn is not None else self._connect(endpoint, deadline)

    def _checkin(self, endpoint: str, conn: DestConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            if len(idle) < _MAX_IDLE_PER_PEER:
                idle.append(conn)
                return
        self._drop(conn)

    def _drop(self, conn: DestConnection) -> None:
        conn.sock.close()
        conn.transport.drop(conn)

    def _connect(self, endpoint: str, deadline: float) -> DestConnection:
        target = Endpoint.parse(endpoint)
        left = max(0.001, deadline - time.monotonic())
        sock = socket.create_connection((target.host, target.port), timeout=left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=target.host)
            conn = DestConnection(sock, endpoint, self._tcp, self.store)
            conn.time_left(deadline)
            offer = self.preferred
            if offer is not None and not offer.usable(endpoint, self.store):
                offer = None
            transports, features = offered(offer)
            ready = authenticate(sock, self.secret, self.store.digest, self.store.block_bytes,
                                 endpoint, transports, features)
            conn.node = ready.node
            if offer is not None and ready.transport is offer.kind:
                conn.transport = offer
                conn.features = frozenset(ready.features) & frozenset(offer.features)
                try:
                    offer.open(conn, ready)
                except TransportError:  # it offers itself again only after a while
                    sock.close()
                    return self._connect(endpoint, deadline)  # again, offering TCP only
            elif ready.transport is not TransportKind.TCP:
                raise FrameError(f"the peer chose transport {ready.transport.value!r}, "
                                 "not offered")
            elif offer is not None:  # the peer has no such transport (yet)
                offer.declined(endpoint)
            return conn
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise
