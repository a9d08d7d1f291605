"""Doubles for testing engine adapters without a socket or a clock of the machine's:

- `ManualClock`: time that moves only when the test says (`advance`).
- `FakeAttachClient`: the `AttachClient` surface the adapters use, straight on a namespace
  store of an in-process `Runner` (real index, real pool memory). Peer fetches copy blocks
  from other in-process Runners named by endpoint (`sources`); an endpoint mapped to None is a
  peer that never answers, so only the caller's deadline ends its fetch. `remote_run` (pull
  on miss) names the source holding the longest run, as a Runner following their inventories
  would (at least `pull_min_blocks`). `down = True` makes
  every call raise `RunnerUnavailable` (a lost Runner). `calls` counts operations by name.

Threading: a `FakeAttachClient` is as thread-safe as the store under it; `ManualClock` is not
meant to be advanced from several threads at once.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

from kvcr_core.attach import protocol as p
from kvcr_core.attach.client import RunnerUnavailable
from kvcr_core.attach.settings import PeerConfig
from kvcr_core.errors import UnknownNamespaceError
from kvcr_core.index import NO_OP, Lease, Reservation
from kvcr_core.keys import NamespaceSpec
from kvcr_core.memory import SlotPool
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import BlockKey, FetchStatus, OpId, OwnerId


class ManualClock:
    """A monotonic clock for tests: `clock()` is the time, `advance(s)` moves it."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class _Pending:
    def __init__(self, value: Reservation | Lease) -> None:
        self._value = value

    def result(self) -> Reservation | Lease:
        return self._value


class FakeAttachClient:
    """One namespace of `runner`, as an attached engine sees it (see the module docstring).
    A fetch is answered at its `answer_after_polls`-th poll."""

    def __init__(self, runner: Runner, spec: NamespaceSpec, block_bytes: int, *,
                 sources: Mapping[str, Runner | None] | None = None,
                 answer_after_polls: int = 1, identity: str = "fake") -> None:
        self.runner = runner
        self.namespace = spec
        self.block_bytes = block_bytes
        self.identity = identity
        self.sources = dict(sources or {})
        self.answer_after_polls = answer_after_polls
        self.pull_min_blocks = PeerConfig.pull_min_blocks
        self.down = False
        self.attach_count = 1
        self.calls: collections.Counter[str] = collections.Counter()
        self.store: NamespaceStore = runner.open_namespace(spec, block_bytes)
        self._owner = OwnerId(7)
        self._fetches: dict[int, list[object]] = {}  # ticket -> [endpoint, keys, polls]
        self._posted: dict[int, str] = {}  # router hash -> hinted source (`post_hint`)

    def _call(self, name: str) -> NamespaceStore:
        self.calls[name] += 1
        if self.down:
            raise RunnerUnavailable("disconnected", "the fake runner is down")
        return self.store

    @property
    def pool(self) -> SlotPool:
        return self._call("pool").pool

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        return self._call("lookup").lookup(keys)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self._call("contains").contains(keys)

    def reserve(self, keys: Sequence[BlockKey]) -> Reservation:
        return self._call("reserve").reserve(keys, self._owner)

    def reserve_async(self, keys: Sequence[BlockKey]) -> _Pending:
        return _Pending(self.reserve(keys))

    def commit(self, op: OpId, *, checksums: Sequence[int] | None = None) -> int:
        """As AttachClient.commit (`checksums` None: hashed from the pool now)."""
        return 0 if op == NO_OP else self._call("commit").commit(op, self._owner, checksums)

    def commit_nowait(self, op: OpId, *, checksums: Sequence[int] | None = None) -> None:
        self.commit(op, checksums=checksums)

    def abort(self, op: OpId) -> int:
        return 0 if op == NO_OP else self._call("abort").abort(op, self._owner)

    def acquire(self, keys: Sequence[BlockKey], *, prefix_only: bool = True,
                checksums: bool = False) -> Lease:
        store = self._call("acquire")
        lease = store.acquire(keys, self._owner, prefix_only=prefix_only)
        if not checksums:
            return lease
        return dataclasses.replace(lease, checksums=tuple(
            store.checksums.of(s) for s in lease.slots if s is not None))

    def acquire_async(self, keys: Sequence[BlockKey], *, prefix_only: bool = True,
                      checksums: bool = False) -> _Pending:
        return _Pending(self.acquire(keys, prefix_only=prefix_only, checksums=checksums))

    def release(self, op: OpId) -> bool:
        return False if op == NO_OP else self._call("release").release(op, self._owner)

    def release_nowait(self, op: OpId) -> None:
        self.release(op)

    def clear(self) -> int:
        return self._call("clear").clear()

    def post_hint(self, envelope: str) -> int:
        self._call("post_hint")
        return self.runner.post_hint(envelope)

    def hint_sources(self, hashes: Sequence[int]) -> list[str | None]:
        self._call("hint_sources")
        return self.runner.hint_board.sources(hashes)

    def remote_run(self, keys: Sequence[BlockKey]) -> tuple[str, int] | None:
        self._call("remote_run")
        best: tuple[str, int] | None = None
        for endpoint, source in self.sources.items():
            if source is None:
                continue
            held = source.open_namespace(self.namespace, self.block_bytes).lookup(keys)
            if held and (best is None or held > best[1]):
                best = (endpoint, held)
        return best if best is not None and best[1] >= self.pull_min_blocks else None

    def peer_fetch(self, endpoint: str, keys: Sequence[BlockKey], deadline_s: float) -> int:
        self._call("peer_fetch")
        if endpoint not in self.sources:
            raise RunnerUnavailable(p.RefusalReason.PEER_NOT_ALLOWED,
                                    f"{endpoint} is not a peer of this runner")
        ticket = len(self._fetches) + 1
        self._fetches[ticket] = [endpoint, list(keys), 0]
        return ticket

    def peer_poll(self, ticket: int) -> p.FetchOutcome:
        self._call("peer_poll")
        endpoint, keys, polls = self._fetches[ticket]
        assert isinstance(endpoint, str) and isinstance(keys, list) and isinstance(polls, int)
        self._fetches[ticket][2] = polls + 1
        source = self.sources[endpoint]
        if source is None or polls + 1 < self.answer_after_polls:
            return p.FetchOutcome(False, [])
        return p.FetchOutcome(True, self._copy_from(source, keys))

    def _copy_from(self, source: Runner, keys: list[BlockKey]) -> list[FetchStatus]:
        """What a fetch of `keys` from `source` does: present here, fetched, or missing."""
        try:
            there = source.namespace(self.store.digest)
        except UnknownNamespaceError:
            return [FetchStatus.MISSING] * len(keys)
        statuses = []
        for key in keys:
            if self.store.contains([key])[0]:
                statuses.append(FetchStatus.PRESENT)
                continue
            blocks = there.load([key])
            if not blocks:
                statuses.append(FetchStatus.MISSING)
                continue
            self.store.store([key], blocks)
            statuses.append(FetchStatus.OK)
        return statuses

    def close(self) -> None:
        self.calls["close"] += 1
