"""What a simulated run measured, and how it is printed.

`RunStats` condenses one run (one policy on one workload) over its measured requests: all but
the first `WARMUP_SHARE` in arrival order, which fill the empty caches (the same requests for
every policy). It gives where prompt blocks came from (shares of all prompt blocks: device,
own pool, fetched from a peer), TTFT percentiles (nearest rank), and load imbalance = max over
mean of the measured requests each worker received (`busy_imbalance`: the same over the ms
their prefills held each worker's lane). `format_table` renders
rows as a fixed-width table; `format_summary` renders a bench summary against its targets.
Pure functions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvcr_router.simulate.simulation import RunResult

Targets = Mapping[str, tuple[str, float]]  # name -> (">=" or "<=", bound)

WARMUP_SHARE = 0.25


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def _imbalance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class RunStats:
    workload: str
    policy: str
    requests: int
    device_hit: float
    pool_hit: float
    fetched: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    queue_p90_ms: float
    load_imbalance: float
    busy_imbalance: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(workload: str, result: RunResult,
              warmup_share: float = WARMUP_SHARE) -> RunStats:
    outcomes = result.outcomes[int(len(result.outcomes) * warmup_share):]
    blocks = sum(o.prompt_blocks for o in outcomes) or 1
    ttft = [o.ttft_ms for o in outcomes]
    requests = dict.fromkeys(result.requests_by_worker, 0.0)
    busy_ms = dict.fromkeys(result.requests_by_worker, 0.0)
    for o in outcomes:
        requests[o.worker] += 1
        busy_ms[o.worker] += o.service_ms
    return RunStats(
        workload=workload, policy=result.policy.value, requests=len(outcomes),
        device_hit=sum(o.coverage.device_blocks for o in outcomes) / blocks,
        pool_hit=sum(o.coverage.pool_blocks for o in outcomes) / blocks,
        fetched=sum(o.coverage.fetched_blocks for o in outcomes) / blocks,
        ttft_p50_ms=percentile(ttft, 50), ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99), ttft_mean_ms=sum(ttft) / max(1, len(ttft)),
        queue_p90_ms=percentile([o.queue_ms for o in outcomes], 90),
        load_imbalance=_imbalance(list(requests.values())),
        busy_imbalance=_imbalance(list(busy_ms.values())))


def format_table(rows: Sequence[RunStats]) -> str:
    head = (f"{'workload':13} {'policy':13} | {'device':>6} {'pool':>6} {'fetch':>6} | "
            f"{'TTFT p50':>9} {'p90':>8} {'p99':>8} ms | {'imbalance':>9} {'busy':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.workload:13} {r.policy:13} | {r.device_hit:6.1%} {r.pool_hit:6.1%} "
            f"{r.fetched:6.1%} | {r.ttft_p50_ms:9.0f} {r.ttft_p90_ms:8.0f} "
            f"{r.ttft_p99_ms:8.0f}    | {r.load_imbalance:9.2f} {r.busy_imbalance:5.2f}")
    return "\n".join(lines)


def meets(targets: Targets, name: str, value: float) -> bool:
    op, bound = targets[name]
    return value >= bound if op == ">=" else value <= bound


def format_summary(summary: Mapping[str, float], targets: Targets) -> str:
    lines = []
    for name, value in summary.items():
        line = f"{name:36} {value:>10.3f}"
        if name in targets:
            op, bound = targets[name]
            verdict = "meets" if meets(targets, name, value) else "MISSES"
            line += f"   target {op} {bound:g}  {verdict}"
        lines.append(line)
    return "\n".join(lines)
