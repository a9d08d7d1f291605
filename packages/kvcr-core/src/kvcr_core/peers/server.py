"""`PeerServer`: serves a Runner's READY blocks to authenticated peers over TCP.

Threading: one accept thread, one thread per connection (bounded by `max_connections`; more
are refused as busy), each blocking with an I/O deadline so a silent peer costs a thread for
at most `io_timeout_s`. Blocks are leased while they are sent (never evicted mid-send) and
sent straight from pool memory (no copy). The server keeps serving whatever happens to the
engines attached to the same Runner (in kvcr-guard it lives in the daemon).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading

import msgspec

from kvcr_core.errors import UnknownNamespaceError
from kvcr_core.framing import FrameError, recv_frame
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.auth import PeerSecret, new_nonce
from kvcr_core.peers.metrics import PeerMetrics
from kvcr_core.peers.protocol import RefuseReason
from kvcr_core.peers.tls import PeerTLS
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import NamespaceDigest, OwnerId

log = logging.getLogger("kvcr_core.peers")
_PEER_OWNER_BASE = 1 << 40  # owner ids of peer connections never clash with guard clients


class _Refuse(Exception):
    def __init__(self, reason: RefuseReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class PeerServer:
    def __init__(self, runner: Runner, secret: PeerSecret, metrics: PeerMetrics, *,
                 host: str = "127.0.0.1", port: int = 0, max_connections: int = 64,
                 io_timeout_s: float = 30.0, tls: PeerTLS | None = None) -> None:
        self.runner = runner
        self.secret = secret
        self.metrics = metrics
        self.max_connections = max_connections
        self.io_timeout_s = io_timeout_s
        self._tls = tls.server_context() if tls is not None else None
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._owners = itertools.count(_PEER_OWNER_BASE)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kvcr-peer-accept",
                                        daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    # -- connections ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.io_timeout_s)
            with self._lock:
                busy = len(self._conns) >= self.max_connections
                if not busy:
                    self._conns.add(conn)
            if busy:
                self._refuse(conn, RefuseReason.BUSY, "too many peer connections; retry later")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvcr-peer-conn",
                             daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        owner = OwnerId(next(self._owners))
        conn = raw
        try:
            if self._tls is not None:
                conn = self._tls.wrap_socket(raw, server_side=True)
            store = self._handshake(conn)
            while True:
                payload, _ = recv_frame(conn)
                message = pp.decode_to_server(payload)
                if isinstance(message, pp.Inventory):
                    self._inventory(conn, message)
                elif isinstance(message, pp.PostHint):
                    conn.sendall(pp.encode(pp.HintPosted(self.runner.post_hint(message.envelope))))
                elif isinstance(message, pp.Fetch) and store is not None:
                    self._fetch(conn, store, message, owner)
                else:
                    raise _Refuse(RefuseReason.MALFORMED, "expected Fetch, Inventory or PostHint")
        except _Refuse as exc:
            self._refuse(conn, exc.reason, exc.detail)
        except (msgspec.MsgspecError, FrameError) as exc:
            self._refuse(conn, RefuseReason.MALFORMED, str(exc))
        except OSError:
            pass  # the peer went away, went silent past the deadline, or failed TLS
        finally:
            with self._lock:
                self._conns.discard(raw)
            conn.close()

    def _handshake(self, conn: socket.socket) -> NamespaceStore | None:
        hello = pp.decode_to_server(recv_frame(conn)[0])
        if not isinstance(hello, pp.Hello):
            raise _Refuse(RefuseReason.MALFORMED, "expected Hello")
        if hello.version != pp.PEER_PROTOCOL_VERSION:
            raise _Refuse(RefuseReason.VERSION, f"peer speaks {hello.version}, this runner "
                          f"{pp.PEER_PROTOCOL_VERSION}: run matching kvcr versions")
        nonce = new_nonce()
        conn.sendall(pp.encode(pp.Challenge(pp.PEER_PROTOCOL_VERSION, nonce,
                                            self.secret.prove(b"server", nonce, hello.nonce))))
        auth = pp.decode_to_server(recv_frame(conn)[0])
        if not isinstance(auth, pp.Auth):
            raise _Refuse(RefuseReason.MALFORMED, "expected Auth")
        if not self.secret.check(b"client", hello.nonce, nonce, auth.mac):
            raise _Refuse(RefuseReason.AUTH, "wrong peer secret")
        if not auth.namespace:  # an inventory reader (a router)
            conn.sendall(pp.encode(pp.Ready()))
            return None
        if len(auth.namespace) != 16:
            raise _Refuse(RefuseReason.MALFORMED, "a namespace digest is 16 bytes")
        try:
            store = self.runner.namespace(NamespaceDigest(auth.namespace))
        except UnknownNamespaceError:
            raise _Refuse(RefuseReason.NAMESPACE, "this runner holds no blocks of namespace "
                          f"{auth.namespace.hex()}") from None
        if store.block_bytes != auth.block_bytes:
            raise _Refuse(RefuseReason.NAMESPACE, f"blocks here are {store.block_bytes} bytes, "
                          f"the peer expects {auth.block_bytes}")
        conn.sendall(pp.encode(pp.Ready()))
        return store

    def _fetch(self, conn: socket.socket, store: NamespaceStore, fetch: pp.Fetch,
               owner: OwnerId) -> None:
        lease = store.acquire(fetch.keys, owner, prefix_only=False)  # type: ignore[arg-type]
        try:
            view = store.pool.view
            slots = [s for s in lease.slots if s is not None]
            conn.sendall(pp.encode(pp.Blocks(fetch.seq, [s is not None for s in lease.slots])))
            for slot in slots:
                data = view(slot)
                conn.sendall(data)  # returns once queued: hash it while the kernel sends it
                conn.sendall(pp.CHECKSUM.pack(pp.checksum(data)))
            self.metrics.on_served(len(slots), len(slots) * store.block_bytes)
        finally:
            store.release(lease.op)

    def _inventory(self, conn: socket.socket, request: pp.Inventory) -> None:
        reset, batches = self.runner.inventory.read(request.since, request.max_batches)
        conn.sendall(pp.encode(pp.InventoryReply(
            reset, self.runner.inventory.epoch, self.runner.inventory.last_seq,
            [pp.InventoryBatchMsg(b.seq, b.namespace, b.stored.tolist(), b.removed.tolist())
             for b in batches])))

    def _refuse(self, conn: socket.socket, reason: RefuseReason, detail: str) -> None:
        self.metrics.on_refused(reason)
        log.warning("peer connection refused (%s): %s", reason.value, detail)
        with contextlib.suppress(OSError):
            conn.sendall(pp.encode(pp.Refused(reason.value, detail)))
