"""`PeerClient`: fetches blocks from another node's Runner into reserved local slots.

Destination-initiated: the local namespace store reserves slots for the keys it lacks, the
source streams the bytes it holds, and they land straight in those slots (`recv_into`, no
copy). Every block's xxh3-64 checksum is verified before it is published (each side hashes
while the kernel moves bytes); a block that does not match is dropped and counted. Per-key
results carry reasons (`FetchStatus`).

Deadlines: every fetch ends by its deadline whatever the peer does (each socket wait is
bounded by the time left); on timeout or cancel the connection is dropped (its stream would
be out of step) and nothing half-written becomes READY. `fetch_async` returns a handle
(poll / result / cancel) and runs on a bounded pool of threads; beyond the bound it refuses at
once (CAPACITY) instead of queueing.
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
from kvcr_core.peers.metrics import FetchStatus, PeerMetrics
from kvcr_core.peers.tls import PeerTLS
from kvcr_core.runner import NamespaceStore
from kvcr_core.types import BlockKey, SlotId

_MAX_IDLE_PER_PEER = 4


class PeerRefused(ConnectionError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"peer refused ({reason}): {detail}")
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class FetchResult:
    statuses: tuple[FetchStatus, ...]  # aligned with the keys asked for
    received_bytes: int
    detail: str = ""

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
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.seq = 0


class PeerClient:
    """Fetches into one local namespace store from peers that share its secret."""

    def __init__(self, store: NamespaceStore, secret: PeerSecret, metrics: PeerMetrics, *,
                 max_concurrent: int = 8, tls: PeerTLS | None = None) -> None:
        self.store = store
        self.secret = secret
        self.metrics = metrics
        self._tls = tls.client_context() if tls is not None else None
        self._idle: dict[str, list[_Connection]] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrent,
                                                           thread_name_prefix="kvcr-fetch")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.sock.close()

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
        Endpoint.parse(endpoint, where="peer endpoint")  # a bad endpoint is the caller's bug
        deadline = time.monotonic() + deadline_s
        res = self.store.reserve(keys)
        statuses: list[FetchStatus] = [
            FetchStatus.PRESENT if slot is None else FetchStatus.TIMEOUT for slot in res.slots]
        for i in range(len(keys) - res.refused, len(keys)):
            statuses[i] = FetchStatus.CAPACITY
        wanted = [i for i, slot in enumerate(res.slots) if slot is not None]
        keep: list[BlockKey] = []
        received = 0
        detail = ""
        if wanted:
            try:
                received = self._transfer(endpoint, keys, res.slots, wanted, statuses, keep,
                                          deadline, cancel)
            except PeerRefused as exc:
                self._fail(wanted, statuses, FetchStatus.REFUSED)
                detail = str(exc)
            except (msgspec.MsgspecError, FrameError) as exc:
                self._fail(wanted, statuses, FetchStatus.PROTOCOL)
                detail = f"malformed answer: {exc}"
            except TimeoutError:
                detail = "deadline passed"  # statuses still TIMEOUT where not settled
            except OSError as exc:
                self._fail(wanted, statuses, FetchStatus.UNREACHABLE)
                detail = f"{endpoint}: {exc}"
            finally:
                self.store.settle(res.op, keep)
        self.metrics.on_fetch(Counter(statuses), received)
        return FetchResult(tuple(statuses), received, detail)

    # -- transfer ------------------------------------------------------------------------------

    @staticmethod
    def _fail(wanted: list[int], statuses: list[FetchStatus], status: FetchStatus) -> None:
        for i in wanted:
            if statuses[i] is FetchStatus.TIMEOUT:
                statuses[i] = status

    def _transfer(self, endpoint: str, keys: Sequence[BlockKey],
                  slots: Sequence[SlotId | None],
                  wanted: list[int], statuses: list[FetchStatus], keep: list[BlockKey],
                  deadline: float, cancel: threading.Event | None) -> int:
        conn = self._checkout(endpoint, deadline)
        reusable = False
        received = 0
        try:
            conn.seq += 1
            self._timeout(conn, deadline)
            conn.sock.sendall(pp.encode(pp.Fetch(conn.seq, [keys[i] for i in wanted])))
            self._timeout(conn, deadline)
            reply = pp.decode_to_client(recv_frame(conn.sock)[0])
            if isinstance(reply, pp.Refused):
                raise PeerRefused(reply.reason, reply.detail)
            if (not isinstance(reply, pp.Blocks) or reply.seq != conn.seq
                    or len(reply.found) != len(wanted)):
                raise FrameError("a Blocks reply that does not match the Fetch")
            view = self.store.pool.view
            trailer = bytearray(pp.CHECKSUM.size)
            for i, found in zip(wanted, reply.found, strict=True):
                if not found:
                    statuses[i] = FetchStatus.MISSING
                    continue
                if cancel is not None and cancel.is_set():
                    self._fail(wanted, statuses, FetchStatus.CANCELLED)
                    return received
                slot = slots[i]
                assert slot is not None
                target = view(slot)
                self._timeout(conn, deadline)
                recv_exact_into(conn.sock, target)
                got = pp.checksum(target)  # while the kernel receives what follows
                recv_exact_into(conn.sock, memoryview(trailer))
                received += len(target)
                if got == pp.CHECKSUM.unpack(trailer)[0]:
                    statuses[i] = FetchStatus.OK
                    keep.append(keys[i])
                else:
                    statuses[i] = FetchStatus.CHECKSUM
            reusable = True
            return received
        finally:
            if reusable:
                self._checkin(endpoint, conn)
            else:
                conn.sock.close()

    @staticmethod
    def _timeout(conn: _Connection, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        conn.sock.settimeout(left)

    def _checkout(self, endpoint: str, deadline: float) -> _Connection:
        with self._lock:
            idle = self._idle.get(endpoint)
            if idle:
                return idle.pop()
        return self._connect(endpoint, deadline)

    def _checkin(self, endpoint: str, conn: _Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            if len(idle) < _MAX_IDLE_PER_PEER:
                idle.append(conn)
                return
        conn.sock.close()

    def _connect(self, endpoint: str, deadline: float) -> _Connection:
        target = Endpoint.parse(endpoint)
        left = max(0.001, deadline - time.monotonic())
        sock = socket.create_connection((target.host, target.port), timeout=left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=target.host)
            conn = _Connection(sock)
            self._timeout(conn, deadline)
            authenticate(sock, self.secret, self.store.digest, self.store.block_bytes, endpoint)
            return conn
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise


def authenticate(sock: socket.socket, secret: PeerSecret, namespace: bytes, block_bytes: int,
                 endpoint: str) -> None:
    """The client half of the handshake (docs/peers.md); the socket's timeout bounds it.
    An empty `namespace` asks for an inventory-only session."""
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
                                   block_bytes)))
    ready = pp.decode_to_client(recv_frame(sock)[0])
    if isinstance(ready, pp.Refused):
        raise PeerRefused(ready.reason, ready.detail)
    if not isinstance(ready, pp.Ready):
        raise FrameError("expected Ready")
