"""`ClientSession`: the protocol state and operations of one attached client.

A session starts NEW; a valid `Hello` for a namespace the client's uid may open (the host's
policy: tenants, namespaces per uid) opens or joins it in the Runner and makes the session
ATTACHED with its own owner id; every reservation and lease it takes is tagged with that id,
so its departure (`close`) aborts what it was writing and releases what it was reading,
never publishing a half-written block. Ops name ids the session owns, or do nothing. Each
client is bounded (`ClientLimits`): slots it holds FILLING or leased, open ops, fetches in
flight. Each request is bounded too, so no client holds the server's loop for long: keys
reserved or leased and slots committed, aborted or released, all its ops together, at most
`MAX_HEAVY_KEYS_PER_REQUEST` (the rest refused, counted); keys named by cheap ops at most
`MAX_KEYS_PER_REQUEST`; hints at most `MAX_ATTACH_HINT_BYTES`. A protocol violation raises
`SessionClosed` with a bounded reason; the server closes the connection and nothing else is
affected.

Threading: used by one thread at a time (the server's loop thread).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from typing import Protocol, TypeVar

import msgspec

from kvcr_core.attach import protocol as p
from kvcr_core.attach.metrics import AttachMetrics
from kvcr_core.attach.protocol import CloseReason, RefusalReason
from kvcr_core.errors import CapacityError, ConfigError
from kvcr_core.keys import NamespaceSpec
from kvcr_core.peers import PeerClient
from kvcr_core.peers.client import FetchHandle
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import BlockKey, NamespaceDigest, OpId, OwnerId

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ClientLimits:
    """What one attached client may hold at once."""

    held_fraction: float = 0.5  # of its namespace's slots, FILLING or leased
    ops: int = 1024  # open reservations and leases
    tickets: int = 64  # peer fetches in flight


class _Budget:
    """What one request may still make the server do (see the module docstring)."""

    __slots__ = ("_cheap", "_heavy", "_hint", "refused")

    def __init__(self) -> None:
        self._heavy = p.MAX_HEAVY_KEYS_PER_REQUEST
        self._cheap = p.MAX_KEYS_PER_REQUEST
        self._hint = p.MAX_ATTACH_HINT_BYTES
        self.refused = 0  # keys, slots or hints refused for the budget

    def heavy(self, keys: list[T]) -> list[T]:
        """The leading keys the budget still covers for a reserve or a lease."""
        take = keys[:self._heavy]
        self._heavy -= len(take)
        self.refused += len(keys) - len(take)
        return take

    def spend(self, slots: int) -> bool:
        """Whether an op of `slots` slots fits (it is then spent)."""
        if slots > self._heavy:
            self.refused += slots
            return False
        self._heavy -= slots
        return True

    def cheap(self, keys: list[T]) -> list[T]:
        take = keys[:self._cheap]
        self._cheap -= len(take)
        self.refused += len(keys) - len(take)
        return take

    def hint(self, nbytes: int) -> bool:
        if nbytes > self._hint:
            self.refused += 1
            return False
        self._hint -= nbytes
        return True


class SessionHost(Protocol):
    """What a session needs from the server that hosts it."""

    runner: Runner
    metrics: AttachMetrics
    limits: ClientLimits
    prefault: bool
    back_ahead_bytes: int

    def status(self) -> str: ...

    def admit(self, uid: int, spec: NamespaceSpec) -> tuple[CloseReason, str] | None: ...

    def peer_client(self, store: NamespaceStore, endpoint: str) -> PeerClient | None: ...

    def remote_run(self, namespace: NamespaceDigest,
                   keys: Sequence[BlockKey]) -> tuple[str, int] | None: ...

    @property
    def fetches_from_peers(self) -> bool: ...


class SessionClosed(Exception):
    """Close the connection; `goodbye` tells the client why first (when it is worth it)."""

    def __init__(self, reason: CloseReason, detail: str, *, goodbye: bool = True) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.goodbye = goodbye


class _State(enum.Enum):
    NEW = "new"
    ATTACHED = "attached"


class ClientSession:
    def __init__(self, owner: OwnerId, peer_pid: int, uid: int, host: SessionHost) -> None:
        self.owner = owner
        self.peer_pid = peer_pid
        self.uid = uid
        self.identity = ""
        self.store: NamespaceStore | None = None
        self.spec: NamespaceSpec | None = None
        self._host = host
        self._state = _State.NEW
        self._seq = 0
        self._held_limit = 0
        self._tickets: dict[int, FetchHandle] = {}
        self._next_ticket = 0

    @property
    def attached(self) -> bool:
        return self._state is _State.ATTACHED

    def handle(self, payload: bytes | bytearray) -> tuple[bytes, list[int], bool]:
        """One client frame -> (reply frame, fds to pass, close after sending)."""
        try:
            message = p.decode_client(payload)
        except msgspec.MsgspecError as exc:
            raise SessionClosed(CloseReason.MALFORMED, str(exc)) from None
        if isinstance(message, p.Probe):
            if self._state is not _State.NEW:
                raise SessionClosed(CloseReason.OUT_OF_ORDER, "Probe after Hello")
            return p.encode_frame(p.StatusReport(self._host.status())), [], True
        if isinstance(message, p.Hello):
            return self._hello(message)
        return p.encode_frame(self._request(message)), [], False

    def _hello(self, hello: p.Hello) -> tuple[bytes, list[int], bool]:
        if self._state is not _State.NEW:
            raise SessionClosed(CloseReason.OUT_OF_ORDER, "a second Hello")
        if hello.protocol != p.PROTOCOL_VERSION:
            raise SessionClosed(CloseReason.WRONG_VERSION,
                                f"client speaks protocol {hello.protocol}, this runner "
                                f"{p.PROTOCOL_VERSION}; install matching kvcr versions")
        try:
            spec = NamespaceSpec.from_mapping(msgspec.structs.asdict(hello.namespace))
        except ConfigError as exc:
            raise SessionClosed(CloseReason.BAD_NAMESPACE, str(exc)) from None
        refusal = self._host.admit(self.uid, spec)
        if refusal is not None:
            raise SessionClosed(*refusal)
        try:
            store = self._host.runner.open_namespace(spec, hello.block_bytes,
                                                     prefault=self._host.prefault,
                                                     back_ahead=self._host.back_ahead_bytes)
        except (ConfigError, ValueError) as exc:
            raise SessionClosed(CloseReason.BAD_NAMESPACE, str(exc)) from None
        except CapacityError as exc:
            raise SessionClosed(CloseReason.CAPACITY, str(exc)) from None
        self.store, self.spec = store, spec
        self.identity = hello.identity[:128]
        self._held_limit = max(1, int(store.index.capacity_slots
                                      * self._host.limits.held_fraction))
        self._state = _State.ATTACHED
        self._host.metrics.on_attach()
        pool = store.pool
        welcome = p.Welcome(p.PROTOCOL_VERSION, self.owner, store.digest, pool.slot_bytes,
                            pool.stride_bytes, pool.capacity_slots, pool.region.size_bytes,
                            pool.region.backs_pages)
        return p.encode_frame(welcome), [pool.region.fd], False

    def _request(self, request: p.Request) -> p.Reply:
        if self._state is not _State.ATTACHED or self.store is None:
            raise SessionClosed(CloseReason.OUT_OF_ORDER, "a Request before Hello")
        if request.seq <= self._seq:
            raise SessionClosed(CloseReason.OUT_OF_ORDER,
                                f"seq {request.seq} after {self._seq}: must increase")
        self._seq = request.seq
        start = time.perf_counter()
        budget = _Budget()
        results = [self._run(op, self.store, budget) for op in request.ops]
        self._host.metrics.on_request(time.perf_counter() - start, len(request.ops),
                                      budget.refused)
        return p.Reply(request.seq, results)

    @staticmethod
    def _keys(keys: list[bytes]) -> list[BlockKey]:
        return keys  # type: ignore[return-value]  # length and count checked by the decoder

    def _run(self, op: p.Op, store: NamespaceStore, budget: _Budget) -> p.Result:
        if isinstance(op, p.Lookup):
            return p.Count(store.lookup(self._keys(budget.cheap(op.keys))))
        if isinstance(op, p.Contains):
            flags = store.contains(self._keys(budget.cheap(op.keys)))
            return p.Flags(flags + [False] * (len(op.keys) - len(flags)))
        if isinstance(op, p.Reserve | p.Acquire):
            return self._take(op, store, budget)
        if isinstance(op, p.Commit | p.Abort | p.Release):
            return self._end(op, store, budget)
        if isinstance(op, p.Clear):
            return p.Count(store.clear())
        if isinstance(op, p.PostHint):
            if not budget.hint(len(op.envelope)):
                self._host.runner.metrics.hint_outcome("too_large")
                return p.Count(0)
            return p.Count(self._host.runner.post_hint(op.envelope))
        if isinstance(op, p.HintSources):
            return self._hint_sources(op, budget)
        if isinstance(op, p.RemoteRun):
            found = self._host.remote_run(store.digest, self._keys(budget.cheap(op.keys)))
            return p.Run(*found) if found is not None else p.Run("", 0)
        if isinstance(op, p.PeerFetch):
            return self._peer_fetch(op, store)
        if isinstance(op, p.PeerPoll):
            return self._peer_poll(op)
        idx = store.index
        return p.PoolStats(idx.capacity_slots, idx.ready_blocks, idx.filling_blocks,
                           idx.free_slots, idx.leased_slots, idx.open_reservations,
                           idx.open_leases, idx.evictions)

    def _take(self, op: p.Reserve | p.Acquire, store: NamespaceStore,
              budget: _Budget) -> p.Slots:
        """A reservation or a lease, within this client's limits and the request's budget
        (beyond them: refused)."""
        keys = self._keys(budget.heavy(op.keys))
        refused = len(op.keys) - len(keys)
        if store.index.owner_ops(self.owner) >= self._host.limits.ops:
            return p.Slots(0, [p.NO_SLOT] * len(op.keys), 0, len(op.keys))
        if isinstance(op, p.Reserve):
            res = store.reserve(keys, self.owner, limit=self._held_limit)
            return p.Slots(res.op, [p.NO_SLOT if s is None else s for s in res.slots]
                           + [p.NO_SLOT] * refused, res.granted, res.refused + refused)
        lease = store.acquire(keys, self.owner, prefix_only=op.prefix_only,
                              limit=self._held_limit)
        sums = store.checksums.of
        return p.Slots(lease.op, [p.NO_SLOT if s is None else s for s in lease.slots]
                       + [p.NO_SLOT] * refused, lease.granted, 0,
                       [sums(s) for s in lease.slots if s is not None] if op.checksums else [])

    def _end(self, op: p.Commit | p.Abort | p.Release, store: NamespaceStore,
             budget: _Budget) -> p.Result:
        """Commit, abort or release one of this client's ops, if the request's budget holds
        its slots (else it stays open: the client ends it in a later request)."""
        ref = OpId(op.op)
        if not budget.spend(store.index.op_size(ref)):
            return p.Done(False) if isinstance(op, p.Release) else p.Count(0)
        if isinstance(op, p.Release):
            return p.Done(store.release(ref, self.owner))
        if isinstance(op, p.Abort):
            return p.Count(store.abort(ref, self.owner))
        try:
            return p.Count(store.commit(ref, self.owner, op.checksums))
        except ValueError as exc:
            raise SessionClosed(CloseReason.MALFORMED, str(exc)) from None

    def _peer_fetch(self, op: p.PeerFetch, store: NamespaceStore) -> p.Result:
        if not self._host.fetches_from_peers:
            return p.Refused(RefusalReason.PEERS_OFF,
                             "this kvcr runner fetches from no peers (peers / --peer)")
        client = self._host.peer_client(store, op.endpoint)
        if client is None:
            return p.Refused(RefusalReason.PEER_NOT_ALLOWED,
                             f"{op.endpoint} is not a peer of this kvcr runner (peers / --peer)")
        if len(self._tickets) >= self._host.limits.tickets:
            return p.Refused(RefusalReason.BUSY,
                             f"{len(self._tickets)} fetches of this client are in flight")
        self._next_ticket += 1
        self._tickets[self._next_ticket] = client.fetch_async(
            op.endpoint, op.keys, op.deadline_ms / 1000)  # type: ignore[arg-type]
        return p.Ticket(self._next_ticket)

    def _hint_sources(self, op: p.HintSources, budget: _Budget) -> p.Sources:
        endpoints: list[str] = []
        index: list[int] = []
        asked = budget.cheap(op.hashes)
        for source in self._host.runner.hint_board.sources(asked):
            if source is None:
                index.append(-1)
                continue
            if source not in endpoints:
                endpoints.append(source)
            index.append(endpoints.index(source))
        return p.Sources(endpoints, index + [-1] * (len(op.hashes) - len(asked)))

    def _peer_poll(self, op: p.PeerPoll) -> p.Result:
        handle = self._tickets.get(op.ticket)
        if handle is None:
            return p.Refused(RefusalReason.UNKNOWN_TICKET, f"no fetch {op.ticket} of this client")
        result = handle.poll()
        if result is None:
            return p.FetchOutcome(False, [])
        del self._tickets[op.ticket]
        return p.FetchOutcome(True, list(result.statuses))

    def close(self) -> tuple[int, int]:
        """The client is gone: abort its writes, release its reads. READY blocks stay."""
        for handle in self._tickets.values():
            handle.cancel()  # ends by its deadline anyway; its slots are settled by the fetch
        self._tickets.clear()
        if self.store is None:
            return 0, 0
        aborted, released = self.store.drop_owner(self.owner)
        self._host.metrics.on_reclaim(aborted, released)
        self.store = None
        return aborted, released
