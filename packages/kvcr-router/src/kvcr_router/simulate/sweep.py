"""`--sweep`: a coordinate search over the kvcr policy's weights, and the tuned result.

The objective is the mean, over the given workloads, of kvcr's TTFT p90 divided by the
reference router's (overlap-only) on the same requests; a point whose load imbalance exceeds
`MAX_IMBALANCE_RATIO` times the reference's on any workload is infeasible and ranks after
every feasible one. One set of weights serves all workloads (no per-workload tuning).
Each pass tries every grid value of one weight with the others held, keeps the best, and
moves on; the search stops after `passes` or when a pass changes nothing. Points already
scored are not re-run. Deterministic: the simulations are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvcr_router.cost import WEIGHT_PRESETS, CostWeights
from kvcr_router.simulate.fleet import FleetConfig
from kvcr_router.simulate.report import RunStats, summarize
from kvcr_router.simulate.simulation import Policy, Simulation
from kvcr_router.simulate.workload import SimRequest

GRID: dict[str, tuple[float, ...]] = {
    "fetch_w": (0.0, 0.1, 0.25, 0.5, 0.75, 0.9),
    "pool_w": (0.5, 0.75, 0.9, 1.0),
    "decode_w": (0.0, 0.03125, 0.0625, 0.125, 0.25, 0.5, 1.0),
    "active_w": (0.0, 8.0, 32.0, 128.0, 512.0),
    "min_fetch_blocks": (1, 4, 16, 64),
}
MAX_IMBALANCE_RATIO = 1.1

# `--sweep --seed 1` on the bench's three workloads (the bench replays seed 0, so these were
# not fitted to the requests they are judged on) recommended pool_w 1, fetch_w 0, decode_w 0,
# active_w 32. With device_w == pool_w, a worker holding none of a prefix differs from its
# holder by (1 - fetch_w) * fetchable + active_w * (difference in active requests), so only
# active_w / (1 - fetch_w) orders those choices: fetch_w 0.5 with active_w 16 scores the same
# and keeps the documented fetch credit. The bench's kvcr policy uses these for every workload;
# docs/router-simulator.md has the runs.
TUNED_WEIGHTS = WEIGHT_PRESETS["tuned"]


@dataclasses.dataclass(frozen=True)
class SweepCase:
    """One workload to tune on, with the reference router's result on it."""

    name: str
    requests: Sequence[SimRequest]
    baseline: RunStats


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    weights: CostWeights
    score: float  # mean kvcr p90 / reference p90 (lower is better)
    feasible: bool
    p90_ratio: dict[str, float]
    imbalance_ratio: dict[str, float]

    def rank(self) -> tuple[bool, float]:
        return (not self.feasible, self.score)


def make_case(name: str, requests: Sequence[SimRequest], fleet: FleetConfig) -> SweepCase:
    return SweepCase(name, requests,
                     summarize(name, Simulation(fleet, Policy.OVERLAP).run(requests)))


def score(cases: Sequence[SweepCase], fleet: FleetConfig, weights: CostWeights) -> SweepPoint:
    p90, imbalance = {}, {}
    for case in cases:
        ours = summarize(case.name, Simulation(fleet, Policy.KVCR, weights).run(case.requests))
        p90[case.name] = ours.ttft_p90_ms / max(case.baseline.ttft_p90_ms, 1e-9)
        imbalance[case.name] = ours.load_imbalance / case.baseline.load_imbalance
    feasible = all(r <= MAX_IMBALANCE_RATIO for r in imbalance.values())
    return SweepPoint(weights, sum(p90.values()) / len(p90), feasible, p90, imbalance)


def _with(weights: CostWeights, name: str, value: float) -> CostWeights:
    change: dict[str, Any] = {name: int(value) if name == "min_fetch_blocks" else float(value)}
    return dataclasses.replace(weights, **change)


def sweep(cases: Sequence[SweepCase], fleet: FleetConfig, start: CostWeights, *,
          passes: int = 2, grid: dict[str, tuple[float, ...]] | None = None,
          on_point: Callable[[SweepPoint], None] | None = None) -> tuple[SweepPoint,
                                                                          list[SweepPoint]]:
    """The best point found from `start`, and every point scored, in order."""
    seen: dict[CostWeights, SweepPoint] = {}

    def visit(weights: CostWeights) -> SweepPoint:
        if weights not in seen:
            seen[weights] = score(cases, fleet, weights)
            if on_point is not None:
                on_point(seen[weights])
        return seen[weights]

    best = visit(start)
    for _ in range(passes):
        moved = False
        for name, values in (grid or GRID).items():
            for value in values:
                point = visit(_with(best.weights, name, value))
                if point.rank() < best.rank():
                    best, moved = point, True
        if not moved:
            break
    return best, list(seen.values())
