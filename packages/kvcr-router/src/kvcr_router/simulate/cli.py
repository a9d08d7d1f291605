"""`kvcr-router simulate`: argument parsing and the three modes (replay, `--sweep`, `--bench`).

`main(argv)` is what `kvcr-router simulate ...` and `python -m kvcr_router.simulate` call.
Replay runs the chosen policies on one synthetic workload or a Mooncake-style trace and
prints a table (or JSON); `--sweep` searches the kvcr weights and prints the recommended
values as flags; `--bench` runs the fixed benchmark (bench.py). Bad settings or a bad trace
print one line naming the field and exit 2; nothing here raises on user input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcr_core.errors import ConfigError
from kvcr_router.cost import CostWeights
from kvcr_router.simulate.bench import format_bench, run_bench
from kvcr_router.simulate.fleet import REFERENCE_BLOCK_TOKENS, FleetConfig
from kvcr_router.simulate.report import format_table, summarize
from kvcr_router.simulate.simulation import Policy, Simulation
from kvcr_router.simulate.sweep import TUNED_WEIGHTS, SweepCase, SweepPoint, make_case, sweep
from kvcr_router.simulate.trace import MOONCAKE_BLOCK_TOKENS, TraceError, read_trace, write_trace
from kvcr_router.simulate.workload import SimRequest, WorkloadKind, generate, preset

_FLEET_FLAGS = ("workers", "device_blocks", "pool_blocks", "prefill_ms_per_token",
                "prefill_overhead_ms", "pool_load_ms_per_block", "fetch_ms_per_block",
                "fetch_setup_ms", "decode_ms_per_token", "decode_interference")
_WEIGHT_FLAGS = tuple(f.name for f in dataclasses.fields(CostWeights))
_INT_FIELDS = {"workers", "device_blocks", "pool_blocks", "min_fetch_blocks"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcr-router simulate",
        description="Replay requests against modelled workers routed by the real kvcr-router "
                    "cost model; tune its weights (--sweep) or run the benchmark (--bench).")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--workload", choices=[k.value for k in WorkloadKind],
                        help="synthetic workload (default multi-tenant; --sweep: all three)")
    source.add_argument("--trace", metavar="FILE.jsonl",
                        help="Mooncake-style trace: timestamp, input_length, output_length, "
                             "hash_ids per line")
    p.add_argument("--requests", type=int, help="requests per workload (default: 4000; "
                   "--sweep 2000, --quick 800; --bench 4000, --quick 2000)")
    p.add_argument("--rate-per-worker", type=float, metavar="REQ_PER_S",
                   help="arrival rate per worker (default: the workload's preset)")
    p.add_argument("--tenants", type=int, help="tenants of multi-tenant and bursty (128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-trace", metavar="FILE.jsonl",
                   help="also write the replayed requests as a Mooncake-style trace")
    fleet = p.add_argument_group("modelled fleet (per-block values default to 16-token "
                                 "blocks and scale with --block-tokens)")
    fleet.add_argument("--block-tokens", type=int,
                       help=f"tokens per block (default {REFERENCE_BLOCK_TOKENS}; "
                            f"{MOONCAKE_BLOCK_TOKENS} with --trace)")
    for name in _FLEET_FLAGS:
        fleet.add_argument("--" + name.replace("_", "-"), type=int if name in _INT_FIELDS
                           else float, help=f"default {getattr(FleetConfig(), name)}")
    p.add_argument("--policy", choices=["all", *(x.value for x in Policy)], default="all")
    weights = p.add_argument_group("kvcr policy weights (default: the tuned values)")
    for name in _WEIGHT_FLAGS:
        weights.add_argument("--" + name.replace("_", "-"), type=int if name in _INT_FIELDS
                             else float, help=f"default {getattr(TUNED_WEIGHTS, name)}")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true", help="search the kvcr weights")
    mode.add_argument("--bench", action="store_true", help="run the benchmark")
    p.add_argument("--quick", action="store_true", help="smaller runs (--sweep, --bench)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _given(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _fleet(args: argparse.Namespace) -> FleetConfig:
    block_tokens = args.block_tokens or (
        MOONCAKE_BLOCK_TOKENS if args.trace else REFERENCE_BLOCK_TOKENS)
    if block_tokens < 1:
        raise ConfigError("block_tokens", block_tokens, "give an integer >= 1")
    return dataclasses.replace(FleetConfig.scaled(block_tokens), **_given(args, _FLEET_FLAGS))


def _streams(args: argparse.Namespace, fleet: FleetConfig,
             count: int) -> dict[str, list[SimRequest]]:
    if args.trace:
        return {Path(args.trace).name: read_trace(args.trace)}
    kinds = [WorkloadKind(args.workload)] if args.workload else (
        list(WorkloadKind) if args.sweep else [WorkloadKind.MULTI_TENANT])
    out = {}
    for kind in kinds:
        config = dataclasses.replace(
            preset(kind, workers=fleet.workers, requests=count, seed=args.seed,
                   rate_per_worker_s=args.rate_per_worker, tenants=args.tenants),
            block_tokens=fleet.block_tokens)
        out[kind.value] = generate(config)
    return out


def _replay(args: argparse.Namespace, fleet: FleetConfig, weights: CostWeights) -> int:
    ((name, stream),) = _streams(args, fleet, args.requests or 4000).items()
    if args.write_trace:
        write_trace(stream, args.write_trace)
    policies = list(Policy) if args.policy == "all" else [Policy(args.policy)]
    rows = [summarize(name, Simulation(fleet, policy, weights, seed=args.seed).run(stream))
            for policy in policies]
    if args.json:
        print(json.dumps({"workload": name, "requests": len(stream),
                          "fleet": dataclasses.asdict(fleet),
                          "weights": dataclasses.asdict(weights),
                          "results": [r.as_dict() for r in rows]}, indent=2))
    else:
        print(format_table(rows))
    return 0


def _flags(weights: CostWeights) -> str:
    return " ".join(f"--{n.replace('_', '-')} {getattr(weights, n):g}" for n in _WEIGHT_FLAGS)


def _sweep(args: argparse.Namespace, fleet: FleetConfig, start: CostWeights) -> int:
    count = args.requests or (800 if args.quick else 2000)
    cases: list[SweepCase] = [make_case(n, s, fleet)
                              for n, s in _streams(args, fleet, count).items()]

    def show(point: SweepPoint) -> None:
        if not args.json:
            ratios = " ".join(f"{k}={v:.3f}" for k, v in point.p90_ratio.items())
            flag = "" if point.feasible else "  (imbalance over the bound)"
            print(f"score {point.score:.3f}  p90/reference: {ratios}  <- {_flags(point.weights)}"
                  f"{flag}", file=sys.stderr)

    best, points = sweep(cases, fleet, start, passes=1 if args.quick else 2, on_point=show)
    if args.json:
        print(json.dumps({"recommended": dataclasses.asdict(best.weights),
                          "score": best.score, "feasible": best.feasible,
                          "p90_ratio_vs_overlap": best.p90_ratio,
                          "load_imbalance_ratio": best.imbalance_ratio,
                          "points": len(points), "requests_per_workload": count,
                          "seed": args.seed}, indent=2))
    else:
        print(f"recommended ({len(points)} points, {count} requests per workload, seed "
              f"{args.seed}; p90 vs reference {best.score:.3f} on average):\n"
              f"  {_flags(best.weights)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        fleet = _fleet(args)
        weights = dataclasses.replace(TUNED_WEIGHTS, **_given(args, _WEIGHT_FLAGS))
        if args.bench:
            if args.trace:
                raise ConfigError("trace", args.trace, "--bench runs its own workloads; drop it")
            result = run_bench(quick=args.quick, fleet=fleet, weights=weights, seed=args.seed,
                               requests=args.requests, progress=not args.json)
            print(json.dumps(result, indent=2) if args.json else format_bench(result))
            return 0
        if args.sweep:
            return _sweep(args, fleet, weights)
        return _replay(args, fleet, weights)
    except (ConfigError, TraceError, OSError) as err:
        print(f"kvcr-router simulate: error: {err}", file=sys.stderr)
        return 2
