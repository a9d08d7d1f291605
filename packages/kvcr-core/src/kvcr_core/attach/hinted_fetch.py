"""`HintedFetcher`: acting on a KV hint, for every engine adapter and every TP rank.

A hint says which peer holds which blocks. The fetcher takes the hinted run that extends the
local prefix (blocks `have`, `have + 1`, ... while each is hinted to the same source; never
across a hole), checks the source is a configured peer (a hint can never make kvcr dial
anything else), and asks the Runner to fetch that run into every rank's namespace under one
fetch ticket (`RunnerOps.peer_fetch`): the Runner dials, whether it is embedded in the engine
or in kvcr-guard, so the same code serves both modes and every TP rank, in one round trip
per poll whatever the TP size. The ticket ends by the fetch deadline (plus a grace second for
the answer); a lost Runner ends it at once.

Used by the vLLM scheduler (hints carried by requests; it polls once per engine step and asks
vLLM to ask again meanwhile) and the SGLang page store (hints posted to the Runner's board;
SGLang's prefetch thread waits). Callers count outcomes with their own metrics.

Threading: a `HintedFetch` is polled by one thread at a time; the fetcher is stateless
beyond its settings.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Callable, Sequence

from kvcr_core.attach.ops import RunnerError, RunnerOps, RunnerRefused
from kvcr_core.attach.protocol import RefusalReason
from kvcr_core.types import BlockKey, FetchStatus

_ANSWER_GRACE_S = 1.0  # beyond the fetch deadline, for the Runner's last answer
_WAIT_POLL_S = 0.0005  # a poll is one round trip to the Runner


class Skipped(enum.Enum):
    """Why a hint led to no fetch (bounded: callers count it)."""

    NO_RUN = "no_run"  # nothing hinted right after the local prefix
    NOT_ALLOWED = "peer_not_allowed"  # the hinted source is not a configured peer
    UNAVAILABLE = "runner_unavailable"  # the Runner could not be asked


@dataclasses.dataclass(frozen=True)
class HintedRun:
    """Blocks [start, end) of a request, hinted to `source`."""

    source: str
    start: int
    end: int


def hinted_run(start: int, sources: Sequence[str | None]) -> HintedRun | None:
    """The run at `start`: `sources[i]` is the hinted source of block `start + i` (None: no
    hint). It extends while the source stays the same."""
    if not sources or sources[0] is None:
        return None
    end = 1
    while end < len(sources) and sources[end] == sources[0]:
        end += 1
    return HintedRun(sources[0], start, start + end)


@dataclasses.dataclass(frozen=True)
class FetchSummary:
    """How a hinted fetch ended. `statuses[rank][i]` is block `run.start + i` on that rank."""

    run: HintedRun
    statuses: tuple[tuple[FetchStatus, ...], ...]
    detail: str = ""

    @property
    def fetched(self) -> int:
        """Blocks fetched on every rank (a block is usable only if all its shards are)."""
        return min(sum(s is FetchStatus.OK for s in rank) for rank in self.statuses)

    @property
    def failed(self) -> int:
        """Blocks of the run that are still not READY here on some rank."""
        ready = (FetchStatus.OK, FetchStatus.PRESENT)
        return sum(not all(rank[i] in ready for rank in self.statuses)
                   for i in range(self.run.end - self.run.start))


class HintedFetch:
    """A hinted fetch in flight: `poll()` (non-blocking) or `wait()`."""

    def __init__(self, runner: RunnerOps, ticket: int, run: HintedRun, ranks: int,
                 give_up_at: float, clock: Callable[[], float]) -> None:
        self.run = run
        self._runner = runner
        self._ticket = ticket
        self._ranks = ranks
        self._give_up_at = give_up_at
        self._clock = clock

    def poll(self) -> FetchSummary | None:
        """The summary once the fetch ended on every rank; None while it still runs."""
        try:
            outcome = self._runner.peer_poll(self._ticket)
        except RunnerError as exc:
            return self._end(FetchStatus.UNREACHABLE, f"the runner was lost: {exc}")
        if outcome.done:
            return FetchSummary(self.run, tuple(tuple(s) for s in outcome.statuses))
        if self._clock() > self._give_up_at:
            return self._end(FetchStatus.TIMEOUT, "no answer by the deadline")
        return None

    def wait(self, sleep: Callable[[float], None] = time.sleep) -> FetchSummary:
        """Polls until the fetch ends (`poll` ends it by its deadline)."""
        summary = self.wait_for(math.inf, sleep)
        assert summary is not None  # no timeout: only the deadline ends the wait
        return summary

    def wait_for(self, timeout_s: float,
                 sleep: Callable[[float], None] = time.sleep) -> FetchSummary | None:
        """Polls until the fetch ends or `timeout_s` passed (then None: it still runs)."""
        stop = self._clock() + timeout_s
        while (summary := self.poll()) is None:
            if self._clock() >= stop:
                return None
            sleep(_WAIT_POLL_S)
        return summary

    def _end(self, status: FetchStatus, detail: str) -> FetchSummary:
        n = self.run.end - self.run.start
        return FetchSummary(self.run, ((status,) * n,) * self._ranks, detail)


class HintedFetcher:
    """Starts hinted fetches into every namespace of `runner` (one per TP rank, in rank
    order), from `peers` only, each bounded by `deadline_s`."""

    def __init__(self, runner: RunnerOps, peers: frozenset[str], deadline_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.peers = peers
        self.deadline_s = deadline_s
        self._clock = clock

    def local_prefix(self, keys_by_rank: Sequence[Sequence[BlockKey]]) -> int:
        """Blocks READY here on every rank (raises RunnerError)."""
        return self.runner.lookup_all(keys_by_rank)

    def start(self, keys_by_rank: Sequence[Sequence[BlockKey]],
              run: HintedRun | None) -> HintedFetch | Skipped:
        """Asks the Runner to fetch `run` of every rank's keys from its source (one ticket
        for all ranks)."""
        if run is None or run.end <= run.start:
            return Skipped.NO_RUN
        if run.source not in self.peers:
            return Skipped.NOT_ALLOWED
        try:
            ticket = self.runner.peer_fetch(
                run.source, [keys[run.start:run.end] for keys in keys_by_rank], self.deadline_s)
        except RunnerRefused as exc:
            if exc.refusal is RefusalReason.PEER_NOT_ALLOWED:
                return Skipped.NOT_ALLOWED
            return Skipped.UNAVAILABLE
        except RunnerError:
            return Skipped.UNAVAILABLE
        return HintedFetch(self.runner, ticket, run, len(keys_by_rank),
                           self._clock() + self.deadline_s + _ANSWER_GRACE_S, self._clock)
