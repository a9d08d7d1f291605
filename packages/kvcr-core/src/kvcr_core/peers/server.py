"""`PeerServer`: serves a Runner's READY blocks to authenticated peers, over TCP or NIXL.

Threading: one accept thread, one thread per connection (bounded by `max_connections`; more
are refused as busy), each blocking with an I/O deadline so a silent peer costs a thread for
at most `io_timeout_s`. Blocks are leased while they are sent or read (never evicted
mid-transfer) and leave straight from pool memory (no copy). Each block's checksum is
computed once per slot generation and reused (`SlotChecksums`). The server keeps serving
whatever happens to the engines attached to the same Runner (in kvcr-guard it lives in the
daemon).

NIXL (when the destination offers it, this process has it running, and TLS is off): the pool
region of a namespace is registered once; a Fetch is answered with the blocks' addresses and
checksums, and the lease is held until the destination's FetchDone (or the connection ends).
With late_checksums (both sides name it) the answer goes out at once with the checksums
already known, and the others follow, 1 MiB of blocks at a time, while the destination reads.
NIXL's progress thread is off, so while a NIXL peer may be connecting or reading, its
connection thread drives progress between polls of the socket: every 0.1 ms while the peer
reads (UCX over TCP moves bytes only then), else backing off to 50 ms (connection set-up,
keep-alives), which is also the pace once the peer's FetchDone says its READs copy in its own
calls (UCX cma on one host: polling there only took CPU from the reader's copies).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from typing import Final

import msgspec

from kvcr_core.errors import UnknownNamespaceError
from kvcr_core.framing import FrameError, readable, recv_frame, send_all
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.auth import PeerSecret, new_nonce
from kvcr_core.peers.checksums import SlotChecksums
from kvcr_core.peers.metrics import PeerMetrics
from kvcr_core.peers.nixl_transport import NixlEngine, NixlError, nixl_installed
from kvcr_core.peers.protocol import RefuseReason, Transport
from kvcr_core.peers.tls import PeerTLS
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import NamespaceDigest, OwnerId

log = logging.getLogger("kvcr_core.peers")
_PEER_OWNER_BASE = 1 << 40  # owner ids of peer connections never clash with guard clients
_READING_PROGRESS_S: Final = 0.0001  # a peer is reading: UCX over a network needs us often
_IDLE_PROGRESS_MAX_S: Final = 0.05  # between fetches: connection set-up and keep-alives only
_SEND_GROUP_BYTES: Final = 1 << 20  # blocks per gather send (their checksums come first)


class _Refuse(Exception):
    def __init__(self, reason: RefuseReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class PeerServer:
    """Serves `runner`'s namespaces. `nixl=True` (opt-in: NIXL registers the whole namespace
    pool with no read-only mode, so an authenticated peer could also write it) offers NIXL
    reads to peers that ask; otherwise every connection stays on TCP."""

    def __init__(self, runner: Runner, secret: PeerSecret, metrics: PeerMetrics, *,
                 host: str = "127.0.0.1", port: int = 0, max_connections: int = 64,
                 io_timeout_s: float = 30.0, tls: PeerTLS | None = None,
                 nixl: bool = False) -> None:
        self.runner = runner
        self.secret = secret
        self.metrics = metrics
        self.max_connections = max_connections
        self.io_timeout_s = io_timeout_s
        self._tls = tls.server_context() if tls is not None else None
        # NIXL moves bytes outside the TLS channel, so TLS keeps everything on TCP.
        self.nixl = NixlEngine.shared() if nixl and tls is None and nixl_installed() else None
        if self.nixl is not None:
            self.nixl.start()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._workers: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._owners = itertools.count(_PEER_OWNER_BASE)
        self._sums: dict[NamespaceDigest, SlotChecksums] = {}  # one per namespace served
        # namespace -> (pool address, pool bytes, the NIXL metadata a peer needs to read it)
        self._registered: dict[NamespaceDigest, tuple[int, int, bytes]] = {}
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
            registered, self._registered = self._registered, {}
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for worker in workers:
            worker.join(timeout=5)
        if self.nixl is not None:
            for address, nbytes, _ in registered.values():
                self.nixl.deregister(address, nbytes)

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
            worker = threading.Thread(target=self._serve, args=(conn,), name="kvcr-peer-conn",
                                      daemon=True)
            with self._lock:
                self._workers.add(worker)
            worker.start()

    def _serve(self, raw: socket.socket) -> None:
        owner = OwnerId(next(self._owners))
        conn = raw
        try:
            if self._tls is not None:
                conn = self._tls.wrap_socket(raw, server_side=True)
            store, nixl, late = self._handshake(conn)
            inline = False  # the peer's last FetchDone: its READs copied in its own calls
            while True:
                message = pp.decode_to_server(self._next_frame(conn, nixl))
                if isinstance(message, pp.Inventory):
                    self._inventory(conn, message)
                elif isinstance(message, pp.PostHint):
                    conn.sendall(pp.encode(pp.HintPosted(self.runner.post_hint(message.envelope))))
                elif isinstance(message, pp.Fetch) and store is not None:
                    if nixl:
                        inline = self._fetch_nixl(conn, store, message, owner, late, inline)
                    else:
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
                self._workers.discard(threading.current_thread())
            conn.close()

    def _handshake(self, conn: socket.socket) -> tuple[NamespaceStore | None, bool, bool]:
        """(the peer's namespace, or None for an inventory reader; whether it uses NIXL;
        whether checksums may follow NixlBlocks: feature late_checksums)."""
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
            return None, False, False
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
        region = self._nixl_region(store) if Transport.NIXL.value in auth.transports else None
        nixl = region is not None
        late = nixl and pp.LATE_CHECKSUMS in auth.features
        if region is not None:
            conn.sendall(pp.encode(pp.Ready(Transport.NIXL.value, region[2],
                                            [pp.LATE_CHECKSUMS] if late else [])))
        else:
            conn.sendall(pp.encode(pp.Ready()))
        self.metrics.on_connection(Transport.NIXL if nixl else Transport.TCP)
        return store, nixl, late

    def _next_frame(self, conn: socket.socket, nixl: bool, reading: bool = False) -> bytearray:
        """The next frame. On a NIXL connection NIXL progress is driven while waiting for it:
        every 0.1 ms while the peer is `reading` (UCX over TCP serves reads only when the
        source progresses; over cma or RDMA it costs a few percent of a core), backing off to
        50 ms when idle."""
        if nixl and self.nixl is not None:
            end = time.monotonic() + self.io_timeout_s
            pause = _READING_PROGRESS_S if reading else 0.001
            while not readable(conn, pause):
                self.nixl.progress()
                if time.monotonic() >= end:
                    raise TimeoutError("peer silent past the I/O deadline")
                if not reading:
                    pause = min(pause * 2, _IDLE_PROGRESS_MAX_S)
        return recv_frame(conn)[0]

    # -- requests ------------------------------------------------------------------------------

    def _fetch(self, conn: socket.socket, store: NamespaceStore, fetch: pp.Fetch,
               owner: OwnerId) -> None:
        lease = store.acquire(fetch.keys, owner, prefix_only=False)  # type: ignore[arg-type]
        try:
            view, sums, pack = store.pool.view, self._checksums(store).of, pp.CHECKSUM.pack
            slots = [s for s in lease.slots if s is not None]
            out: list[bytes | memoryview] = [
                pp.encode(pp.Blocks(fetch.seq, [s is not None for s in lease.slots]))]
            per_send = max(1, _SEND_GROUP_BYTES // store.block_bytes)
            for start in range(0, len(slots), per_send):
                for slot in slots[start:start + per_send]:
                    out += (view(slot), pack(sums(slot)))
                send_all(conn, out)  # few system calls, few wake-ups of the destination
                out = []
            if out:
                send_all(conn, out)
            self.metrics.on_served(len(slots), len(slots) * store.block_bytes)
        finally:
            store.release(lease.op)

    def _fetch_nixl(self, conn: socket.socket, store: NamespaceStore, fetch: pp.Fetch,
                    owner: OwnerId, late: bool, inline: bool) -> bool:
        """Tells where the blocks lie; the destination READs them, then says FetchDone. With
        `late` (late_checksums) the answer goes out at once with the checksums already known,
        and the others follow group by group while the destination reads. While it reads,
        NIXL progress is driven often, unless its last FetchDone said its READs copy in its
        own calls (`inline`: UCX cma on one host), which need none from us. Returns what this
        fetch's FetchDone says."""
        region = self._nixl_region(store)
        if region is None:
            raise ConnectionAbortedError("the server is closing")
        base = region[0]
        lease = store.acquire(fetch.keys, owner, prefix_only=False)  # type: ignore[arg-type]
        try:
            stride, sums = store.pool.stride_bytes, self._checksums(store)
            slots = [s for s in lease.slots if s is not None]  # leased: inside the pool
            known = sums.known(slots) if late else [sums.of(s) for s in slots]
            conn.sendall(pp.encode(pp.NixlBlocks(
                fetch.seq, [s is not None for s in lease.slots],
                [base + s * stride for s in slots], known)))
            per_group = max(1, _SEND_GROUP_BYTES // store.block_bytes)
            for start in range(len(known), len(slots), per_group):
                group = [sums.of(s) for s in slots[start:start + per_group]]
                conn.sendall(pp.encode(pp.NixlChecksums(fetch.seq, start, group)))
                if self.nixl is not None and not inline:
                    self.nixl.progress()  # UCX over TCP serves the reads only when we do
            done = pp.decode_to_server(self._next_frame(conn, nixl=True, reading=not inline))
            if not isinstance(done, pp.FetchDone) or done.seq != fetch.seq:
                raise _Refuse(RefuseReason.MALFORMED, f"expected FetchDone({fetch.seq})")
            self.metrics.on_served(len(slots), len(slots) * store.block_bytes)
            return done.inline
        finally:
            store.release(lease.op)

    def _nixl_region(self, store: NamespaceStore) -> tuple[int, int, bytes] | None:
        """The namespace's pool address, size and NIXL metadata (registered once); None: use
        TCP."""
        if self.nixl is None or not self.nixl.ready():
            return None
        with self._lock:
            registered = self._registered.get(store.digest)
            if registered is None and not self._closed:
                region = store.pool.region
                try:
                    metadata = self.nixl.register(region.address, region.size_bytes)
                except NixlError as exc:
                    log.warning("peers of %s use TCP: %s", store.digest.hex(), exc)
                    return None
                registered = self._registered[store.digest] = (region.address,
                                                               region.size_bytes, metadata)
            return registered

    def _checksums(self, store: NamespaceStore) -> SlotChecksums:
        sums = self._sums.get(store.digest)
        if sums is None:
            with self._lock:
                sums = self._sums.setdefault(store.digest, SlotChecksums(store))
        return sums

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
