"""Test support for engine adapters without a socket or the machine's clock, around the real
`RunnerService` (so unit tests exercise the real operation code):

- `in_process(runner, specs, block_bytes, peers=...)`: a `RunnerService` for `specs` over an
  in-process `Runner` (real index, real pool memory), as an engine's embedded Runner hands its
  own process.
- `LoopbackPeers`: the service's peer half (`PeerAccess`) with other in-process Runners as the
  peers, named by endpoint (`sources`); an endpoint mapped to None is a peer that never
  answers, so only the caller's deadline ends its fetch; a fetch is answered at its
  `answer_after_polls`-th poll. `remote_run` (pull on miss) names the source holding the
  longest run, as a Runner following their inventories would (at least `pull_min_blocks`).
- `ObservedRunner`: any `RunnerOps`, with `calls` counted by operation and `down = True` making
  every call raise `RunnerUnavailable` (a lost Runner).
- `ManualClock`: time that moves only when the test says (`advance`).

Threading: as thread-safe as the service and stores under them; `ManualClock` is not meant to
be advanced from several threads at once.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

from kvcr_core.attach.ops import RunnerOps, RunnerUnavailable
from kvcr_core.attach.service import ClientLimits, RunnerService
from kvcr_core.attach.settings import PeerConfig
from kvcr_core.errors import UnknownNamespaceError
from kvcr_core.keys import NamespaceSpec
from kvcr_core.peers import FetchResult
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import BlockKey, FetchStatus, NamespaceDigest, OwnerId


class ManualClock:
    """A monotonic clock for tests: `clock()` is the time, `advance(s)` moves it."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class _LoopbackTask:
    """One namespace's part of a fetch from an in-process source."""

    def __init__(self, peers: LoopbackPeers, store: NamespaceStore, source: Runner | None,
                 keys: Sequence[BlockKey]) -> None:
        self._peers, self._store, self._source, self._keys = peers, store, source, keys
        self._polls = 0
        self._result: FetchResult | None = None

    def poll(self) -> FetchResult | None:
        if self._result is not None:
            return self._result
        self._polls += 1
        if self._source is None or self._polls < self._peers.answer_after_polls:
            return None
        statuses = _copy(self._store, self._source, self._keys)
        self._result = FetchResult(tuple(statuses), 0)
        return self._result

    def cancel(self) -> None:
        return None


def _copy(store: NamespaceStore, source: Runner, keys: Sequence[BlockKey]) -> list[FetchStatus]:
    """What a fetch of `keys` from `source` does: present here, fetched, or missing."""
    try:
        there = source.namespace(store.digest)
    except UnknownNamespaceError:
        return [FetchStatus.MISSING] * len(keys)
    statuses = []
    for key in keys:
        if store.contains([key])[0]:
            statuses.append(FetchStatus.PRESENT)
            continue
        blocks = there.load([key])
        if not blocks:
            statuses.append(FetchStatus.MISSING)
            continue
        store.store([key], blocks)
        statuses.append(FetchStatus.OK)
    return statuses


class _LoopbackFetcher:
    def __init__(self, peers: LoopbackPeers, store: NamespaceStore) -> None:
        self._peers, self._store = peers, store

    def fetch_async(self, endpoint: str, keys: Sequence[BlockKey],
                    deadline_s: float) -> _LoopbackTask:
        return _LoopbackTask(self._peers, self._store, self._peers.sources[endpoint], keys)


class LoopbackPeers:
    """`PeerAccess` over in-process Runners (see the module docstring)."""

    def __init__(self, sources: Mapping[str, Runner | None] | None = None, *,
                 answer_after_polls: int = 1,
                 pull_min_blocks: int = PeerConfig.pull_min_blocks) -> None:
        self.sources = dict(sources or {})
        self.answer_after_polls = answer_after_polls
        self.pull_min_blocks = pull_min_blocks

    @property
    def fetches_from_peers(self) -> bool:
        return bool(self.sources)

    def fetcher(self, store: NamespaceStore, endpoint: str) -> _LoopbackFetcher | None:
        return _LoopbackFetcher(self, store) if endpoint in self.sources else None

    def remote_run(self, namespace: NamespaceDigest,
                   keys: Sequence[BlockKey]) -> tuple[str, int] | None:
        best: tuple[str, int] | None = None
        for endpoint, source in self.sources.items():
            if source is None or namespace not in source.namespaces:
                continue
            held = source.namespace(namespace).lookup(keys)
            if held and (best is None or held > best[1]):
                best = (endpoint, held)
        return best if best is not None and best[1] >= self.pull_min_blocks else None


def in_process(runner: Runner, specs: NamespaceSpec | Sequence[NamespaceSpec],
               block_bytes: int, *, peers: LoopbackPeers | None = None,
               owner: int = 7, limits: ClientLimits | None = None) -> RunnerService:
    """A client of `runner` for `specs` (opened in order), called in-process."""
    specs = [specs] if isinstance(specs, NamespaceSpec) else list(specs)
    stores = [runner.open_namespace(spec, block_bytes) for spec in specs]
    return RunnerService(runner, stores, OwnerId(owner), peers or LoopbackPeers(), limits)


class ObservedRunner:
    """Forwards every `RunnerOps` call to `ops`, counting them by name; `down = True` makes
    every call raise RunnerUnavailable."""

    def __init__(self, ops: RunnerOps) -> None:
        self.ops = ops
        self.down = False
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.ops, name)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if self.down:
                raise RunnerUnavailable("disconnected", "the runner is down (ObservedRunner)")
            return target(*args, **kwargs)

        return call
