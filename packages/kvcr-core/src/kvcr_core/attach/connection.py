"""`RunnerConnection`: one engine process's connection to a Runner's attach server (in
kvcr-guard, or embedded in the engine): the socket, Hello/Welcome, the mapped pools, framing,
pipelining and back-off. `AttachClient` puts the `RunnerOps` stubs on top.

Attach = connect to the Unix socket, send `Hello` (the namespaces, block size, identity, pid),
receive `Welcome` and one memfd per namespace (SCM_RIGHTS), map and check each (sealed, the
announced size and geometry). After that only keys, slot numbers and op ids cross the socket.

Pipelining: `submit` sends a request and returns a handle whose `result()` reads replies until
its own arrives (several requests may be in flight, at most `_MAX_IN_FLIGHT`: the server
answers a connection's frames in order); `submit_nowait` never waits (its reply is read and
checked during a later call). `round_trips` counts the requests waited for.

Who serves: before it says Hello, the client checks the server's uid (`SO_PEERCRED`) against
`runner_uids` (its own uid plus those configured): a socket bound by any other uid gets no
identity, no KV and no trust (`untrusted_runner`, logged). A connect refused for a full
backlog (EAGAIN, e.g. during a connect flood) is retried within `timeout_s`.

Failure model (fail open): any socket error, timeout or Goodbye raises `RunnerUnavailable`
and detaches; the caller recomputes. The next call re-attaches, no sooner than an exponential
backoff (50 ms doubling to 5 s, on the injected `clock`) after the last failure, so a dead
server costs nothing per request. A re-attached server may be a new one (cold) or the same
one after our own restart (warm).

Threading: thread-safe (one lock around each exchange). The mappings of a previous
attachment stay valid while the caller holds views into them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from kvcr_core.attach import protocol as p
from kvcr_core.attach.credentials import trusted_runner_uids, untrusted_runner
from kvcr_core.attach.ops import ClientClosed, RunnerUnavailable
from kvcr_core.keys import NamespaceSpec
from kvcr_core.logs import ThrottledLog
from kvcr_core.memory import HostRegion, SlotPool
from kvcr_core.types import NamespaceDigest, OwnerId

_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 5.0
_MAX_IN_FLIGHT = 32
_CONNECT_RETRY_S = 0.001  # after EAGAIN (the server's backlog is full), doubling to 20 ms

log = logging.getLogger("kvcr_core.attach")
_warn = ThrottledLog(log, 60.0)


@dataclasses.dataclass(frozen=True)
class Attachment:
    owner: OwnerId
    digests: tuple[NamespaceDigest, ...]
    pools: tuple[SlotPool, ...]


class RunnerConnection:
    """One connection for `namespaces` (in order: `ns` 0, 1, ...), all of `block_bytes`."""

    def __init__(self, socket_path: str, namespaces: Sequence[NamespaceSpec], block_bytes: int,
                 *, identity: str = "", timeout_s: float = 2.0, map_pages: bool = False,
                 runner_uids: frozenset[int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`map_pages`: this process copies KV into and out of the pools; once attached to a
        pool its Runner backs, map its pages here in the background as they are backed.
        `runner_uids`: the uids whose Runner this client accepts (default: its own uid)."""
        if not 1 <= len(namespaces) <= p.MAX_NAMESPACES_PER_CLIENT:
            raise ValueError(f"a client opens 1 to {p.MAX_NAMESPACES_PER_CLIENT} namespaces, "
                             f"not {len(namespaces)}")
        self.socket_path = socket_path
        self.namespaces = tuple(namespaces)
        self.block_bytes = block_bytes
        self.identity = identity or f"pid-{os.getpid()}"
        self.timeout_s = timeout_s
        self.map_pages = map_pages
        self.runner_uids = runner_uids if runner_uids is not None else trusted_runner_uids()
        self._clock = clock
        self.lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._attachment: Attachment | None = None
        self.shared = False
        """Processes of other uids map one of the pools too, as the Runner said at the last
        attach (kept while detached: a load right after a re-attach is checked as before)."""
        self._seq = 0
        self._backoff_s = 0.0
        self._next_attempt = 0.0
        self._closed = False
        self._owed: dict[int, int] = {}  # seq -> results expected, for every request in flight
        self._arrived: dict[int, list[p.Result]] = {}  # replies read while awaiting another
        self._deferred: dict[int, list[int]] = {}  # nowait seq -> committed op id (or -1)
        self.attach_count = 0
        self.round_trips = 0
        self.deferred_shortfalls = 0

    # -- attachment --------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._sock is not None

    @property
    def attachment(self) -> Attachment:
        with self.lock:
            self._ensure_attached()
            assert self._attachment is not None
            return self._attachment

    def attach(self) -> Attachment:
        """Attaches now, ignoring the backoff (raises RunnerUnavailable on failure)."""
        with self.lock:
            self._next_attempt = 0.0
            self._ensure_attached()
            assert self._attachment is not None
            return self._attachment

    def try_attach(self, handshake_timeout_s: float = 0.0) -> bool:
        """Attaches now if the Runner answers, waiting up to `handshake_timeout_s` (when
        longer than `timeout_s`) for its Welcome: at engine start-up, so the namespaces open
        (and a prefaulting Runner backs their pages) before the first request. False if not
        attached: the first use tries again."""
        with self.lock:
            if self._sock is not None:
                return True
            normal = self.timeout_s
            self.timeout_s = max(normal, handshake_timeout_s)
            self._next_attempt = 0.0
            try:
                self._ensure_attached()
            except RunnerUnavailable:
                return False
            finally:
                self.timeout_s = normal
            assert self._sock is not None
            self._sock.settimeout(normal)
            return True

    def retarget(self, socket_path: str) -> None:
        """Attach to the Runner at `socket_path` from now on (an embedded Runner's socket, as
        its engine learnt it): detaches from another one; the next call attaches."""
        with self.lock:
            if socket_path == self.socket_path:
                return
            self.socket_path = socket_path
            if self._sock is not None:
                self._fail()
            self._backoff_s = 0.0
            self._next_attempt = 0.0

    def _ensure_attached(self) -> None:
        if self._closed:
            raise ClientClosed()
        if self._sock is not None:
            return
        now = self._clock()
        if now < self._next_attempt:
            raise RunnerUnavailable("backoff", f"retrying in {self._next_attempt - now:.2f} s")
        try:
            self._connect()
        except RunnerUnavailable:
            self._fail()
            raise
        except (OSError, msgspec.MsgspecError, ValueError) as exc:
            self._fail()
            raise RunnerUnavailable("attach_failed", str(exc)) from None
        self._backoff_s = 0.0

    def _connect(self) -> None:
        """Hello, Welcome with one memfd per namespace, checked mappings. Whatever fails, no
        descriptor or mapping is left behind."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        fds: list[int] = []
        pools: list[SlotPool] = []
        try:
            self._connect_socket(sock)
            hello = p.Hello(p.PROTOCOL_VERSION,
                            [p.NamespaceFields(**dataclasses.asdict(ns)) for ns in self.namespaces],
                            self.block_bytes, self.identity[:256], os.getpid())
            sock.sendall(p.encode_frame(hello))
            message, fds = self._read_frame(sock, max_fds=len(self.namespaces))
            if isinstance(message, p.Goodbye):
                raise RunnerUnavailable(message.reason, message.detail)
            if not isinstance(message, p.Welcome) or len(fds) != len(self.namespaces) \
                    or len(message.pools) != len(fds):
                raise RunnerUnavailable("protocol", "expected Welcome with one fd per namespace")
            for info in message.pools:
                pools.append(_mapped(fds.pop(0), info))
        except BaseException:
            for fd in fds:
                os.close(fd)
            for pool in pools:
                pool.close()
            sock.close()
            raise
        if self.map_pages:
            for pool, info in zip(pools, message.pools, strict=True):
                if info.backed:
                    pool.region.map_pages_in_background()
        self._sock = sock
        self.shared = any(info.shared for info in message.pools)
        self._attachment = Attachment(
            OwnerId(message.owner),
            tuple(NamespaceDigest(info.namespace_digest) for info in message.pools), tuple(pools))
        self.attach_count += 1

    def _connect_socket(self, sock: socket.socket) -> None:
        """Connects (retrying EAGAIN until `timeout_s`) and checks who serves."""
        deadline = time.monotonic() + self.timeout_s
        pause = _CONNECT_RETRY_S
        while True:
            try:
                sock.connect(self.socket_path)
                break
            except OSError as exc:
                if exc.errno != errno.EAGAIN or time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        problem = untrusted_runner(sock, self.runner_uids, self.socket_path)
        if problem is not None:
            _warn.log(logging.ERROR, self.socket_path, "kvcr: not attaching: %s", problem)
            raise RunnerUnavailable("untrusted_runner", problem)

    @staticmethod
    def _read_frame(sock: socket.socket, *, max_fds: int = 0
                    ) -> tuple[p.Welcome | p.Goodbye | p.Reply | p.StatusReport, list[int]]:
        try:
            payload, fds = p.recv_frame(sock, max_fds=max_fds)
        except ConnectionError as exc:
            raise RunnerUnavailable("disconnected", str(exc)) from None
        except p.FrameError as exc:
            raise RunnerUnavailable("protocol", str(exc)) from None
        try:
            return p.decode_server(payload), fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _fail(self) -> None:
        self._owed.clear()
        self._arrived.clear()
        self._deferred.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._backoff_s = min(_BACKOFF_MAX_S, max(_BACKOFF_FIRST_S, self._backoff_s * 2))
        self._next_attempt = self._clock() + self._backoff_s

    # -- requests ----------------------------------------------------------------------------

    def submit(self, ops: Sequence[p.Op]) -> int:
        """Sends `ops` now; returns the seq `wait` takes. Raises RunnerUnavailable, or
        ValueError for a batch over the protocol's bounds (a caller bug: split it)."""
        with self.lock:
            return self._send(ops)

    def submit_nowait(self, ops: Sequence[p.Op]) -> None:
        """Sends `ops` and never waits for their reply (it is read and checked during a
        later call): for commits and releases on the hot path, whose effect this client's
        next call already sees. A commit that turns out to publish nothing (its op reclaimed)
        is counted in `deferred_shortfalls`; nothing unwritten is ever published."""
        with self.lock:
            seq = self._send(ops)
            self._deferred[seq] = [op.op if isinstance(op, p.Commit) else -1 for op in ops]

    def _send(self, ops: Sequence[p.Op]) -> int:
        if len(ops) > p.MAX_OPS_PER_REQUEST or any(
                p.op_key_count(op) > p.MAX_KEYS_PER_OP for op in ops):
            raise ValueError(f"a batch holds at most {p.MAX_OPS_PER_REQUEST} ops of at most "
                             f"{p.MAX_KEYS_PER_OP} keys each")
        self._ensure_attached()
        while len(self._owed) >= _MAX_IN_FLIGHT:  # bounded: read replies before sending more
            self._read_one()
        assert self._sock is not None
        frame = p.encode_frame(p.Request(self._seq + 1, list(ops)))
        if len(frame) > p.FRAME_HEADER.size + p.MAX_REQUEST_FRAME_BYTES:
            raise ValueError(f"a {len(frame)}-byte request; the runner takes at most "
                             f"{p.MAX_REQUEST_FRAME_BYTES} (send fewer ops per batch)")
        self._seq += 1
        try:
            self._sock.sendall(frame)
        except OSError as exc:
            self._fail()
            raise RunnerUnavailable("disconnected", str(exc) or type(exc).__name__) from None
        self._owed[self._seq] = len(ops)
        return self._seq

    def wait(self, seq: int) -> list[p.Result]:
        """The results of request `seq` (reading replies until it arrives)."""
        with self.lock:
            self.round_trips += 1
            while True:
                results = self._arrived.pop(seq, None)
                if results is not None:
                    return results
                if seq not in self._owed:
                    raise RunnerUnavailable("disconnected", "the request was lost with the "
                                           "connection to the runner")
                self._read_one()

    def _read_one(self) -> None:
        """Reads one reply frame and files it (awaited, or a deferred one to check)."""
        sock = self._sock
        assert sock is not None
        try:
            reply, _ = self._read_frame(sock)
            if isinstance(reply, p.Goodbye):
                raise RunnerUnavailable(reply.reason, reply.detail)
            if not isinstance(reply, p.Reply) or self._owed.pop(reply.seq, -1) != len(
                    reply.results):
                raise RunnerUnavailable("protocol", "a reply that matches no request")
        except RunnerUnavailable:
            self._fail()
            raise
        except (OSError, msgspec.MsgspecError) as exc:
            self._fail()
            raise RunnerUnavailable("disconnected", str(exc) or type(exc).__name__) from None
        committed = self._deferred.pop(reply.seq, None)
        if committed is None:
            self._arrived[reply.seq] = reply.results
            return
        for op, result in zip(committed, reply.results, strict=True):
            if op >= 0 and isinstance(result, p.Count) and result.n == 0:
                self.deferred_shortfalls += 1

    def close(self) -> None:
        """Detaches and unmaps (a mapping stays while the caller still holds slot views)."""
        with self.lock:
            self._closed = True
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._attachment is not None:
                for pool in self._attachment.pools:
                    with contextlib.suppress(BufferError):
                        pool.close()
                self._attachment = None


def _mapped(fd: int, info: p.PoolInfo) -> SlotPool:
    """The pool of one namespace, mapped from its memfd (closed here) and checked against
    what the server announced."""
    region = HostRegion.map_fd(fd, info.region_bytes)  # closes the fd
    try:
        pool = SlotPool(region, info.slot_bytes)
        if pool.stride_bytes != info.stride_bytes or pool.capacity_slots != info.capacity_slots:
            raise RunnerUnavailable("protocol", "pool geometry disagrees with the server's")
    except BaseException:
        region.close()
        raise
    return pool
