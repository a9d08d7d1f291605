"""The peer fetch a vLLM request may make, and the state the scheduler keeps per request.

A request makes at most one fetch, by an explicit phase (`FetchPhase`): NONE (nothing tried
yet), HINTED or PULLING (a fetch runs: a hint's, or pull on miss's), DONE (the one fetch is
over, or none could start). A hint wins: a request with a hint never pulls. `RequestFetches`
starts and polls fetches for the scheduler through core's `HintedFetcher` (one ticket and one
poll per step for every TP rank), counts outcomes in the connector's stats, and tells the
scheduler when a fetch made blocks READY.

- Hinted: the hinted run that extends kvcr's local prefix, from an allowed peer (`peers`); a
  source that is this engine's own endpoint (kvcr-guard's, shared by the node) is no fetch.
  Hinted hashes are matched per block under `hint_hash_scheme` (kvcr_vllm.request_hints);
  hashes that name no block of the request are counted and never fetched.
- Pull on miss: the run a followed peer holds right after kvcr's local prefix, asked of the
  Runner once per request.
- Right after a fetch starts, the scheduler may wait up to `fetch_wait_s` for it (a short fetch
  is then loaded in this step, and the Runner's fetching thread is not starved of the GIL).

Threading: vLLM's scheduler thread only.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvcr_core.attach import (
    FetchSummary,
    HintedFetch,
    HintedFetcher,
    HintedRun,
    RunnerError,
    RunnerOps,
    Skipped,
    hinted_run,
)
from kvcr_core.hints import FetchAction, KVHint
from kvcr_core.types import BlockKey, OpId
from kvcr_vllm.request_hints import block_hint_hashes
from kvcr_vllm.settings import ConnectorSettings
from kvcr_vllm.stats import StatsRecorder

if TYPE_CHECKING:
    from vllm.v1.request import Request


class FetchPhase(enum.Enum):
    NONE = "none"
    HINTED = "hinted"
    PULLING = "pulling"
    DONE = "done"


@dataclasses.dataclass
class RequestState:
    """What the scheduler side keeps of one request."""

    request: Request
    bypass: str | None
    context: tuple[tuple[str, str], ...] = ()  # the root of its key chains (context_root)
    hint: KVHint | None = None
    keys: list[list[BlockKey]] = dataclasses.field(default_factory=list)  # per rank
    keyed_blocks: int = 0
    local_tokens: int = 0  # vLLM's block-aligned local hit at the last lookup
    loading_ops: list[OpId] | None = None  # leases per rank while a load runs
    loaded_tokens: int = 0
    phase: FetchPhase = FetchPhase.NONE
    fetch: HintedFetch | None = None  # while HINTED or PULLING
    fetched_through: int = 0  # a fetch just made blocks [0, this) READY on every rank
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)  # vLLM's, per group
    planned_blocks: int = 0  # blocks [0, planned) are saved, planned, or came from kvcr
    finished: bool = False

    @property
    def wants_fetch(self) -> bool:
        """A fetch runs, or a hint is still to act on."""
        return self.phase in (FetchPhase.HINTED, FetchPhase.PULLING) or (
            self.phase is FetchPhase.NONE and self.hint is not None)


class RequestFetches:
    def __init__(self, settings: ConnectorSettings, runner: RunnerOps, stats: StatsRecorder,
                 block_bytes: int, ranks: int, clock: Callable[[], float],
                 sleep: Callable[[float], None],
                 on_fetched: Callable[[RequestState, FetchSummary], None]) -> None:
        self.settings = settings
        self.runner = runner
        self.stats = stats
        self.block_bytes = block_bytes
        self.ranks = ranks
        self.fetcher = HintedFetcher(runner, settings.peer.peers,
                                     settings.peer.fetch_deadline_s, clock=clock)
        self._sleep = sleep
        self._on_fetched = on_fetched

    def pending(self, state: RequestState, all_keys: Callable[[], list[list[BlockKey]]]
                ) -> bool:
        """Starts the hinted fetch (first call) or polls the one running; True while it
        runs (vLLM asks again next step)."""
        if state.fetch is None:
            fetch = self._start_hinted(state, all_keys)
            if fetch is None:
                state.phase = FetchPhase.DONE
                return False
            state.fetch, state.phase = fetch, FetchPhase.HINTED
            return self.waited(state)
        summary = state.fetch.poll()
        if summary is None:
            return True
        self._ended(state, summary)
        return False

    def waited(self, state: RequestState) -> bool:
        """Right after a fetch started: waits up to `fetch_wait_s` for it; True if it still
        runs."""
        assert state.fetch is not None
        if self.settings.fetch_wait_s <= 0:
            return True
        summary = state.fetch.wait_for(self.settings.fetch_wait_s, self._sleep)
        if summary is None:
            self.stats.add("fetch_wait_expired")
            return True
        self._ended(state, summary)
        return False

    def _ended(self, state: RequestState, summary: FetchSummary) -> None:
        pulling = state.phase is FetchPhase.PULLING
        state.fetch, state.phase = None, FetchPhase.DONE
        # the run extended the local prefix: with nothing failed, READY through its end
        state.fetched_through = summary.run.end if not summary.failed else 0
        if summary.fetched:
            self._on_fetched(state, summary)
        if pulling:
            self.stats.add("pulled_blocks", summary.fetched)
            self.stats.add("pulled_bytes", summary.fetched * self.block_bytes * self.ranks)
        else:
            self.stats.add("peer_fetched_blocks", summary.fetched)
        if summary.failed:
            self.stats.failure("peer_fetch", summary.failed)

    def may_pull(self, state: RequestState) -> bool:
        return (self.settings.peer.pull_on_miss and bool(self.fetcher.peers)
                and state.hint is None and state.phase is FetchPhase.NONE)

    def start_pull(self, state: RequestState, keys: list[list[BlockKey]], have: int) -> bool:
        """Asks the Runner which peer holds the longest run after `have` blocks (once per
        request) and starts fetching it; False if no run worth it (nothing to wait for)."""
        state.phase = FetchPhase.DONE
        try:
            found = self.runner.remote_run(keys[0][have:])
        except RunnerError:
            self.stats.failure("guard_unavailable")
            return False
        if found is None:
            return False
        endpoint, n = found
        started = self.fetcher.start(keys, HintedRun(endpoint, have, have + n))
        if isinstance(started, Skipped):
            self._skipped(started)
            return False
        self.stats.add("pull_lookups")
        state.fetch, state.phase = started, FetchPhase.PULLING
        return True

    def _start_hinted(self, state: RequestState, all_keys: Callable[[], list[list[BlockKey]]]
                      ) -> HintedFetch | None:
        assert state.hint is not None
        own = self.settings.advertised_endpoint
        fetches = [f for f in state.hint.fetches if f.source_endpoint != own]
        allowed = [f for f in fetches if f.source_endpoint in self.fetcher.peers]
        if not allowed:
            if fetches:
                self.stats.failure("peer_not_allowed")
            return None
        keys = all_keys()
        hashes = block_hint_hashes(self.settings.hint_hashes, state.request, keys[0])
        unmatched = len(allowed[0].block_hashes.difference(hashes))
        if unmatched:
            self.stats.add("hint_unmatched_blocks", unmatched)  # named no block of this request
        try:
            have = self.fetcher.local_prefix(keys)  # (also opens the namespaces on first use)
        except RunnerError:
            self.stats.failure("guard_unavailable")
            return None
        started = self.fetcher.start(keys, hinted_run(have, _sources(allowed[0], hashes[have:])))
        if isinstance(started, Skipped):
            self._skipped(started)
            return None
        return started

    def _skipped(self, skipped: Skipped) -> None:
        if skipped is Skipped.NOT_ALLOWED:
            self.stats.failure("peer_not_allowed")
        elif skipped is Skipped.UNAVAILABLE:
            self.stats.failure("guard_unavailable")


def _sources(action: FetchAction, hashes: Sequence[int | None]) -> list[str | None]:
    """The hinted source of each block (by its hint hash), up to the first one the hint
    leaves out."""
    hinted = action.block_hashes
    sources: list[str | None] = []
    for block_hash in hashes:
        if block_hash is None or block_hash not in hinted:
            break
        sources.append(action.source_endpoint)
    return sources
