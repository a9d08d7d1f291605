"""`RunnerService`: the one implementation of `RunnerOps`, for one client (an owner id and the
namespaces it opened) over a `Runner`.

Every reservation and lease is tagged with the owner, so `close` aborts what the client was
writing and releases what it was reading, never publishing a half-written block; operations
name only ops the owner holds, or do nothing. Each client is bounded (`ClientLimits`): slots
it holds FILLING or leased per namespace, open ops, fetches in flight. When served over the
attach socket each request is bounded too (`RequestBudget`, set by the codec around each
request), so no client holds the server's loop for long: keys reserved or leased and slots
committed, aborted or released, all its ops together, at most `MAX_HEAVY_KEYS_PER_REQUEST`
(the rest refused, counted); keys named by cheap ops at most `MAX_KEYS_PER_REQUEST`; hints at
most `MAX_ATTACH_HINT_BYTES`. Called in-process (an engine's own embedded Runner) nothing is
budgeted: the caller's own thread does the work.

Peers come through `PeerAccess` (kvcr_core.attach.peering; kvcr_core.testing's loopback in
unit tests): a fetch covers every namespace named, under one ticket.

Threading: one thread at a time per service (the server's loop, or the engine thread that
owns an in-process service); the stores and the Runner are thread-safe underneath.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

from kvcr_core.attach import protocol as p
from kvcr_core.attach.ops import RunnerOps, RunnerRefused
from kvcr_core.attach.peering import FetchTask, PeerAccess
from kvcr_core.attach.protocol import RefusalReason
from kvcr_core.index import NO_OP, Lease, Reservation
from kvcr_core.memory import SlotPool
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import BlockKey, NamespaceDigest, OpId, OwnerId

T = TypeVar("T")
_UNBOUNDED = 1 << 62
_REMOVED_BATCHES = 16  # inventory batches read per `removed_since`
_REMOVED_HASHES = 8192  # hashes answered per `removed_since` (more: the next call)


@dataclasses.dataclass(frozen=True)
class ClientLimits:
    """What one client may hold at once."""

    held_fraction: float = 0.5  # of each namespace's slots, FILLING or leased
    ops: int = 1024  # open reservations and leases, per namespace
    tickets: int = 64  # peer fetches in flight


class RequestBudget:
    """What one request may still make the server do (see the module docstring)."""

    __slots__ = ("_cheap", "_heavy", "_hint", "in_process", "refused")

    def __init__(self, heavy: int = p.MAX_HEAVY_KEYS_PER_REQUEST,
                 cheap: int = p.MAX_KEYS_PER_REQUEST, hint: int = p.MAX_ATTACH_HINT_BYTES
                 ) -> None:
        self._heavy, self._cheap, self._hint = heavy, cheap, hint
        self.in_process = heavy >= _UNBOUNDED  # nothing to count
        self.refused = 0  # keys, slots or hints refused for the budget

    @classmethod
    def unbounded(cls) -> RequestBudget:
        return cls(_UNBOUNDED, _UNBOUNDED, _UNBOUNDED)

    def heavy(self, keys: Sequence[T]) -> Sequence[T]:
        """The leading keys the budget still covers for a reserve or a lease."""
        if len(keys) <= self._heavy:  # the usual case: no copy of the keys
            self._heavy -= len(keys)
            return keys
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

    def cheap(self, keys: Sequence[T]) -> Sequence[T]:
        if len(keys) <= self._cheap:
            self._cheap -= len(keys)
            return keys
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


class Ready(Generic[T]):
    """A handle whose answer is already there (in-process calls)."""

    __slots__ = ("_value",)

    def __init__(self, value: T) -> None:
        self._value = value

    def result(self) -> T:
        return self._value


@dataclasses.dataclass(frozen=True)
class Grant:
    """What a client may do in one namespace beyond reading and writing blocks: `may_clear`
    (false where other uids share it); `siblings`: the owners of this client's uid attached
    to it, when other uids share it (its uid's clients together hold at most the client
    limit, so a second connection does not double a uid's share); `shared`: processes of
    other uids map it too (engines with `verify_loads: auto` check their loads)."""

    may_clear: bool = True
    siblings: Callable[[], Sequence[OwnerId]] | None = None
    shared: bool = False


class RunnerService:
    """`RunnerOps` for `owner` over `stores` (its namespaces, in order) of `runner`."""

    def __init__(self, runner: Runner, stores: Sequence[NamespaceStore], owner: OwnerId,
                 peers: PeerAccess, limits: ClientLimits | None = None, *,
                 grants: Sequence[Grant] | None = None, poster: str = "",
                 on_close: Callable[[RunnerService], object] | None = None) -> None:
        """`poster`: whose hints this client posts (its uid: a share of the hint board)."""
        self.runner = runner
        self.stores = list(stores)
        self.owner = owner
        self.peers = peers
        self.limits = limits or ClientLimits()
        self.grants = list(grants) if grants is not None else [Grant()] * len(self.stores)
        self.poster = poster
        self._held = [max(1, int(s.index.capacity_slots * self.limits.held_fraction))
                      for s in self.stores]
        self._budget = RequestBudget.unbounded()
        self._tickets: dict[int, list[FetchTask]] = {}
        self._next_ticket = 0
        self._on_close = on_close
        self.closed = False

    # -- request framing (the attach codec's) ------------------------------------------------

    def begin_request(self) -> None:
        self._budget = RequestBudget()

    def end_request(self) -> int:
        """Ends the request's budget; returns what it refused."""
        refused, self._budget = self._budget.refused, RequestBudget.unbounded()
        return refused

    # -- RunnerOps ---------------------------------------------------------------------------

    @property
    def namespace_count(self) -> int:
        return len(self.stores)

    @property
    def attach_count(self) -> int:
        return 1  # an in-process service never re-attaches

    @property
    def shared(self) -> bool:
        return any(grant.shared for grant in self.grants)

    def _store(self, ns: int) -> NamespaceStore:
        if not 0 <= ns < len(self.stores):
            raise ValueError(f"namespace index {ns}: this client opened {len(self.stores)}")
        return self.stores[ns]

    def _sets(self, keys: Sequence[Sequence[BlockKey]]) -> list[NamespaceStore]:
        if not 1 <= len(keys) <= len(self.stores):
            raise ValueError(f"keys for {len(keys)} namespaces: this client opened "
                             f"{len(self.stores)}")
        return self.stores[:len(keys)]

    def pool(self, ns: int = 0) -> SlotPool:
        return self._store(ns).pool

    def lookup(self, keys: Sequence[BlockKey], ns: int = 0) -> int:
        return self._store(ns).lookup(self._budget.cheap(keys))

    def lookup_all(self, keys: Sequence[Sequence[BlockKey]]) -> int:
        stores = self._sets(keys)
        found = min(len(k) for k in keys)
        for store, part in zip(stores, keys, strict=True):
            if found:
                found = min(found, store.lookup(self._budget.cheap(part[:found])))
        return found

    def contains(self, keys: Sequence[BlockKey], ns: int = 0) -> list[bool]:
        flags = self._store(ns).contains(self._budget.cheap(keys))
        return flags + [False] * (len(keys) - len(flags))

    def reserve(self, keys: Sequence[BlockKey], ns: int = 0) -> Reservation:
        store = self._store(ns)
        asked = self._budget.heavy(keys)
        refused = len(keys) - len(asked)
        if store.index.owner_ops(self.owner) >= self.limits.ops:
            return Reservation(NO_OP, (None,) * len(keys), 0, len(keys))
        res = store.reserve(asked, self.owner, limit=self._limit(ns, store))
        if not refused:
            return res
        return Reservation(res.op, res.slots + (None,) * refused, res.granted,
                           res.refused + refused)

    def reserve_async(self, keys: Sequence[BlockKey], ns: int = 0) -> Ready[Reservation]:
        return Ready(self.reserve(keys, ns))

    def _fits(self, store: NamespaceStore, op: OpId) -> bool:
        """Whether ending `op` fits this request's budget (always, in-process)."""
        if op == NO_OP:
            return False
        return self._budget.in_process or self._budget.spend(store.op_size(op))

    def commit(self, op: OpId, checksums: Sequence[int], ns: int = 0) -> int:
        """Raises ValueError, changing nothing, for a wrong count of checksums."""
        store = self._store(ns)
        if not self._fits(store, op):
            return 0
        return store.commit(op, self.owner, checksums)

    def commit_nowait(self, op: OpId, checksums: Sequence[int], ns: int = 0) -> None:
        self.commit(op, checksums, ns)

    def abort(self, op: OpId, ns: int = 0) -> int:
        store = self._store(ns)
        if not self._fits(store, op):
            return 0
        return store.abort(op, self.owner)

    def acquire(self, keys: Sequence[BlockKey], ns: int = 0, *, prefix_only: bool = True,
                checksums: bool = False) -> Lease:
        store = self._store(ns)
        asked = self._budget.heavy(keys)
        refused = len(keys) - len(asked)
        if store.index.owner_ops(self.owner) >= self.limits.ops:
            return Lease(NO_OP, (None,) * len(keys), 0)
        lease = store.acquire(asked, self.owner, prefix_only=prefix_only,
                              limit=self._limit(ns, store))
        sums = tuple(store.checksums.of(s) for s in lease.slots if s is not None) \
            if checksums else ()
        return Lease(lease.op, lease.slots + (None,) * refused, lease.granted, sums)

    def acquire_async(self, keys: Sequence[BlockKey], ns: int = 0, *, prefix_only: bool = True,
                      checksums: bool = False) -> Ready[Lease]:
        return Ready(self.acquire(keys, ns, prefix_only=prefix_only, checksums=checksums))

    def acquire_all(self, keys: Sequence[Sequence[BlockKey]], *,
                    checksums: bool = False) -> list[Lease]:
        self._sets(keys)
        return [self.acquire(part, ns, checksums=checksums) for ns, part in enumerate(keys)]

    def release(self, op: OpId, ns: int = 0) -> bool:
        store = self._store(ns)
        if not self._fits(store, op):
            return False
        return store.release(op, self.owner)

    def release_nowait(self, op: OpId, ns: int = 0) -> None:
        self.release(op, ns)

    def _limit(self, ns: int, store: NamespaceStore) -> int:
        """The slots this client may hold in `ns`: its share, less what its uid's other
        clients hold there where other uids share the namespace."""
        siblings = self.grants[ns].siblings
        if siblings is None:
            return self._held[ns]
        others = sum(store.index.held(o) for o in siblings() if o != self.owner)
        return max(0, self._held[ns] - others)

    def clear(self, ns: int = 0) -> int:
        store = self._store(ns)
        if not self.grants[ns].may_clear:
            raise RunnerRefused(RefusalReason.NOT_ALLOWED,
                                f"namespace {store.digest.hex()} is shared with other uids "
                                "(kvcr-guard --tenant): only its Runner's uid may clear it")
        return store.clear()

    def stats(self, ns: int = 0) -> p.PoolStats:
        idx = self._store(ns).index
        return p.PoolStats(idx.capacity_slots, idx.ready_blocks, idx.filling_blocks,
                           idx.free_slots, idx.leased_slots, idx.open_reservations,
                           idx.open_leases, idx.evictions)

    def removed_since(self, since: int) -> p.Removed:
        log = self.runner.inventory
        if since < 0:
            return p.Removed(log.epoch, log.last_seq, False, [[] for _ in self.stores])
        reset, batches = log.read(since, max_batches=_REMOVED_BATCHES)
        where = {store.digest: ns for ns, store in enumerate(self.stores)}
        hashes: list[list[int]] = [[] for _ in self.stores]
        seq, total = since, 0
        for batch in batches:
            if total and total + len(batch.removed) > _REMOVED_HASHES:
                break  # the rest in the next call
            ns = where.get(NamespaceDigest(batch.namespace))
            if ns is not None:
                hashes[ns] += batch.removed
                total += len(batch.removed)
            seq = batch.seq
        return p.Removed(log.epoch, seq if batches else max(since, log.last_seq), reset, hashes)

    def post_hint(self, envelope: str) -> int:
        if not self._budget.hint(len(envelope)):
            self.runner.metrics.hint_outcome("too_large")
            return 0
        return self.runner.post_hint(envelope, self.poster)

    def hint_sources(self, hashes: Sequence[int]) -> list[str | None]:
        asked = self._budget.cheap(hashes)
        return self.runner.hint_board.sources(asked) + [None] * (len(hashes) - len(asked))

    def remote_run(self, keys: Sequence[BlockKey], ns: int = 0) -> tuple[str, int] | None:
        store = self._store(ns)
        return self.peers.remote_run(store.digest, self._budget.cheap(keys))

    def peer_fetch(self, endpoint: str, keys: Sequence[Sequence[BlockKey]],
                   deadline_s: float) -> int:
        stores = self._sets(keys)
        if not self.peers.fetches_from_peers:
            raise RunnerRefused(RefusalReason.PEERS_OFF,
                                "this kvcr runner fetches from no peers (peers / --peer)")
        fetchers = [self.peers.fetcher(store, endpoint) for store in stores]
        if any(f is None for f in fetchers):
            raise RunnerRefused(RefusalReason.PEER_NOT_ALLOWED,
                                f"{endpoint} is not a peer of this kvcr runner (peers / --peer)")
        if len(self._tickets) >= self.limits.tickets:
            raise RunnerRefused(RefusalReason.BUSY,
                                f"{len(self._tickets)} fetches of this client are in flight")
        self._next_ticket += 1
        self._tickets[self._next_ticket] = [
            f.fetch_async(endpoint, part, deadline_s)
            for f, part in zip(fetchers, keys, strict=True) if f is not None]
        return self._next_ticket

    def peer_poll(self, ticket: int) -> p.FetchOutcome:
        tasks = self._tickets.get(ticket)
        if tasks is None:
            raise RunnerRefused(RefusalReason.UNKNOWN_TICKET, f"no fetch {ticket} of this client")
        results = [task.poll() for task in tasks]
        if any(r is None for r in results):
            return p.FetchOutcome(False, [])
        del self._tickets[ticket]
        return p.FetchOutcome(True, [list(r.statuses) for r in results if r is not None])

    def flush(self) -> None:
        return None  # every call took effect when it returned

    def close(self) -> None:
        """The client is gone (also what an in-process owner calls at shutdown)."""
        if self._on_close is not None:
            self._on_close(self)
        else:
            self.reclaim()

    def reclaim(self) -> tuple[int, int]:
        """Aborts the owner's writes and releases its reads (READY blocks stay); returns
        (blocks aborted, leases released). Idempotent."""
        if self.closed:
            return 0, 0
        self.closed = True
        for tasks in self._tickets.values():
            for task in tasks:
                task.cancel()  # ends by its deadline anyway; its slots are settled by the fetch
        self._tickets.clear()
        aborted = released = 0
        for store in self.stores:
            a, r = store.drop_owner(self.owner)
            aborted, released = aborted + a, released + r
        return aborted, released


if TYPE_CHECKING:  # mypy checks the service against the protocol it implements
    _IS_RUNNER_OPS: type[RunnerOps] = RunnerService
