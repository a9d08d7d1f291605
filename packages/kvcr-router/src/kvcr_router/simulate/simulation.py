"""The event loop: replays requests against a modelled fleet, routed by the real router code.

Routing goes through `kvcr_router.cost.choose` over a real `BlockIndexer` that is fed only by
the inventory batches the modelled workers emit (a prefill's stored blocks and evictions, per
worker and tier, in sequence), with `WorkerLoad` from each worker's admitted, unfinished
requests. What the bench measures is therefore the code a deployment runs.

Policies (`Policy`):
- round-robin: ignores the cache;
- overlap: the reference router's defaults (device 1.0, host 0.75, no fetch credit,
  temperature 0); nothing is fetched (the worker reuses only what it holds);
- overlap-hint: the same choice, then the worker fetches what the hint names (the reference
  before it credited fetchable blocks during selection);
- kvcr: fetch credit in the choice (the weights given), and the worker fetches per the hint.

Time is simulated (ms), so a run is deterministic for its inputs; events at the same instant
run completions first, then in the order they were scheduled. Single-threaded.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import random
from collections.abc import Sequence

from kvcr_router.cost import CostWeights, choose
from kvcr_router.indexer import BlockIndexer, Tier
from kvcr_router.simulate.fleet import Coverage, FleetConfig, Job, SimWorker
from kvcr_router.simulate.workload import SimRequest


class Policy(enum.Enum):
    ROUND_ROBIN = "round-robin"
    OVERLAP = "overlap"
    OVERLAP_HINT = "overlap-hint"
    KVCR = "kvcr"


# The reference router's documented defaults (NVIDIA Dynamo's KV router): overlap credit 1.0,
# host 0.75, prefill scale 1, potential decode blocks at weight 1, no active-request weight,
# temperature 0. Its disk credit (0.25) has no tier here: the model has no disk tier.
REFERENCE_WEIGHTS = CostWeights(device_w=1.0, pool_w=0.75, fetch_w=0.0, prefill_scale=1.0,
                                decode_w=1.0, active_w=0.0, temperature=0.0)

_PREFILL_DONE, _DECODE_DONE = 0, 1


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One request's fate."""

    worker: str
    ttft_ms: float
    queue_ms: float
    service_ms: float  # how long it held its worker's prefill lane
    prompt_blocks: int
    coverage: Coverage


@dataclasses.dataclass(frozen=True)
class RunResult:
    policy: Policy
    outcomes: tuple[Outcome, ...]
    requests_by_worker: dict[str, int]
    busy_ms_by_worker: dict[str, float]
    end_ms: float


class Simulation:
    def __init__(self, fleet: FleetConfig, policy: Policy,
                 weights: CostWeights | None = None, seed: int = 0) -> None:
        """`weights` (default: the router's defaults) drive the kvcr policy; overlap and
        overlap-hint always use the reference's."""
        self.fleet = fleet
        self.policy = policy
        self.weights = REFERENCE_WEIGHTS if policy in (Policy.OVERLAP, Policy.OVERLAP_HINT) else (
            weights or CostWeights())
        self.indexer = BlockIndexer()
        self.workers = {name: SimWorker(name, fleet) for name in fleet.names()}
        self._names = list(self.workers)
        self._rng = random.Random(seed)
        self._next_rr = 0
        self._seq: dict[tuple[str, Tier], int] = {}
        self._events: list[tuple[float, int, int, str, Job]] = []
        self._scheduled = 0
        self._outcomes: dict[int, Outcome] = {}
        self.now_ms = 0.0

    def run(self, requests: Sequence[SimRequest]) -> RunResult:
        """Replays `requests` (in arrival order) to the end of the last decode."""
        for index, request in enumerate(requests):
            self._advance(request.arrival_ms)
            self.now_ms = max(self.now_ms, request.arrival_ms)
            self._arrive(index, request)
        self._advance(float("inf"))
        return RunResult(
            self.policy, tuple(self._outcomes[i] for i in range(len(requests))),
            {n: w.requests for n, w in self.workers.items()},
            {n: w.busy_ms for n, w in self.workers.items()}, self.now_ms)

    def _advance(self, until_ms: float) -> None:
        events = self._events
        while events and events[0][0] <= until_ms:
            self.now_ms, kind, _, name, job = heapq.heappop(events)
            worker = self.workers[name]
            if kind == _PREFILL_DONE:
                self._prefill_done(worker, job)
            else:
                worker.decoding -= 1
                worker.finish(job)

    def _schedule(self, at_ms: float, kind: int, worker: SimWorker, job: Job) -> None:
        self._scheduled += 1
        heapq.heappush(self._events, (at_ms, kind, self._scheduled, worker.name, job))

    def _arrive(self, index: int, request: SimRequest) -> None:
        job = Job(index, request.arrival_ms, request.hashes, request.input_tokens,
                  request.output_tokens)
        worker = self._route(job)
        worker.admit(job)
        if not worker.busy:
            self._start(worker)

    def _route(self, job: Job) -> SimWorker:
        if self.policy is Policy.ROUND_ROBIN:
            name = self._names[self._next_rr % len(self._names)]
            self._next_rr += 1
            return self.workers[name]
        loads = {n: w.load() for n, w in self.workers.items()}
        decision = choose(self.indexer, job.hashes, self._names, loads, self.weights,
                          rng=self._rng)
        if self.policy is not Policy.OVERLAP and decision.hint_source is not None:
            job.hint_source, job.hint_range = decision.hint_source, decision.hint_range
        return self.workers[decision.worker]

    def _start(self, worker: SimWorker) -> None:
        job = worker.queue.popleft()
        worker.busy = True
        source = self.workers[job.hint_source] if job.hint_source else None
        coverage = worker.cover(job, source)
        service_ms = worker.prefill_ms(job, coverage)
        worker.busy_ms += service_ms
        done_ms = self.now_ms + service_ms
        self._outcomes[job.index] = Outcome(worker.name, done_ms - job.arrival_ms,
                                            self.now_ms - job.arrival_ms, service_ms,
                                            len(job.hashes), coverage)
        self._schedule(done_ms, _PREFILL_DONE, worker, job)

    def _prefill_done(self, worker: SimWorker, job: Job) -> None:
        for tier, blocks in ((Tier.DEVICE, worker.device), (Tier.POOL, worker.pool)):
            stored, evicted = blocks.store(job.hashes)
            if stored or evicted:
                seq = self._seq.get((worker.name, tier), 0) + 1
                self._seq[worker.name, tier] = seq
                self.indexer.apply(worker.name, tier, 1, seq, stored, evicted)
        worker.decoding += 1
        self._schedule(self.now_ms + job.output_tokens * self.fleet.decode_ms_per_token,
                       _DECODE_DONE, worker, job)
        worker.busy = False
        if worker.queue:
            self._start(worker)
