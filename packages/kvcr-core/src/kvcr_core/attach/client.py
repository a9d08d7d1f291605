"""`AttachClient`: `RunnerOps` over the attach socket, for an engine process whose Runner lives
in another process (kvcr-guard, or the embedded Runner of another process of the engine).

Each method is a thin stub: it builds the operation's message (kvcr_core.attach.protocol),
sends it on the client's `RunnerConnection` and converts the result (a `Refused` raises
`RunnerRefused`). Operations larger than one request may carry (keys reserved or leased beyond
`MAX_HEAVY_KEYS_PER_REQUEST`, keys looked up beyond `MAX_KEYS_PER_REQUEST`) go as several
pipelined requests, answered as one (kvcr_core.attach.compound). `*_nowait` calls are never
waited for; `*_async` ones are answered when their handle's `result()` is asked.

Failure model: see `RunnerConnection` (every fault raises a `RunnerError`; the next call
re-attaches after a back-off). Threading: thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from kvcr_core.attach import protocol as p
from kvcr_core.attach.compound import CompoundOps, Gathered, Pending, chunks
from kvcr_core.attach.connection import Attachment, RunnerConnection
from kvcr_core.attach.ops import Handle, RunnerOps
from kvcr_core.attach.replies import as_count, as_lease, as_reservation, result
from kvcr_core.blockcopy import load_blocks, store_blocks
from kvcr_core.errors import HintRejected
from kvcr_core.hints import split_hint
from kvcr_core.index import NO_OP, Lease, Reservation
from kvcr_core.keys import NamespaceSpec
from kvcr_core.memory import SlotPool
from kvcr_core.types import BlockKey, OpId

T = TypeVar("T")
R = TypeVar("R", bound=p.Result)


class AttachClient:
    """`RunnerOps` for `namespaces` (one spec, or one per TP rank), through one connection."""

    def __init__(self, socket_path: str, namespaces: NamespaceSpec | Sequence[NamespaceSpec],
                 block_bytes: int, *, identity: str = "", timeout_s: float = 2.0,
                 map_pages: bool = False, runner_uids: frozenset[int] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        """`runner_uids`: the uids whose Runner this client accepts (default: its own)."""
        specs = [namespaces] if isinstance(namespaces, NamespaceSpec) else list(namespaces)
        extra = {} if clock is None else {"clock": clock}
        self.connection = RunnerConnection(socket_path, specs, block_bytes, identity=identity,
                                           timeout_s=timeout_s, map_pages=map_pages,
                                           runner_uids=runner_uids, **extra)
        self._compound = CompoundOps()

    # -- the connection ----------------------------------------------------------------------

    @property
    def identity(self) -> str:
        return self.connection.identity

    @property
    def socket_path(self) -> str:
        return self.connection.socket_path

    @property
    def attached(self) -> bool:
        return self.connection.attached

    @property
    def attachment(self) -> Attachment:
        return self.connection.attachment

    @property
    def attach_count(self) -> int:
        return self.connection.attach_count

    @property
    def namespace_count(self) -> int:
        return len(self.connection.namespaces)

    @property
    def shared(self) -> bool:
        return self.connection.shared

    def attach(self) -> Attachment:
        return self.connection.attach()

    def retarget(self, socket_path: str) -> None:
        self.connection.retarget(socket_path)

    def try_attach(self, handshake_timeout_s: float = 0.0) -> bool:
        return self.connection.try_attach(handshake_timeout_s)

    def pool(self, ns: int = 0) -> SlotPool:
        return self.connection.attachment.pools[ns]

    def batch(self, ops: Sequence[p.Op]) -> list[p.Result]:
        """Runs `ops` in one round trip; results in order (tests and tools)."""
        return self.connection.wait(self.connection.submit(ops))

    def _pending(self, op: p.Op, convert: Callable[[list[p.Result]], T]) -> Pending[T]:
        return Pending(self.connection.wait, self.connection.submit([op]), convert)

    def _one(self, op: p.Op, kind: type[R]) -> R:
        return result(self.batch([op]), kind)

    # -- RunnerOps ---------------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey], ns: int = 0) -> int:
        """One request per `MAX_KEYS_PER_OP` keys, only while every block so far is READY."""
        found = 0
        for part in chunks(keys, p.MAX_KEYS_PER_OP):
            n = self._one(p.Lookup(list(part), ns), p.Count).n
            found += n
            if n < len(part):
                break
        return found

    def lookup_all(self, keys: Sequence[Sequence[BlockKey]]) -> int:
        """Every namespace's keys in one request while they fit `MAX_KEYS_PER_REQUEST`
        together, else in parts, only while every block so far is READY."""
        step = max(1, p.MAX_KEYS_PER_REQUEST // max(1, len(keys)))
        common = min((len(k) for k in keys), default=0)  # blocks every namespace names
        found = 0
        for start in range(0, common, step):
            parts: list[list[bytes]] = [list(k[start:min(start + step, common)]) for k in keys]
            n = self._one(p.LookupAll(parts), p.Count).n
            found += n
            if n < len(parts[0]):
                break
        return found

    def contains(self, keys: Sequence[BlockKey], ns: int = 0) -> list[bool]:
        flags: list[bool] = []
        for part in chunks(keys, p.MAX_KEYS_PER_OP):
            flags += self._one(p.Contains(list(part), ns), p.Flags).values
        return flags

    def reserve(self, keys: Sequence[BlockKey], ns: int = 0) -> Reservation:
        return self.reserve_async(keys, ns).result()

    def reserve_async(self, keys: Sequence[BlockKey], ns: int = 0) -> Handle[Reservation]:
        parts = [self._pending(p.Reserve(list(c), ns), as_reservation) for c in chunks(keys)]
        if len(parts) == 1:
            return parts[0]
        return Gathered([part.result for part in parts], self._joined_reservation)

    def _joined_reservation(self, parts: list[Reservation]) -> Reservation:
        with self.connection.lock:
            return self._compound.reservation(parts)

    def commit(self, op: OpId, checksums: Sequence[int], ns: int = 0) -> int:
        sent = [self._pending(c, as_count) for c in self._commits(op, checksums, ns)]
        return sum(s.result() for s in sent)

    def commit_nowait(self, op: OpId, checksums: Sequence[int], ns: int = 0) -> None:
        for commit in self._commits(op, checksums, ns):
            self.connection.submit_nowait([commit])

    def _commits(self, op: OpId, checksums: Sequence[int], ns: int) -> list[p.Commit]:
        if op == NO_OP:
            return []
        with self.connection.lock:
            parts = self._compound.take(op)
        if len(parts) == 1:
            return [p.Commit(op, list(checksums), ns)]
        out, start = [], 0
        for part, granted in parts:
            out.append(p.Commit(part, list(checksums[start:start + granted]), ns))
            start += granted
        return out

    def abort(self, op: OpId, ns: int = 0) -> int:
        sent = [self._pending(p.Abort(part, ns), as_count) for part in self._parts(op)]
        return sum(s.result() for s in sent)

    def release(self, op: OpId, ns: int = 0) -> bool:
        sent = [self._pending(p.Release(part, ns), lambda r: result(r, p.Done).ok)
                for part in self._parts(op)]
        done = [s.result() for s in sent]
        return bool(done) and all(done)

    def release_nowait(self, op: OpId, ns: int = 0) -> None:
        for part in self._parts(op):
            self.connection.submit_nowait([p.Release(part, ns)])

    def _parts(self, op: OpId) -> list[OpId]:
        if op == NO_OP:
            return []
        with self.connection.lock:
            return [part for part, _ in self._compound.take(op)]

    def acquire(self, keys: Sequence[BlockKey], ns: int = 0, *, prefix_only: bool = True,
                checksums: bool = False) -> Lease:
        return self.acquire_async(keys, ns, prefix_only=prefix_only,
                                  checksums=checksums).result()

    def acquire_async(self, keys: Sequence[BlockKey], ns: int = 0, *, prefix_only: bool = True,
                      checksums: bool = False) -> Handle[Lease]:
        parts = [self._pending(p.Acquire(list(c), prefix_only, checksums, ns), as_lease)
                 for c in chunks(keys)]
        if len(parts) == 1:
            return parts[0]
        return Gathered([part.result for part in parts],
                        lambda leases: self._joined_lease(leases, ns, prefix_only))

    def acquire_all(self, keys: Sequence[Sequence[BlockKey]], *,
                    checksums: bool = False) -> list[Lease]:
        """One request for every namespace while the keys fit (`MAX_HEAVY_KEYS_PER_REQUEST`
        together), else pipelined parts of every namespace's keys, joined per namespace."""
        step = max(1, p.MAX_HEAVY_KEYS_PER_REQUEST // max(1, len(keys)))
        longest = max((len(k) for k in keys), default=0)
        sent = [self._pending(p.AcquireAll([list(k[s:s + step]) for k in keys], checksums),
                              lambda r: [as_lease([part]) for part in result(r, p.Leases).parts])
                for s in range(0, max(longest, 1), step)]
        parts = [s.result() for s in sent]
        if len(parts) == 1:
            return parts[0]
        return [self._joined_lease([part[ns] for part in parts], ns, True)
                for ns in range(len(keys))]

    def _joined_lease(self, parts: list[Lease], ns: int, prefix_only: bool) -> Lease:
        """One lease for the parts; with `prefix_only`, parts after one that stopped short
        are given back at once (a prefix ends at its first gap)."""
        kept: list[Lease] = []
        short = False
        for part in parts:
            if short:
                self.release_nowait(part.op, ns)
                kept.append(Lease(NO_OP, (None,) * len(part.slots), 0))
                continue
            kept.append(part)
            short = prefix_only and part.granted < len(part.slots)
        with self.connection.lock:
            return self._compound.lease(kept)

    def clear(self, ns: int = 0) -> int:
        return self._one(p.Clear(ns), p.Count).n

    def stats(self, ns: int = 0) -> p.PoolStats:
        return self._one(p.Stats(ns), p.PoolStats)

    def removed_since(self, since: int) -> p.Removed:
        return self._one(p.RemovedSince(since), p.Removed)

    def post_hint(self, envelope: str) -> int:
        """A large hint goes as several pipelined parts (`split_hint`), so no request is
        heavy for the runner; one too large that does not parse here: 0, not counted."""
        try:
            parts = split_hint(envelope, p.MAX_ATTACH_HINT_BYTES)
        except HintRejected:
            return 0
        sent = [self._pending(p.PostHint(e), as_count) for e in parts]
        return sum(s.result() for s in sent)

    def hint_sources(self, hashes: Sequence[int]) -> list[str | None]:
        sources: list[str | None] = []
        for part in chunks(hashes, p.MAX_KEYS_PER_OP):
            sources += self._one(p.HintSources(list(part)), p.Sources).each()
        return sources

    def remote_run(self, keys: Sequence[BlockKey], ns: int = 0) -> tuple[str, int] | None:
        run = self._one(p.RemoteRun(list(keys[:p.MAX_KEYS_PER_OP]), ns), p.Run)
        return (run.endpoint, run.n) if run.n > 0 else None

    def peer_fetch(self, endpoint: str, keys: Sequence[Sequence[BlockKey]],
                   deadline_s: float) -> int:
        fetch = p.PeerFetch(endpoint, [list(k) for k in keys], max(1, int(deadline_s * 1000)))
        return self._one(fetch, p.Ticket).id

    def peer_poll(self, ticket: int) -> p.FetchOutcome:
        return self._one(p.PeerPoll(ticket), p.FetchOutcome)

    def flush(self) -> None:
        """Waits for every reply still owed (one Stats round trip; nothing when detached)."""
        if self.connection.attached:
            self.batch([p.Stats()])

    def close(self) -> None:
        self.connection.close()

    # -- copy helpers ------------------------------------------------------------------------

    def store(self, keys: Sequence[BlockKey], blocks: Sequence[bytes | memoryview]) -> int:
        """reserve + copy + commit into namespace 0; returns blocks stored."""
        return store_blocks(self, self.pool(), keys, blocks)

    def load(self, keys: Sequence[BlockKey]) -> list[bytes]:
        """Bytes of namespace 0's longest READY prefix (acquire + copy + release)."""
        return load_blocks(self, self.pool(), keys)


if TYPE_CHECKING:  # mypy checks the stubs against the protocol they implement
    _IS_RUNNER_OPS: type[RunnerOps] = AttachClient
