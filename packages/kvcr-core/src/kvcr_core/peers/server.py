"""`PeerServer`: serves a Runner's READY blocks to authenticated peers.

Threading: one accept thread, one thread per connection, each blocking with an I/O deadline.
Before authentication a connection is one of at most `max_pending` (one more closes the one
that waited longest, counted: a peer that knows the secret authenticates at once, so a flood
of idle connections cannot keep it out), must finish the whole handshake within
`handshake_timeout_s` (one deadline, not one per read: a timer closes it), and may send
frames of at most `MAX_HANDSHAKE_FRAME_BYTES`;
authenticated connections are counted apart (at most `max_connections`), so unauthenticated
ones can never crowd out peers and routers that know the secret. An address that failed to
authenticate `AuthThrottle.max_failures` times lately is closed at accept (guessing costs
time). A silent authenticated peer
costs a thread for at most `io_timeout_s`. Accept errors (out of descriptors included) back
off and retry: serving never stops but by `close`; a fault while serving one connection ends
that connection only. Refusals are counted and their log lines throttled.

Blocks are leased while they are sent or read (never evicted mid-transfer) and leave straight
from pool memory (no copy). Each block is served with the checksum its writer fixed at commit
(`NamespaceStore.checksums`), never one taken from the bytes as they are now, so a block
changed in the pool after its commit fails every peer's check. The server keeps serving
whatever happens to the engines attached to the same Runner (in kvcr-guard it lives in the
daemon).

Transports (kvcr_core.peers.transport): TCP always; another (`transports`, e.g. NIXL with
`nixl=True`; never with TLS) when the destination offers it and it can expose the
namespace's pool now (exposed once per namespace, undone at `close`). How a Fetch is answered
and how the connection waits for the next message are the chosen transport's.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Sequence

import msgspec

from kvcr_core.errors import UnknownNamespaceError
from kvcr_core.framing import FrameError, recv_frame
from kvcr_core.logs import ThrottledLog, printable
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.auth import new_nonce
from kvcr_core.peers.connection import SourceConnection
from kvcr_core.peers.fleet import FleetCredential, Identity, PeerCredential
from kvcr_core.peers.metrics import PeerMetrics
from kvcr_core.peers.nixl_engine import nixl_installed
from kvcr_core.peers.origins import OriginRegistry
from kvcr_core.peers.protocol import PeerRefusal, TransportKind
from kvcr_core.peers.tcp import TcpTransport
from kvcr_core.peers.throttle import AuthThrottle
from kvcr_core.peers.tls import PeerTLS
from kvcr_core.peers.transport import PeerTransport
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import NamespaceDigest, OwnerId

log = logging.getLogger("kvcr_core.peers")
_PEER_OWNER_BASE = 1 << 40  # owner ids of peer connections never clash with guard clients
_ACCEPT_PAUSE_S = (0.05, 1.0)  # after an accept error: first pause, longest pause


class _Refuse(Exception):
    def __init__(self, reason: PeerRefusal, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class PeerServer:
    """Serves `runner`'s namespaces. `transports`: those it may use beyond TCP, in order of
    preference; `nixl=True` adds NIXL where it is installed (opt-in: NIXL registers the whole
    namespace pool with no read-only mode, so an authenticated peer could also write it).
    With TLS every connection stays on TCP."""

    def __init__(self, runner: Runner, secret: PeerCredential, metrics: PeerMetrics, *,
                 host: str = "127.0.0.1", port: int = 0, max_connections: int = 64,
                 max_pending: int = 16, handshake_timeout_s: float = 2.0,
                 io_timeout_s: float = 30.0, tls: PeerTLS | None = None,
                 nixl: bool = False, transports: Sequence[PeerTransport] = (),
                 origins: OriginRegistry | None = None) -> None:
        """`origins`: the Runner's origin books (fleet credentials; one is made if None)."""
        self.runner = runner
        self.secret = secret
        self.origins = origins if origins is not None or not isinstance(
            secret, FleetCredential) else OriginRegistry(secret)
        self.metrics = metrics
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.handshake_timeout_s = handshake_timeout_s
        self.throttle = AuthThrottle()
        self.io_timeout_s = io_timeout_s
        self._pending = 0  # connections not authenticated yet
        self._waiting: dict[socket.socket, None] = {}  # those, oldest first
        self._authenticated = 0
        self._warn = ThrottledLog(log)
        self._tls = tls.server_context() if tls is not None else None
        extra = list(transports)
        if nixl and nixl_installed() and not any(t.kind is TransportKind.NIXL for t in extra):
            from kvcr_core.peers.reads import NixlTransport

            extra.append(NixlTransport())
        # other transports move bytes outside the TLS channel: TLS keeps everything on TCP
        self.transports: list[PeerTransport] = [] if tls is not None else extra
        self._tcp = TcpTransport()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._workers: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._owners = itertools.count(_PEER_OWNER_BASE)
        # (transport, namespace) -> what a peer needs to reach the exposed pool
        self._exposed: dict[tuple[TransportKind, NamespaceDigest], tuple[PeerTransport,
                                                                      NamespaceStore, bytes]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kvcr-peer-accept",
                                        daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def close(self) -> None:
        """Stops accepting, ends every connection, and returns once no connection thread
        touches the pool any more (bounded: 5 s each)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread at once
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(timeout=5)
        with self._lock:
            conns, workers = list(self._conns), list(self._workers)
            exposed, self._exposed = self._exposed, {}
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for worker in workers:
            worker.join(timeout=5)
        for transport, store, _ in exposed.values():
            transport.unexpose(store)

    def forget(self, store: NamespaceStore) -> None:
        """`store`'s namespace is going away: undo what exposed its pool to transports."""
        with self._lock:
            gone = [key for key in self._exposed if key[1] == store.digest]
            exposed = [self._exposed.pop(key) for key in gone]
        for transport, namespace, _ in exposed:
            transport.unexpose(namespace)

    # -- connections ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        pause = 0.0
        while not self._closed:
            try:
                conn, address = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                self.metrics.on_accept_error()
                pause = min(_ACCEPT_PAUSE_S[1], max(_ACCEPT_PAUSE_S[0], pause * 2))
                self._warn.log(logging.WARNING, "accept", "peer server cannot accept (%s); "
                               "accepting again in %.2f s", exc, pause)
                time.sleep(pause)
                continue
            pause = 0.0
            source = str(address[0]) if isinstance(address, tuple) else str(address)
            if self.throttle.blocked(source):  # guessing: closed before a byte is read
                self.metrics.on_refused(PeerRefusal.THROTTLED)
                conn.close()
                continue
            with self._lock:
                oldest = next(iter(self._waiting)) if self._pending >= self.max_pending else None
                if oldest is not None:
                    del self._waiting[oldest]
                self._pending += 1
                self._conns.add(conn)
                self._waiting[conn] = None
            if oldest is not None:  # a flood that does not authenticate: the oldest goes
                self.metrics.on_refused(PeerRefusal.BUSY)
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.handshake_timeout_s)
            worker = threading.Thread(target=self._serve, args=(conn, source),
                                      name="kvcr-peer-conn",
                                      daemon=True)
            with self._lock:
                self._workers.add(worker)
            worker.start()

    def _admit(self, raw: socket.socket, sock: socket.socket) -> None:
        """The connection (`raw`, `sock` over it) authenticated: counted apart from pending
        ones, bounded."""
        with self._lock:
            self._pending -= 1
            self._waiting.pop(raw, None)
            busy = self._authenticated >= self.max_connections
            if not busy:
                self._authenticated += 1
        if busy:
            self._pending += 1  # undone where the connection ends, as for pending ones
            raise _Refuse(PeerRefusal.BUSY, "too many peer connections; retry later")
        sock.settimeout(self.io_timeout_s)

    def _serve(self, raw: socket.socket, source: str) -> None:
        owner = OwnerId(next(self._owners))
        sock = raw
        authenticated = False
        deadline = threading.Timer(self.handshake_timeout_s, self._expire, args=(raw,))
        deadline.daemon = True
        deadline.start()
        try:
            try:
                if self._tls is not None:
                    sock = self._tls.wrap_socket(raw, server_side=True)
                conn, identity = self._handshake(raw, sock, owner)
            except _Refuse as exc:
                if exc.reason is PeerRefusal.AUTH:
                    self.throttle.failed(source)
                raise
            finally:
                deadline.cancel()
            authenticated = True
            while True:
                if conn is None:  # an inventory reader (a router)
                    message = pp.decode_to_server(recv_frame(sock)[0])
                else:
                    message = pp.decode_to_server(conn.transport.next_frame(conn))
                if identity.name and not self.secret.identify_again(identity):
                    raise _Refuse(PeerRefusal.AUTH, f"{identity.name!r} was revoked")
                if identity.router and not isinstance(message, pp.Inventory):
                    raise _Refuse(PeerRefusal.AUTH, "a router may only read inventories")
                if isinstance(message, pp.Inventory):
                    self._inventory(sock, message)
                elif isinstance(message, pp.PostHint):
                    poster = f"peer:{identity.name or source}"
                    posted = self.runner.post_hint(message.envelope, poster)
                    sock.sendall(pp.encode(pp.HintPosted(posted)))
                elif isinstance(message, pp.Fetch) and conn is not None:
                    conn.transport.send(conn, message)
                else:
                    raise _Refuse(PeerRefusal.MALFORMED, "expected Fetch, Inventory or PostHint")
        except _Refuse as exc:
            self._refuse(sock, exc.reason, exc.detail)
        except (msgspec.MsgspecError, FrameError) as exc:
            self._refuse(sock, PeerRefusal.MALFORMED, str(exc))
        except OSError:
            pass  # the peer went away, went silent past the deadline, or failed TLS
        except Exception as exc:  # a fault of ours: this connection only
            self._warn.log(logging.ERROR, "internal", "peer connection failed: %s",
                           printable(exc), exc_info=True)
        finally:
            with self._lock:
                self._conns.discard(raw)
                self._waiting.pop(raw, None)
                self._workers.discard(threading.current_thread())
                if authenticated:
                    self._authenticated -= 1
                else:
                    self._pending -= 1
            sock.close()

    def _handshake(self, raw: socket.socket, sock: socket.socket,
                   owner: OwnerId) -> tuple[SourceConnection | None, Identity]:
        """The peer's connection in its namespace, on the transport both agree on; None for
        an inventory reader. The peer proves it knows the secret before this source says
        anything that depends on it (its own proof goes in Ready)."""
        limit = pp.MAX_HANDSHAKE_FRAME_BYTES
        hello = pp.decode_to_server(recv_frame(sock, limit=limit)[0])
        if not isinstance(hello, pp.Hello):
            raise _Refuse(PeerRefusal.MALFORMED, "expected Hello")
        if hello.version != pp.PEER_PROTOCOL_VERSION:
            raise _Refuse(PeerRefusal.VERSION, f"peer speaks {hello.version}, this runner "
                          f"{pp.PEER_PROTOCOL_VERSION}: run matching kvcr versions")
        nonce = new_nonce()
        sock.sendall(pp.encode(pp.Challenge(pp.PEER_PROTOCOL_VERSION, nonce)))
        auth = pp.decode_to_server(recv_frame(sock, limit=limit)[0])
        if not isinstance(auth, pp.Auth):
            raise _Refuse(PeerRefusal.MALFORMED, "expected Auth")
        identity = self.secret.identify(b"client", auth.node, hello.nonce, nonce, auth.mac)
        if identity is None:
            raise _Refuse(PeerRefusal.AUTH, "wrong peer secret" if not auth.node else
                          f"{printable(auth.node)!r} is not a trusted fleet node (unknown, "
                          "revoked, or not its key)")
        if identity.router and auth.namespace:
            raise _Refuse(PeerRefusal.AUTH, f"router {printable(auth.node)!r} may only read "
                          "inventories")
        proof = self.secret.prove(b"server", nonce, hello.nonce)
        if not auth.namespace:
            self._admit(raw, sock)
            sock.sendall(pp.encode(pp.Ready(proof, self.secret.name)))
            return None, identity
        store = self._namespace(auth)
        transport, reach = self._choose(store, auth.transports)
        features = frozenset(auth.features) & frozenset(transport.features)
        self._admit(raw, sock)
        sock.sendall(pp.encode(pp.Ready(proof, self.secret.name, transport.kind, reach,
                                        sorted(features))))
        self.metrics.on_connection(transport.kind)
        return SourceConnection(sock, store, owner, transport, store.checksums,
                                self.metrics, self.io_timeout_s, features, identity=identity,
                                origins=self.origins.frame_for(store.digest)
                                if self.origins is not None else None), identity

    def _namespace(self, auth: pp.Auth) -> NamespaceStore:
        if len(auth.namespace) != 16:
            raise _Refuse(PeerRefusal.MALFORMED, "a namespace digest is 16 bytes")
        try:
            store = self.runner.namespace(NamespaceDigest(auth.namespace))
        except UnknownNamespaceError:
            raise _Refuse(PeerRefusal.NAMESPACE, "this runner holds no blocks of namespace "
                          f"{auth.namespace.hex()}") from None
        if store.block_bytes != auth.block_bytes:
            raise _Refuse(PeerRefusal.NAMESPACE, f"blocks here are {store.block_bytes} bytes, "
                          f"the peer expects {auth.block_bytes}")
        return store

    def _choose(self, store: NamespaceStore,
                offered: Sequence[str]) -> tuple[PeerTransport, bytes]:
        """The first of our transports the peer offered that can expose `store` now (and
        what the peer needs to reach it); else TCP."""
        for transport in self.transports:
            if transport.kind.value not in offered:
                continue
            key = (transport.kind, store.digest)
            with self._lock:
                exposed = self._exposed.get(key)
                if exposed is None and not self._closed:
                    reach = transport.expose(store)
                    if reach is not None:
                        exposed = self._exposed[key] = (transport, store, reach)
            if exposed is not None:
                return transport, exposed[2]
        return self._tcp, b""

    def _inventory(self, sock: socket.socket, request: pp.Inventory) -> None:
        """The batches after `since` that fit one frame (at least one; a batch holds at most
        `InventoryLog.max_events` hashes of each kind); the reader asks again for the rest."""
        reset, batches = self.runner.inventory.read(request.since, request.max_batches)
        out: list[pp.InventoryBatchMsg] = []
        size = 0
        for b in batches:
            size += 64 + 9 * (len(b.stored) + len(b.removed))  # msgpack: <= 9 bytes a u64
            if out and size > pp.INVENTORY_REPLY_BYTES:
                break
            out.append(pp.InventoryBatchMsg(b.seq, b.namespace, b.stored.tolist(),
                                            b.removed.tolist()))
        sock.sendall(pp.encode(pp.InventoryReply(
            reset, self.runner.inventory.epoch, self.runner.inventory.last_seq, out)))

    def _expire(self, raw: socket.socket) -> None:
        """The whole handshake's deadline passed: a connection still waiting is closed (a
        peer trickling bytes cannot hold it open read by read)."""
        with self._lock:
            waiting = raw in self._waiting
        if waiting:
            self.metrics.on_refused(PeerRefusal.TIMEOUT)
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_RDWR)

    def _refuse(self, conn: socket.socket, reason: PeerRefusal, detail: str) -> None:
        self.metrics.on_refused(reason)
        self._warn.log(logging.WARNING, reason.value, "peer connection refused (%s): %s",
                       reason.value, printable(detail, 300))
        with contextlib.suppress(OSError):
            conn.sendall(pp.encode(pp.Refused(reason, detail)))
