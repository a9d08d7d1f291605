"""`--bench`: every policy on the three synthetic workloads, plus the router's decision time.

Rows: round-robin, overlap (the reference router's defaults, no fetch), overlap-hint (the
same choice, then a fetch per hint) and kvcr (fetch credit in the choice, `TUNED_WEIGHTS`,
the same weights for every workload) on the same requests, fleet and seed. The summary's
headline compares kvcr with overlap on the multi-tenant workload; the other workloads'
ratios are reported beside it. `decision_*_ms` times the real `choose` (which does the
index's prefix lookups) for a 16-worker fleet and prompts of about 8k tokens (512 blocks),
with an index populated by simulating that fleet first; wall-clock, so it varies with the
machine and its load (everything else is simulated time and deterministic).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from typing import Any

from kvcr_router.cost import CostWeights, choose
from kvcr_router.simulate.fleet import FleetConfig
from kvcr_router.simulate.report import (
    WARMUP_SHARE,
    RunStats,
    format_summary,
    format_table,
    meets,
    percentile,
    summarize,
)
from kvcr_router.simulate.simulation import REFERENCE_WEIGHTS, Policy, Simulation
from kvcr_router.simulate.workload import WorkloadConfig, WorkloadKind, generate, preset

TARGETS = {"p90_ttft_gain_vs_overlap_only": (">=", 0.20), "load_imbalance_ratio": ("<=", 1.1),
           "decision_p99_ms": ("<=", 2.0)}
HEADLINE = WorkloadKind.MULTI_TENANT
DECISION_WORKERS = 16


def decision_ms(weights: CostWeights, *, warm_requests: int, samples: int,
                seed: int) -> dict[str, float]:
    """p50 and p99 of one routing decision over `samples` prompts of about 8k tokens, in wall
    time and in this thread's CPU time (the latter leaves out preemption by other processes,
    which dominates the wall p99 on a busy machine)."""
    config = dataclasses.replace(
        preset(WorkloadKind.MULTI_TENANT, workers=DECISION_WORKERS,
               requests=warm_requests + samples, seed=seed),
        system_tokens=(6144, 7168), user_tokens=(512, 1536))  # prompts of about 8k tokens
    requests = generate(config)
    fleet = FleetConfig(workers=DECISION_WORKERS)
    sim = Simulation(fleet, Policy.KVCR, weights, seed=seed)
    sim.run(requests[:warm_requests])  # fills every worker's tiers and the router's index
    loads = {n: w.load() for n, w in sim.workers.items()}
    names = fleet.names()
    wall_ms, cpu_ms = [], []
    gc.collect()
    for request in requests[warm_requests:]:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        choose(sim.indexer, request.hashes, names, loads, weights)
        cpu_ms.append((time.thread_time_ns() - cpu) / 1e6)
        wall_ms.append((time.perf_counter_ns() - wall) / 1e6)
    return {"decision_p50_ms": percentile(wall_ms, 50), "decision_p99_ms": percentile(wall_ms, 99),
            "decision_cpu_p50_ms": percentile(cpu_ms, 50),
            "decision_cpu_p99_ms": percentile(cpu_ms, 99)}


def _gain(rows: dict[tuple[str, str], RunStats], workload: WorkloadKind, base: Policy) -> float:
    ours = rows[workload.value, Policy.KVCR.value].ttft_p90_ms
    return 1 - ours / max(rows[workload.value, base.value].ttft_p90_ms, 1e-9)


def _imbalance_ratio(rows: dict[tuple[str, str], RunStats], workload: WorkloadKind) -> float:
    return (rows[workload.value, Policy.KVCR.value].load_imbalance
            / rows[workload.value, Policy.OVERLAP.value].load_imbalance)


def run_bench(*, quick: bool, fleet: FleetConfig, weights: CostWeights, seed: int,
              requests: int | None = None, progress: bool = True) -> dict[str, Any]:
    count = requests or (2000 if quick else 4000)
    rows: dict[tuple[str, str], RunStats] = {}
    workloads: dict[str, WorkloadConfig] = {}
    for kind in WorkloadKind:
        config = preset(kind, workers=fleet.workers, requests=count, seed=seed)
        workloads[kind.value] = config
        stream = generate(config)
        for policy in Policy:
            if progress:
                print(f"kvcr-router simulate --bench: {kind.value} / {policy.value}",
                      file=sys.stderr)
            result = Simulation(fleet, policy, weights, seed=seed).run(stream)
            rows[kind.value, policy.value] = summarize(kind.value, result)
    decision = decision_ms(weights, warm_requests=min(count, 1500 if quick else 3000),
                           samples=1000 if quick else 3000, seed=seed)
    summary = {
        "p90_ttft_gain_vs_overlap_only": _gain(rows, HEADLINE, Policy.OVERLAP),
        "load_imbalance_ratio": _imbalance_ratio(rows, HEADLINE),
        **decision,
        "p90_ttft_gain_vs_overlap_hint": _gain(rows, HEADLINE, Policy.OVERLAP_HINT),
        **{f"p90_ttft_gain_vs_overlap_only_{k.value.replace('-', '_')}":
           _gain(rows, k, Policy.OVERLAP) for k in WorkloadKind if k is not HEADLINE},
        "load_imbalance_ratio_worst": max(_imbalance_ratio(rows, k) for k in WorkloadKind),
    }
    return {
        "bench": "router-simulate", "quick": quick, "seed": seed, "requests": count,
        "warmup_share": WARMUP_SHARE,
        "headline_workload": HEADLINE.value,
        "fleet": dataclasses.asdict(fleet),
        "workloads": {k: {**dataclasses.asdict(c), "kind": c.kind.value}
                      for k, c in workloads.items()},
        "weights": {"overlap": dataclasses.asdict(REFERENCE_WEIGHTS),
                    "kvcr": dataclasses.asdict(weights)},
        "results": [r.as_dict() for r in rows.values()],
        "summary": summary,
        "targets": {k: f"{op} {v:g}" for k, (op, v) in TARGETS.items()},
        "meets_targets": {k: meets(TARGETS, k, summary[k]) for k in TARGETS},
    }


def format_bench(result: dict[str, Any]) -> str:
    fleet = result["fleet"]
    rows = [RunStats(**r) for r in result["results"]]
    return "\n".join([
        f"kvcr-router simulate --bench{' --quick' if result['quick'] else ''}: "
        f"{fleet['workers']} workers, {result['requests']} requests per workload (the first "
        f"{result['warmup_share']:.0%} warm the caches and are not measured), seed "
        f"{result['seed']}; hit shares are of all prompt blocks; imbalance = max/mean requests "
        "per worker (busy: prefill-lane time)",
        format_table(rows), "",
        f"summary (headline workload: {result['headline_workload']}; decision time: "
        f"{DECISION_WORKERS} workers, ~8k-token prompts)",
        format_summary(result["summary"], TARGETS)])
