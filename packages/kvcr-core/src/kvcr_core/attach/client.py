"""`AttachClient`: an engine's attachment to its Runner's attach server (in kvcr-guard, or
embedded in the engine).

Attach = connect to the Unix socket, send `Hello` (namespace, block size, identity, pid),
receive `Welcome` and the pool memfd (SCM_RIGHTS), map it. After that the client copies KV
bytes straight into and out of pool slots; only keys, slot numbers and op ids cross the
socket, batched so one engine step costs one round trip (`batch`).

Failure model (fail open): any socket error, timeout or refusal raises `RunnerUnavailable`
and detaches; the caller recomputes instead of using the cache. The next call re-attaches,
no sooner than an exponential backoff (50 ms doubling to 5 s) after the last failure, so a
dead server costs nothing per request. A re-attached server may be a new one (cold) or the
same one after our own restart (warm: its READY blocks are all there).

Threading: every public method is thread-safe (one lock around each round trip). The
mapping of a previous attachment stays valid while the caller holds views into it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Sequence

import msgspec

from kvcr_core.attach import protocol as p
from kvcr_core.attach.compound import CompoundOps, Gathered, Handle, Pending, chunks
from kvcr_core.attach.replies import RunnerUnavailable as RunnerUnavailable
from kvcr_core.attach.replies import as_count, as_lease, as_reservation
from kvcr_core.blockcopy import load_blocks, store_blocks
from kvcr_core.errors import HintRejected
from kvcr_core.hints import split_hint
from kvcr_core.index import NO_OP, Lease, Reservation
from kvcr_core.keys import NamespaceSpec
from kvcr_core.memory import HostRegion, SlotPool
from kvcr_core.types import BlockKey, NamespaceDigest, OpId, OwnerId

_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 5.0
_MAX_IN_FLIGHT = 32


@dataclasses.dataclass(frozen=True)
class Attachment:
    owner: OwnerId
    digest: NamespaceDigest
    pool: SlotPool


class AttachClient:
    """One namespace's view of a Runner's pool, through one Unix socket connection."""

    def __init__(self, socket_path: str, namespace: NamespaceSpec, block_bytes: int, *,
                 identity: str = "", timeout_s: float = 2.0, map_pages: bool = False) -> None:
        """`map_pages`: this process copies KV into and out of the pool; once attached to a
        pool its Runner backs, map its pages here in the background as they are backed (no
        first-touch faults in the copies; a pool not backed is left so: its pages would be
        charged to this process)."""
        self.socket_path = socket_path
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.identity = identity or f"pid-{os.getpid()}"
        self.timeout_s = timeout_s
        self.map_pages = map_pages
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._attachment: Attachment | None = None
        self._seq = 0
        self._backoff_s = 0.0
        self._next_attempt = 0.0
        self._closed = False
        self._owed: dict[int, int] = {}  # seq -> results expected, for every request in flight
        self._arrived: dict[int, list[p.Result]] = {}  # replies read while awaiting another
        self._deferred: dict[int, list[int]] = {}  # nowait seq -> committed op id (or -1)
        self.attach_count = 0
        self.deferred_shortfalls = 0
        self._compound = CompoundOps()

    # -- attachment --------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._sock is not None

    @property
    def attachment(self) -> Attachment:
        with self._lock:
            self._ensure_attached()
            assert self._attachment is not None
            return self._attachment

    @property
    def pool(self) -> SlotPool:
        return self.attachment.pool

    def attach(self) -> Attachment:
        """Attaches now, ignoring the backoff (raises RunnerUnavailable on failure)."""
        with self._lock:
            self._next_attempt = 0.0
            self._ensure_attached()
            assert self._attachment is not None
            return self._attachment

    def try_attach(self, handshake_timeout_s: float = 0.0) -> bool:
        """Attaches now if the Runner answers, waiting up to `handshake_timeout_s` (when
        longer than `timeout_s`) for its Welcome: at engine start-up, so the namespace opens
        (and a prefaulting Runner backs its pages) before the first request, not during it.
        False if not attached: the first use tries again."""
        with self._lock:
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

    def _ensure_attached(self) -> None:
        if self._closed:
            raise RunnerUnavailable("closed", "the client was closed by its owner")
        if self._sock is not None:
            return
        now = time.monotonic()
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
        """Hello, Welcome with the namespace's memfd, a checked mapping (sealed, the announced
        size and geometry). Whatever fails, no descriptor or mapping is left behind."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        fds: list[int] = []
        try:
            sock.connect(self.socket_path)
            hello = p.Hello(p.PROTOCOL_VERSION,
                            p.NamespaceFields(**dataclasses.asdict(self.namespace)),
                            self.block_bytes, self.identity[:256], os.getpid())
            sock.sendall(p.encode_frame(hello))
            message, fds = self._read_frame(sock, with_fds=True)
            if isinstance(message, p.Goodbye):
                raise RunnerUnavailable(message.reason, message.detail)
            if not isinstance(message, p.Welcome) or len(fds) != 1:
                raise RunnerUnavailable("protocol", f"expected Welcome with one fd, got {message}")
            region = HostRegion.map_fd(fds.pop(), message.region_bytes)  # closes the fd
            try:
                pool = SlotPool(region, message.slot_bytes)
                if (pool.stride_bytes != message.stride_bytes
                        or pool.capacity_slots != message.capacity_slots):
                    raise RunnerUnavailable("protocol",
                                            "pool geometry disagrees with the server's")
            except BaseException:
                region.close()
                raise
        except BaseException:
            for fd in fds:
                os.close(fd)
            sock.close()
            raise
        if self.map_pages and message.backed:
            region.map_pages_in_background()
        self._sock = sock
        self._attachment = Attachment(OwnerId(message.owner),
                                      NamespaceDigest(message.namespace_digest), pool)
        self.attach_count += 1

    @staticmethod
    def _read_frame(sock: socket.socket, *, with_fds: bool = False
                    ) -> tuple[p.Welcome | p.Goodbye | p.Reply | p.StatusReport, list[int]]:
        try:
            payload, fds = p.recv_frame(sock, max_fds=4 if with_fds else 0)
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
        self._next_attempt = time.monotonic() + self._backoff_s

    # -- operations --------------------------------------------------------------------------

    def batch(self, ops: Sequence[p.Op]) -> list[p.Result]:
        """Runs `ops` in one round trip; results in order. Raises RunnerUnavailable, or
        ValueError for a batch over the protocol's bounds (a caller bug: split it)."""
        return self.submit(ops).result()

    def submit(self, ops: Sequence[p.Op]) -> Pending[list[p.Result]]:
        """Sends `ops` now; the returned handle's `result()` waits for their reply. Several
        requests may be in flight: the server answers a connection's frames in order."""
        with self._lock:
            seq = self._send(ops)
        return Pending(self._await, seq, lambda results: results)

    def submit_nowait(self, ops: Sequence[p.Op]) -> None:
        """Sends `ops` and never waits for their reply (it is read and checked during a
        later call). For commits and releases on the hot path: this client's next call
        already sees their effect. A commit that turns out to publish nothing (its op
        reclaimed) is counted in `deferred_shortfalls`; nothing unwritten is ever published."""
        with self._lock:
            seq = self._send(ops)
            self._deferred[seq] = [op.op if isinstance(op, p.Commit) else -1 for op in ops]

    def flush(self) -> None:
        """Waits for every reply still owed (one Stats round trip)."""
        self.batch([p.Stats()])

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

    def _await(self, seq: int) -> list[p.Result]:
        with self._lock:
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

    def _one(self, op: p.Op) -> p.Result:
        result = self.batch([op])[0]
        if isinstance(result, p.Refused):
            raise RunnerUnavailable(result.reason, result.detail)
        return result

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """READY blocks at the start of `keys` (one request per `MAX_KEYS_PER_OP` keys, only
        while every block so far is READY)."""
        found = 0
        for part in chunks(keys, p.MAX_KEYS_PER_OP):
            result = self._one(p.Lookup(list(part)))
            assert isinstance(result, p.Count)
            found += result.n
            if result.n < len(part):
                break
        return found

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        flags: list[bool] = []
        for part in chunks(keys, p.MAX_KEYS_PER_OP):
            result = self._one(p.Contains(list(part)))
            assert isinstance(result, p.Flags)
            flags += result.values
        return flags

    def reserve(self, keys: Sequence[BlockKey]) -> Reservation:
        return self.reserve_async(keys).result()

    def reserve_async(self, keys: Sequence[BlockKey]) -> Handle[Reservation]:
        """Reserve now, collect the slots later (overlap the round trip with copying). More
        keys than one request may reserve go in several pipelined requests, answered as one
        reservation (kvcr_core.attach.compound)."""
        parts = [Pending(self._await, self.submit([p.Reserve(list(c))]).seq, as_reservation)
                 for c in chunks(keys)]
        if len(parts) == 1:
            return parts[0]
        return Gathered([part.result for part in parts], self._joined_reservation)

    def _joined_reservation(self, parts: list[Reservation]) -> Reservation:
        with self._lock:
            return self._compound.reservation(parts)

    def commit(self, op: OpId, *, checksums: Sequence[int]) -> int:
        """Publishes reservation `op`; `checksums`: each granted block's `block_checksum`, in
        the reservation's order, taken right after copying it. Returns blocks published."""
        results = [self.submit([c]) for c in self._commits(op, checksums)]
        return sum(as_count(r.result()) for r in results)

    def commit_nowait(self, op: OpId, *, checksums: Sequence[int]) -> None:
        """`commit` without waiting for the reply (see `submit_nowait`)."""
        for commit in self._commits(op, checksums):
            self.submit_nowait([commit])

    def _commits(self, op: OpId, checksums: Sequence[int]) -> list[p.Commit]:
        if op == NO_OP:
            return []
        with self._lock:
            parts = self._compound.take(op)
        if len(parts) == 1:
            return [p.Commit(op, list(checksums))]
        out, start = [], 0
        for part, granted in parts:
            out.append(p.Commit(part, list(checksums[start:start + granted])))
            start += granted
        return out

    def abort(self, op: OpId) -> int:
        results = [self.submit([p.Abort(part)]) for part in self._parts(op)]
        return sum(as_count(r.result()) for r in results)

    def release(self, op: OpId) -> bool:
        results = [self.submit([p.Release(part)]) for part in self._parts(op)]
        done = [r.result()[0] for r in results]
        return bool(done) and all(isinstance(d, p.Done) and d.ok for d in done)

    def release_nowait(self, op: OpId) -> None:
        """Ends a lease without waiting for the reply (see `submit_nowait`)."""
        for part in self._parts(op):
            self.submit_nowait([p.Release(part)])

    def _parts(self, op: OpId) -> list[OpId]:
        if op == NO_OP:
            return []
        with self._lock:
            return [part for part, _ in self._compound.take(op)]

    def acquire(self, keys: Sequence[BlockKey], *, prefix_only: bool = True,
                checksums: bool = False) -> Lease:
        """Leases READY blocks; `checksums`: with each one's committed checksum (to verify
        what is copied out)."""
        return self.acquire_async(keys, prefix_only=prefix_only, checksums=checksums).result()

    def acquire_async(self, keys: Sequence[BlockKey], *, prefix_only: bool = True,
                      checksums: bool = False) -> Handle[Lease]:
        """Acquire now, collect the leased slots later (in several pipelined requests when
        there are more keys than one request may lease; see `reserve_async`)."""
        parts = [Pending(self._await, self.submit([p.Acquire(list(c), prefix_only, checksums)]).seq,
                         as_lease) for c in chunks(keys)]
        if len(parts) == 1:
            return parts[0]
        return Gathered([part.result for part in parts],
                        lambda leases: self._joined_lease(leases, prefix_only))

    def _joined_lease(self, parts: list[Lease], prefix_only: bool) -> Lease:
        """One lease for the parts; with `prefix_only`, parts after one that stopped short
        are given back at once (a prefix ends at its first gap)."""
        kept: list[Lease] = []
        short = False
        for part in parts:
            if short:
                self.release_nowait(part.op)
                kept.append(Lease(NO_OP, (None,) * len(part.slots), 0))
                continue
            kept.append(part)
            short = prefix_only and part.granted < len(part.slots)
        with self._lock:
            return self._compound.lease(kept)

    def peer_fetch(self, endpoint: str, keys: Sequence[BlockKey], deadline_s: float) -> int:
        """Starts a fetch by the Runner from a peer it trusts; returns a ticket to poll."""
        result = self._one(p.PeerFetch(endpoint, list(keys), max(1, int(deadline_s * 1000))))
        assert isinstance(result, p.Ticket)
        return result.id

    def peer_poll(self, ticket: int) -> p.FetchOutcome:
        result = self._one(p.PeerPoll(ticket))
        assert isinstance(result, p.FetchOutcome)
        return result

    def clear(self) -> int:
        """Drops this namespace's READY, unleased blocks; returns how many went."""
        result = self._one(p.Clear())
        assert isinstance(result, p.Count)
        return result.n

    def post_hint(self, envelope: str) -> int:
        """Posts a KV hint for requests to come (the Runner's `HintBoard`); returns the block
        hashes it remembered (0: rejected, and counted in kvcr_hints_total; a hint too large
        for one request that does not parse here: 0, not counted). A large hint goes as
        several pipelined parts (`split_hint`), so no request is heavy for the runner."""
        try:
            parts = split_hint(envelope, p.MAX_ATTACH_HINT_BYTES)
        except HintRejected:
            return 0
        return sum(as_count(h.result()) for h in [self.submit([p.PostHint(e)]) for e in parts])

    def remote_run(self, keys: Sequence[BlockKey]) -> tuple[str, int] | None:
        """Pull on miss: (peer, n) if a configured peer holds the first n of `keys` (a run
        worth fetching, as the Runner follows its peers' inventories); else None."""
        result = self._one(p.RemoteRun(list(keys[:p.MAX_KEYS_PER_OP])))
        assert isinstance(result, p.Run)
        return (result.endpoint, result.n) if result.n > 0 else None

    def hint_sources(self, hashes: Sequence[int]) -> list[str | None]:
        """The hinted source endpoint of each router hash (None: no live hint)."""
        sources: list[str | None] = []
        for part in chunks(hashes, p.MAX_KEYS_PER_OP):
            result = self._one(p.HintSources(list(part)))
            assert isinstance(result, p.Sources)
            sources += [result.endpoints[i] if i >= 0 else None for i in result.index]
        return sources

    def stats(self) -> p.PoolStats:
        result = self._one(p.Stats())
        assert isinstance(result, p.PoolStats)
        return result

    # -- copy helpers ------------------------------------------------------------------------

    def store(self, keys: Sequence[BlockKey], blocks: Sequence[bytes | memoryview]) -> int:
        """reserve + copy + commit; returns blocks stored. Raises RunnerUnavailable."""
        return store_blocks(self, keys, blocks)

    def load(self, keys: Sequence[BlockKey]) -> list[bytes]:
        """Bytes of the longest READY prefix (acquire + copy + release)."""
        return load_blocks(self, keys)

    def close(self) -> None:
        """Detaches and unmaps (the mapping stays if the caller still holds slot views)."""
        with self._lock:
            self._closed = True
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._attachment is not None:
                # With slot views still exported the mapping stays until they go.
                with contextlib.suppress(BufferError):
                    self._attachment.pool.close()
                self._attachment = None
