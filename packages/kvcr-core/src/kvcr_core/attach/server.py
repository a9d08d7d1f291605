"""`AttachServer`: serves one Runner to attached engines over a Unix socket (the attach
protocol, kvcr_core.attach.protocol). kvcr-guard hosts it in a daemon; embedded mode in the
engine process, on a thread of its own.

One thread runs everything: a `selectors` loop (blocking when idle) over the listening socket,
every client connection and pidfd, and a wake-up pipe. Index operations take microseconds:
served inline, they are faster than with workers, and the server's state is single-owner.

Fairness and bounds: complete frames wait in a run queue and each connection gets one frame
per turn, so no client's burst delays the others by more than one of its frames; a
connection with frames queued or replies unsent is not read (its buffers stay bounded).
Before Hello a connection may send one small frame (`MAX_HELLO_FRAME_BYTES`) within
`handshake_timeout_s`, and at most `max_pending` such connections exist, counted apart from
attached clients. A fault while serving one connection closes that connection only
(`internal_error`, counted); accept errors (out of descriptors included) pause accepting
briefly; the loop ends only by `request_shutdown()`.

Liveness: a client is gone at socket EOF, or when its pidfd (from the kernel's peer
credentials, not the pid the client claims) says the process exited, even if a forked child
still holds the socket. Either way its session is closed: FILLING blocks aborted, leases
released, READY blocks kept. Who may attach where, the operations, peers and idle namespaces:
the `RunnerHost` and each connection's `ClientSession` (the codec in front of its service).

Shutdown (`request_shutdown()`, thread- and signal-safe): stop accepting, serve the frames
already received, tell every client Goodbye("shutdown"), close, remove the socket file, return
0. The pool is memfd memory: it disappears with its host and the last client mapping.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import selectors
import socket
import threading
import time

from prometheus_client import CollectorRegistry

from kvcr_core._version import __version__
from kvcr_core.attach import protocol as p
from kvcr_core.attach.config import ServerConfig
from kvcr_core.attach.credentials import grant_connect, peer_credentials
from kvcr_core.attach.host import RunnerHost
from kvcr_core.attach.protocol import CloseReason
from kvcr_core.attach.session import ClientSession, SessionClosed
from kvcr_core.attach.wake import WakePipe
from kvcr_core.logs import ThrottledLog, printable

log = logging.getLogger("kvcr_core.attach")

_RECV_BYTES = 256 * 1024
_ACCEPT_BATCH = 256  # connections accepted per turn of the loop
_BACKLOG = 4096  # (the kernel caps it at net.core.somaxconn)
_ACCEPT_PAUSE_S = (0.05, 1.0)  # after an accept error: first pause, longest pause
_TICK_S = 1.0  # idle namespaces are looked at this often
_QUIET = frozenset({CloseReason.EOF, CloseReason.CLIENT_DIED, CloseReason.SHUTDOWN})


class _Conn:
    __slots__ = ("deadline", "events", "fd", "inbuf", "outbuf", "pidfd", "queued", "session",
                 "sock")

    def __init__(self, sock: socket.socket, session: ClientSession, deadline: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()  # its key in the server's table while it is open
        self.session = session
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.pidfd: int | None = None
        self.deadline: float | None = deadline  # to say Hello by; None once attached
        self.queued = False  # in the run queue: a complete frame waits
        self.events = 0  # what the selector watches for it

    def frame_ready(self) -> bool:
        buf = self.inbuf
        if len(buf) < p.FRAME_HEADER.size:
            return False
        (length,) = p.FRAME_HEADER.unpack_from(buf)
        return bool(length > self.frame_limit() or len(buf) >= p.FRAME_HEADER.size + length)

    def frame_limit(self) -> int:
        return p.MAX_REQUEST_FRAME_BYTES if self.session.attached else p.MAX_HELLO_FRAME_BYTES


class AttachServer:
    """Serves one Runner (its `RunnerHost`) to attached engines until shut down."""

    def __init__(self, config: ServerConfig, *, registry: CollectorRegistry | None = None,
                 host: RunnerHost | None = None):
        """`host`: one built by the caller (tests that give it another peer half)."""
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.host = host if host is not None else RunnerHost(config, self.registry)
        self.runner = self.host.runner
        self.metrics = self.host.metrics
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}
        self._runq: collections.deque[_Conn] = collections.deque()
        self._pending = 0  # connections not attached yet
        self._listener: socket.socket | None = None
        self._accept_pause_s = 0.0
        self._accept_at = 0.0  # accepting again from then, after an accept error
        self._wake = WakePipe()
        self._stopping = threading.Event()
        self._next_tick = time.monotonic() + _TICK_S
        self._warn = ThrottledLog(log)
        # One receive buffer for all connections: a fresh 256 KiB bytes per recv would be an
        # mmap/munmap pair (and page faults) per request.
        self._recv_buf = bytearray(_RECV_BYTES)
        self._recv_view = memoryview(self._recv_buf)

    # -- lifecycle ---------------------------------------------------------------------------

    def listen(self) -> None:
        """Binds the socket (0600, and an ACL entry for each other allowed uid), refusing to
        steal it from a live server."""
        path = self.config.socket_path
        if self.config.abstract:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(path)
            except OSError:
                sock.close()
                raise RuntimeError(f"another kvcr runner is serving {path!r}") from None
            self._serve_on(sock)
            return
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale: its server is gone
            else:
                raise RuntimeError(f"another kvcr runner is serving {path}; stop it first or "
                                   "choose another socket")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old_umask)
        problem = grant_connect(path, self.config.allowed_uids)
        if problem is not None:
            log.warning("kvcr: %s", problem)
        self._serve_on(sock)

    def _serve_on(self, sock: socket.socket) -> None:
        path = self.config.socket_path.replace("\0", "@")  # abstract names print as @name
        sock.listen(_BACKLOG)
        sock.setblocking(False)
        self._listener = sock
        self._sel.register(sock, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake.read_fd, selectors.EVENT_READ, "wake")
        self.host.start()
        log.info("kvcr %s serving %s (pool %d bytes)", __version__, path,
                 self.config.runner.pool_bytes)

    def close_unserved(self) -> None:
        """Frees a server whose `listen` failed (it never served)."""
        self._sel.close()
        self._wake.close()
        self.host.close()

    def request_shutdown(self) -> None:
        """Thread- and signal-safe; harmless after the loop ended (`WakePipe`)."""
        self._stopping.set()
        self._wake.wake()

    def serve_forever(self) -> int:
        if self._listener is None:
            self.listen()
        while not self._stopping.is_set():
            try:
                self._turn()
            except Exception:  # a fault of ours: logged; the loop and other clients go on
                self._warn.log(logging.ERROR, "loop", "kvcr attach server: unexpected error "
                               "in its loop", exc_info=True)
        self._shutdown()
        return 0

    def _turn(self) -> None:
        """One pass: wait for events (bounded by the next deadline), then one frame per
        queued connection, then the timers."""
        timeout = 0.0 if self._runq else self._timeout()
        for key, events in self._sel.select(timeout):
            self._dispatch(key, events)
        for _ in range(len(self._runq)):
            conn = self._runq.popleft()
            conn.queued = False
            if self._open(conn):
                self._guarded(conn, self._serve_one)
        self._timers()

    # -- events ------------------------------------------------------------------------------

    def _dispatch(self, key: selectors.SelectorKey, events: int) -> None:
        tag = key.data
        if tag == "listen":
            self._accept()
        elif tag == "wake":
            self._wake.drain()
        elif isinstance(tag, tuple):  # ("pidfd", its connection)
            if self._open(tag[1]):
                self._close(tag[1], CloseReason.CLIENT_DIED, "client process exited")
        elif self._open(tag):
            self._guarded(tag, self._io, events)

    def _open(self, conn: _Conn) -> bool:  # (an event may outlive its connection's close)
        return self._conns.get(conn.fd) is conn

    def _guarded(self, conn: _Conn, work: object, *args: object) -> None:
        """Runs `work(conn, *args)`; a fault in it closes this connection only."""
        try:
            work(conn, *args)  # type: ignore[operator]
        except Exception as exc:
            self._warn.log(logging.ERROR, "internal", "kvcr attach server: error serving "
                           "client %d: %s", conn.session.owner, printable(exc), exc_info=True)
            self._close(conn, CloseReason.INTERNAL, printable(exc))

    def _io(self, conn: _Conn, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
        if events & selectors.EVENT_READ and self._open(conn):
            self._read(conn)

    def _accept(self) -> None:
        """Accepts what waits (at most a batch per turn): a flood must not fill the backlog
        that engines connect through."""
        for _ in range(_ACCEPT_BATCH):
            if self._listener is None or self._accept_at or not self._accept_one():
                return

    def _accept_one(self) -> bool:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return False
        except OSError as exc:  # out of descriptors, memory...: pause, never die
            self.metrics.on_accept_error()
            self._accept_pause_s = min(_ACCEPT_PAUSE_S[1],
                                       max(_ACCEPT_PAUSE_S[0], self._accept_pause_s * 2))
            self._accept_at = time.monotonic() + self._accept_pause_s
            self._sel.unregister(self._listener)
            self._warn.log(logging.WARNING, "accept", "kvcr attach server cannot accept (%s); "
                           "accepting again in %.2f s", exc, self._accept_pause_s)
            return False
        self._accept_pause_s = 0.0
        creds = peer_credentials(sock)
        pid, uid = creds.pid, creds.uid
        if uid not in self.config.allowed_uids:  # told and closed at once: no session, no
            self._turn_away(sock, pid, uid)  # turn of the loop (a foreign flood costs little)
            return True
        session = ClientSession(self.host.new_owner(), pid, uid, self.host,
                                self.config.socket_path)
        conn = _Conn(sock, session, time.monotonic() + self.config.handshake_timeout_s)
        self._conns[conn.fd] = conn
        self._pending += 1
        sock.setblocking(False)
        self._interest(conn)
        self._bound_pending(uid)
        self._publish_counts()
        return True

    def _turn_away(self, sock: socket.socket, pid: int, uid: int) -> None:
        detail = f"uid {uid} is not allowed; start kvcr-guard with --allowed-uid {uid}"
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(p.encode_frame(p.Goodbye(CloseReason.NOT_ALLOWED, detail)))
        sock.close()
        self.metrics.connection_closed(CloseReason.NOT_ALLOWED)
        self._warn.log(logging.WARNING, CloseReason.NOT_ALLOWED.value,
                       "connection of pid %d closed: not_allowed: %s", pid, detail)

    def _bound_pending(self, uid: int) -> None:
        """Closes the oldest connection waiting to say Hello of `uid` (over its own bound)
        or of all (over `max_pending`): the oldest waiter goes, not the newest, as an engine
        says Hello at once; a uid's flood evicts its own connections only."""
        waiting = [c for c in self._conns.values() if c.deadline is not None]
        mine = [c for c in waiting if c.session.uid == uid]
        if len(mine) > self.config.max_pending_per_uid:
            victims, bound = mine, f"{self.config.max_pending_per_uid} of uid {uid}"
        elif self._pending > self.config.max_pending:
            victims, bound = waiting, str(self.config.max_pending)
        else:
            return
        oldest = min(victims, key=lambda c: c.deadline or 0.0)
        self._refuse(oldest, CloseReason.TOO_MANY_CLIENTS,
                     f"{bound} connections wait to attach; the oldest goes")

    def _read(self, conn: _Conn) -> None:
        try:
            n = conn.sock.recv_into(self._recv_view)
        except BlockingIOError:
            return
        except OSError as exc:
            self._close(conn, CloseReason.EOF, str(exc))
            return
        if not n:
            self._close(conn, CloseReason.EOF, "client closed the connection")
            return
        conn.inbuf += self._recv_view[:n]
        self._queue_if_ready(conn)

    def _queue_if_ready(self, conn: _Conn) -> None:
        if not conn.queued and not conn.outbuf and conn.frame_ready():
            conn.queued = True
            self._runq.append(conn)
        self._interest(conn)

    def _serve_one(self, conn: _Conn) -> None:
        """Serves the connection's next frame (it is complete, or announced too large)."""
        buf = conn.inbuf
        (length,) = p.FRAME_HEADER.unpack_from(buf)
        if length > conn.frame_limit():
            self._refuse(conn, CloseReason.OVERSIZED_FRAME,
                         f"a {length}-byte frame (limit {conn.frame_limit()})")
            return
        end = p.FRAME_HEADER.size + length
        payload = bytes(buf[p.FRAME_HEADER.size:end])
        del buf[:end]
        was_attached = conn.session.attached
        try:
            reply, fds, close_after = conn.session.handle(payload)
        except SessionClosed as exc:
            self._refuse(conn, exc.reason, exc.detail, goodbye=exc.goodbye)
            return
        if conn.session.attached and not was_attached:
            self._on_attached(conn)
        self._send(conn, reply, fds)
        if close_after:
            self._close(conn, CloseReason.EOF, "status served")
        elif conn.sock.fileno() in self._conns:
            self._queue_if_ready(conn)

    def _on_attached(self, conn: _Conn) -> None:
        conn.deadline = None
        self._pending -= 1
        self._watch_pid(conn)
        self._publish_counts()

    def _send(self, conn: _Conn, frame: bytes, fds: list[int]) -> None:
        try:
            sent = (socket.send_fds(conn.sock, [frame], fds) if fds
                    else conn.sock.send(frame))
        except BlockingIOError:
            sent = 0
            if fds:
                self._close(conn, CloseReason.EOF, "cannot pass the pool fd now")
                return
        except OSError as exc:
            self._close(conn, CloseReason.EOF, str(exc))
            return
        if sent < len(frame):
            conn.outbuf += frame[sent:]
            self._interest(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
        except BlockingIOError:
            return
        except OSError as exc:
            self._close(conn, CloseReason.EOF, str(exc))
            return
        del conn.outbuf[:sent]
        if not conn.outbuf:
            self._queue_if_ready(conn)

    def _interest(self, conn: _Conn) -> None:
        """Watches what the connection needs: writable while replies wait, readable while it
        has no frame queued or reply unsent (so its buffers stay bounded)."""
        want = selectors.EVENT_WRITE if conn.outbuf else 0
        if not conn.outbuf and not conn.queued:
            want |= selectors.EVENT_READ
        if want == conn.events:
            return
        if conn.events and want:
            self._sel.modify(conn.sock, want, conn)
        elif want:
            self._sel.register(conn.sock, want, conn)
        else:
            self._sel.unregister(conn.sock)
        conn.events = want

    def _watch_pid(self, conn: _Conn) -> None:
        pid = conn.session.peer_pid
        if pid <= 0:
            return
        try:
            conn.pidfd = os.pidfd_open(pid)
        except OSError:  # another pid namespace, or already gone (EOF will tell)
            return
        self._sel.register(conn.pidfd, selectors.EVENT_READ, ("pidfd", conn))

    def _refuse(self, conn: _Conn, reason: CloseReason, detail: str, *,
                goodbye: bool = True) -> None:
        if goodbye:
            with contextlib.suppress(OSError):
                conn.sock.send(p.encode_frame(p.Goodbye(reason, detail)))
        self._close(conn, reason, detail)

    def _close(self, conn: _Conn, reason: CloseReason, detail: str) -> None:
        if not self._open(conn):
            return
        del self._conns[conn.fd]
        if conn.events:
            self._sel.unregister(conn.sock)
        if conn.pidfd is not None:
            self._sel.unregister(conn.pidfd)
            os.close(conn.pidfd)
        conn.sock.close()
        session = conn.session
        was_attached = session.attached
        if not was_attached:
            self._pending -= 1
        aborted, released = session.close()
        self.metrics.connection_closed(reason)
        self._publish_counts()
        message = ("client %d (pid %d, uid %d%s) closed: %s: %s; reclaimed %d filling "
                   "blocks, %d leases")
        args = (session.owner, session.peer_pid, session.uid,
                f", {printable(session.identity)}" if was_attached else "", reason.value,
                printable(detail, 300), aborted, released)
        if reason in _QUIET:  # a status probe (`kvcr status`, readiness) is not news
            log.log(logging.INFO if was_attached else logging.DEBUG, message, *args)
        else:
            self._warn.log(logging.WARNING, reason.value, message, *args)

    def _publish_counts(self) -> None:
        self.metrics.set_connections(self.host.attached_clients, self._pending)

    # -- timers ------------------------------------------------------------------------------

    def _timeout(self) -> float:
        now = time.monotonic()
        due = [self._next_tick]
        if self._accept_at:
            due.append(self._accept_at)
        due.extend(c.deadline for c in self._conns.values() if c.deadline is not None)
        return max(0.0, min(due) - now)

    def _timers(self) -> None:
        now = time.monotonic()
        if self._accept_at and now >= self._accept_at and self._listener is not None:
            self._accept_at = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        for conn in [c for c in self._conns.values()
                     if c.deadline is not None and c.deadline <= now]:
            self._refuse(conn, CloseReason.HANDSHAKE_TIMEOUT,
                         f"no Hello within {self.config.handshake_timeout_s} s")
        if now >= self._next_tick:
            self._next_tick = now + _TICK_S
            self.host.release_idle(now)
            self.host.peers.tick()

    # -- shutdown ----------------------------------------------------------------------------

    def _shutdown(self) -> None:
        log.info("kvcr runner shutting down: refusing new work, closing %d clients",
                 len(self._conns))
        if self._listener is not None:
            if not self._accept_at:
                self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None
            if not self.config.abstract:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.config.socket_path)
        for conn in list(self._conns.values()):
            with contextlib.suppress(Exception):
                conn.sock.setblocking(True)
                conn.sock.settimeout(1.0)
                self._read_pending(conn)
            self._refuse(conn, CloseReason.SHUTDOWN, "the kvcr runner is stopping")
        self._sel.close()
        self._wake.close()
        self.host.close()

    def _read_pending(self, conn: _Conn) -> None:
        """Serves frames already received (in-flight work finishes before the Goodbye)."""
        if conn.outbuf:
            conn.sock.sendall(conn.outbuf)
            conn.outbuf.clear()
        while conn.sock.fileno() in self._conns and conn.frame_ready():
            self._serve_one(conn)
            if conn.outbuf:
                conn.sock.sendall(conn.outbuf)
                conn.outbuf.clear()
