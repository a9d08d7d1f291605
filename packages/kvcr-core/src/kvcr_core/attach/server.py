"""`AttachServer`: serves one Runner to attached engines over a Unix socket (the attach
protocol, kvcr_core.attach.protocol). kvcr-guard hosts it in a daemon; embedded mode in the
engine process, on a thread of its own.

One thread runs everything: a `selectors` loop over the listening socket, every client
connection, every client's pidfd and a wake-up pipe. Index operations take microseconds, so
serving them inline is faster than handing them to workers, and it makes the server's state
single-owner. The loop blocks in `select` when idle (no polling, no spinning).

Liveness: a client is gone at socket EOF, or when its pidfd (from the kernel's peer
credentials, not the pid the client claims) says the process exited, even if a forked child
still holds the socket. Either way its session is closed: FILLING blocks aborted, leases
released, READY blocks kept.

Shutdown (`request_shutdown()`, thread- and signal-safe): stop accepting, serve the frames
already received, tell every client Goodbye("shutdown"), close, remove the socket file, return
0. The pool is memfd memory: it disappears with its host and the last client mapping.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import socket
import struct
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry

from kvcr_core._version import __version__
from kvcr_core.attach import protocol as p
from kvcr_core.attach.config import ServerConfig
from kvcr_core.attach.metrics import AttachMetrics
from kvcr_core.attach.protocol import CloseReason
from kvcr_core.attach.session import ClientSession, SessionClosed
from kvcr_core.peers import PeerClient, PeerMetrics, PeerServer
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import OwnerId

log = logging.getLogger("kvcr_core.attach")

_RECV_BYTES = 256 * 1024
_UCRED = struct.Struct("3i")


class _Conn:
    __slots__ = ("counted", "inbuf", "outbuf", "pidfd", "session", "sock")

    def __init__(self, sock: socket.socket, session: ClientSession) -> None:
        self.sock = sock
        self.session = session
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.pidfd: int | None = None
        self.counted = False  # attach seen by the loop (pidfd watched, gauge updated)


class AttachServer:
    """Serves one Runner to attached engines until shut down."""

    def __init__(self, config: ServerConfig, *, registry: CollectorRegistry | None = None):
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.runner = Runner(config.runner, registry=self.registry)
        self.metrics = AttachMetrics(self.registry)
        self.peer_metrics = PeerMetrics(self.registry)
        self.peer_server: PeerServer | None = None
        self._peer_clients: dict[bytes, PeerClient] = {}
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopping = threading.Event()
        self._next_owner = 1
        self._started = time.monotonic()
        # One receive buffer for all connections: a fresh 256 KiB bytes per recv would be an
        # mmap/munmap pair (and page faults) per request.
        self._recv_buf = bytearray(_RECV_BYTES)
        self._recv_view = memoryview(self._recv_buf)

    # -- lifecycle ---------------------------------------------------------------------------

    def listen(self) -> None:
        """Binds the socket (0600), refusing to steal it from a live server."""
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
        os.chmod(path, 0o600)
        self._serve_on(sock)

    def _serve_on(self, sock: socket.socket) -> None:
        path = self.config.socket_path.replace("\0", "@")  # abstract names print as @name
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self._sel.register(sock, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        peer = self.config.peer
        if peer.listen:
            host, _, port = peer.listen.rpartition(":")
            assert peer.secret is not None
            self.peer_server = PeerServer(self.runner, peer.secret, self.peer_metrics,
                                          host=host.strip("[]"), port=int(port), tls=peer.tls,
                                          nixl=peer.nixl)
            log.info("kvcr serving peers on %s", self.peer_server.endpoint)
        log.info("kvcr %s serving %s (pool %d bytes)", __version__, path,
                 self.config.runner.pool_bytes)

    def _peer_client(self, store: NamespaceStore, endpoint: str) -> PeerClient | None:
        """The Runner's fetcher for a namespace, if `endpoint` is one of its peers."""
        peer = self.config.peer
        if endpoint not in peer.peers or peer.secret is None:
            return None
        client = self._peer_clients.get(store.digest)
        if client is None:
            client = self._peer_clients[store.digest] = PeerClient(
                store, peer.secret, self.peer_metrics, tls=peer.tls, nixl=peer.nixl)
        return client

    def request_shutdown(self) -> None:
        """Thread- and signal-safe."""
        self._stopping.set()
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def serve_forever(self) -> int:
        if self._listener is None:
            self.listen()
        while not self._stopping.is_set():
            for key, events in self._sel.select():
                self._dispatch(key, events)
        self._shutdown()
        return 0

    # -- events ------------------------------------------------------------------------------

    def _dispatch(self, key: selectors.SelectorKey, events: int) -> None:
        tag = key.data
        if tag == "listen":
            self._accept()
        elif tag == "wake":
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        elif isinstance(tag, tuple):  # ("pidfd", conn fd)
            conn = self._conns.get(tag[1])
            if conn is not None:
                self._close(conn, CloseReason.CLIENT_DIED, "client process exited")
        else:
            conn = self._conns.get(tag)
            if conn is None:
                return
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            if events & selectors.EVENT_READ and conn.sock.fileno() in self._conns:
                self._read(conn)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        pid, uid, _gid = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        owner = OwnerId(self._next_owner)
        self._next_owner += 1
        conn = _Conn(sock, ClientSession(owner, pid, self.runner, self.metrics, self._status,
                                         self._peer_client if self.config.peer.peers else None))
        self._conns[sock.fileno()] = conn
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, sock.fileno())
        if uid not in self.config.allowed_uids:
            self._refuse(conn, CloseReason.NOT_ALLOWED,
                         f"uid {uid} is not allowed; start kvcr-guard with --allowed-uid {uid}")
        elif len(self._conns) > self.config.max_clients:
            self._refuse(conn, CloseReason.TOO_MANY_CLIENTS,
                         f"{self.config.max_clients} clients attached already")

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
        self._serve_frames(conn)

    def _serve_frames(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        while not conn.outbuf and fd in self._conns:
            buf = conn.inbuf
            if len(buf) < p.FRAME_HEADER.size:
                return
            (length,) = p.FRAME_HEADER.unpack_from(buf)
            if length > p.MAX_FRAME_BYTES:
                self._refuse(conn, CloseReason.OVERSIZED_FRAME,
                             f"a {length}-byte frame (limit {p.MAX_FRAME_BYTES})")
                return
            end = p.FRAME_HEADER.size + length
            if len(buf) < end:
                return
            payload = bytes(buf[p.FRAME_HEADER.size:end])
            del buf[:end]
            try:
                reply, fds, close_after = conn.session.handle(payload)
            except SessionClosed as exc:
                self._refuse(conn, exc.reason, exc.detail, goodbye=exc.goodbye)
                return
            if conn.session.attached and not conn.counted:
                conn.counted = True
                self._watch_pid(conn)
                self.metrics.set_clients(sum(c.session.attached for c in self._conns.values()))
            self._send(conn, reply, fds)
            if close_after:
                self._close(conn, CloseReason.EOF, "status served")
                return

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
            self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn.sock.fileno())

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
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn.sock.fileno())
            self._serve_frames(conn)

    def _watch_pid(self, conn: _Conn) -> None:
        pid = conn.session.peer_pid
        if pid <= 0:
            return
        try:
            conn.pidfd = os.pidfd_open(pid)
        except OSError:  # another pid namespace, or already gone (EOF will tell)
            return
        self._sel.register(conn.pidfd, selectors.EVENT_READ, ("pidfd", conn.sock.fileno()))

    def _refuse(self, conn: _Conn, reason: CloseReason, detail: str, *,
                goodbye: bool = True) -> None:
        if goodbye:
            with contextlib.suppress(OSError):
                conn.sock.send(p.encode_frame(p.Goodbye(reason, detail)))
        self._close(conn, reason, detail)

    def _close(self, conn: _Conn, reason: CloseReason, detail: str) -> None:
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is None:
            return
        self._sel.unregister(conn.sock)
        if conn.pidfd is not None:
            self._sel.unregister(conn.pidfd)
            os.close(conn.pidfd)
        conn.sock.close()
        was_attached = conn.session.attached
        aborted, released = conn.session.close()
        self.metrics.connection_closed(
            reason, sum(c.session.attached for c in self._conns.values()))
        level = logging.INFO if reason in (CloseReason.EOF, CloseReason.CLIENT_DIED,
                                           CloseReason.SHUTDOWN) else logging.WARNING
        log.log(level, "client %d (pid %d%s) closed: %s: %s; reclaimed %d filling blocks, "
                "%d leases", conn.session.owner, conn.session.peer_pid,
                f", {conn.session.identity}" if was_attached else "", reason.value, detail,
                aborted, released)

    def _shutdown(self) -> None:
        log.info("kvcr runner shutting down: refusing new work, closing %d clients",
                 len(self._conns))
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None
            if not self.config.abstract:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.config.socket_path)
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.sock.setblocking(True)
                conn.sock.settimeout(1.0)
                self._read_pending(conn)
            self._refuse(conn, CloseReason.SHUTDOWN, "the kvcr runner is stopping")
        if self.peer_server is not None:
            self.peer_server.close()
        for client in self._peer_clients.values():
            client.close()
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.runner.close()

    def _read_pending(self, conn: _Conn) -> None:
        """Serves frames already received (in-flight work finishes before the Goodbye)."""
        if conn.outbuf:
            conn.sock.sendall(conn.outbuf)
            conn.outbuf.clear()
        self._serve_frames(conn)
        if conn.outbuf:
            conn.sock.sendall(conn.outbuf)
            conn.outbuf.clear()

    # -- status ------------------------------------------------------------------------------

    def _status(self) -> str:
        clients: dict[bytes, int] = {}
        for conn in self._conns.values():
            store = conn.session.store
            if store is not None:
                clients[store.digest] = clients.get(store.digest, 0) + 1
        namespaces: list[dict[str, Any]] = []
        for digest in self.runner.namespaces:
            store = self.runner.namespace(digest)
            idx, pool = store.index, store.pool
            namespaces.append({
                "namespace": digest.hex(), "block_bytes": pool.slot_bytes,
                "capacity_slots": idx.capacity_slots, "ready_blocks": idx.ready_blocks,
                "filling_blocks": idx.filling_blocks, "free_slots": idx.free_slots,
                "leased_slots": idx.leased_slots, "open_reservations": idx.open_reservations,
                "open_leases": idx.open_leases, "evictions": idx.evictions,
                "pool_bytes": pool.region.size_bytes, "clients": clients.get(digest, 0)})
        return json.dumps({
            "version": __version__, "pid": os.getpid(),
            "socket": self.config.socket_path.replace("\0", "@"),
            "uptime_s": round(time.monotonic() - self._started, 3),
            "clients": sum(c.session.attached for c in self._conns.values()),
            "peer_endpoint": self.peer_server.endpoint if self.peer_server else None,
            "pool_bytes": self.config.runner.pool_bytes, "namespaces": namespaces})
