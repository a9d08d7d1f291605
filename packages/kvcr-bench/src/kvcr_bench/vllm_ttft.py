"""`kvcr bench vllm`: time to first token on the real vLLM CPU engine, in one run, for
(a) recompute (vanilla vLLM, new prompt), (b) a hit in the same engine's prefix cache,
(c) a cross-engine hit through kvcr (engine B loads what engine A stored in kvcr-guard), and
(d) vLLM's ExampleConnector doing the same cross-engine reuse through disk.

Every case runs in its own engine process (cold caches), on the `bench` model preset (a
4k-token prefill takes seconds here). TTFT = wall time of `generate(max_tokens=1)` in the
offline engine: prefill plus the first token, loads included. Both engine modes: the
in-process engine core and the multiprocess one (`vllm serve`'s), each case with min, median,
p90 and max over 10 prompts (2 with --quick; with fewer than 10 samples the nearest-rank
p90 is the maximum); plus each fresh engine's first request (kvcr's against vanilla's,
both new prompts; and against a vanilla engine's started after kvcr's, while kvcr-guard
still holds its pool: on a virtual machine that backs guest memory on first touch, memory
backed anywhere slows the next fresh engine's first prefill, vanilla's too, so the second
ratio tells kvcr's own cost from the machine's) and how long each engine took to start
(kvcr-guard runs with `--back-ahead` as deployed: it backs the first 256 MiB of the
namespace's pool, a quarter of 4 GiB, when it starts, and the rest as the pool fills, that
far ahead). Also reports the KV load throughput (bytes moved per second of load time).
`--modes inproc,mp` picks the engine modes (default both).

Hybrid attention: the same recompute / same-engine hit / cross-engine kvcr cases on a tiny
local Gemma 3 (sliding-window layers beside full attention, two KV cache groups; the `test`
preset's size, 2,048-token prompts), in-process, with each engine's KV blocks and KV cache
groups: with kvcr, vLLM's hybrid memory manager stays on, so its KV capacity is vanilla's.

OpenMP threads: in-process, two (one per core here); multiprocess, one core fewer, as
vLLM's CPU tuning advises (`VLLM_CPU_NUM_OF_RESERVED_CPU`): there the engine core's process
busy-polls (sched_yield) for the worker's reply for a second after each one, so with a
thread on every core one of them shares its core with that loop and the forward pass runs
at its pace (hits of 30 or 80-120 ms at random on 2 cores; docs/vllm.md). Every case of a
mode runs with the same count.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvcr_bench.copies import meets
from kvcr_bench.tiny_model import PRESETS, build, build_gemma3
from kvcr_bench.vllm_servers import BACK_AHEAD, bench_guard

TARGETS = {"ttft_ratio_kvcr_vs_recompute": ("<=", 0.15),
           "ttft_ratio_kvcr_vs_local_prefix": ("<=", 1.5),
           "ttft_ratio_kvcr_vs_example_connector": ("<", 1.0),
           # the engine mode users run (`vllm serve`): multiprocess
           "mp_ttft_ratio_kvcr_vs_local_prefix": ("<=", 0.8),
           "mp_ttft_ratio_kvcr_vs_example_connector": ("<=", 0.6),
           "mp_ttft_kvcr_p90_over_median": ("<=", 1.5),
           "mp_first_request_ratio_kvcr_vs_vanilla": ("<=", 1.1)}


def _probe(job: dict[str, Any]) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "kvcr_bench.vllm_probe", "-"],
                         input=json.dumps(job), capture_output=True, text=True, timeout=1800,
                         check=False)
    if out.returncode != 0:
        raise RuntimeError(f"engine failed: {out.stderr[-3000:]}")
    # raw_decode: the multiprocess engine core's own output can land right after a row, on
    # its line (seen once in a full run)
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(line)[0] for line in out.stdout.splitlines()
            if line.startswith("{")]


def _median_seconds(rows: list[dict[str, Any]]) -> float:
    return float(statistics.median(r["seconds"] for r in rows))


def spread_ms(rows: list[dict[str, Any]]) -> dict[str, float]:
    """min, median, p90 and max of the rows' wall times, in ms (p90 by the nearest rank)."""
    ms = sorted(1000 * r["seconds"] for r in rows)
    p90 = ms[min(len(ms) - 1, max(0, -(-9 * len(ms) // 10) - 1))]
    return {"min": ms[0], "median": float(statistics.median(ms)), "p90": p90, "max": ms[-1]}


def _cases(base: dict[str, Any], prompts: list[list[int]], multiprocess: bool
           ) -> dict[str, list[dict[str, Any]]]:
    """The four cases in one engine mode, each in fresh engine processes: rows per case, plus
    the first request of a fresh vanilla and of a fresh kvcr engine (both new prompts)."""
    base = {**base, "multiprocess": multiprocess, "omp_threads": omp_threads(multiprocess)}
    mode = "multiprocess" if multiprocess else "in-process"
    one = [{"tokens": p, "max_tokens": 1} for p in prompts]
    # A loading engine's first request is also its first forward pass ever (allocations,
    # kernel set-up: ~100 ms more here, in any engine): it serves one short unrelated prompt
    # first, untimed, so (c) and (d) time warm engines as (b) does; first requests are
    # compared on their own (first_request_ratio_*).
    warm = [{"tokens": list(range(10, 74)), "max_tokens": 1}, *one]
    twice = [r for p in prompts for r in ({"tokens": p, "max_tokens": 1},) * 2]
    progress = sys.stderr
    print(f"bench vllm ({mode}): (a)+(b) vanilla engine ...", file=progress, flush=True)
    vanilla = _probe({**base, "connector": "none", "requests": twice})
    workdir = Path(tempfile.mkdtemp(prefix="kvcrbv", dir="/tmp"))
    guard = bench_guard(workdir, pool_bytes="4GiB", back_ahead=BACK_AHEAD)  # as deployed
    try:
        extra = {"mode": "guarded", "socket": guard.socket}
        print(f"bench vllm ({mode}): (c) kvcr engine A stores, engine B loads ...",
              file=progress, flush=True)
        stored = _probe({**base, "connector": "plugin", "extra": extra, "requests": one})
        kvcr = _probe({**base, "connector": "plugin", "extra": extra, "requests": warm})[1:]
        print(f"bench vllm ({mode}): vanilla engine beside kvcr-guard ...", file=progress,
              flush=True)
        beside = _probe({**base, "connector": "none", "requests": one[:1]})
    finally:
        guard.stop()
    store = {"shared_storage_path": str(workdir / "example-store")}
    print(f"bench vllm ({mode}): (d) ExampleConnector engine A stores, engine B loads ...",
          file=progress, flush=True)
    _probe({**base, "connector": "example", "extra": store, "requests": one})
    example = _probe({**base, "connector": "example", "extra": store, "requests": warm})[1:]
    return {"recompute": vanilla[0::2], "local_prefix": vanilla[1::2], "kvcr": kvcr,
            "example_connector": example, "first_vanilla": vanilla[:1],
            "first_kvcr": stored[:1], "first_vanilla_beside_guard": beside}


def _hybrid_cases(n_prompts: int) -> dict[str, Any]:
    """Recompute, same-engine hit and cross-engine kvcr on the tiny hybrid model (in-process
    engines), with the engines' KV blocks and groups."""
    model = str(build_gemma3(Path(".cache/models/tiny-gemma3"), Path(".cache/models/tiny-test")))
    rng = random.Random(13)
    prompts = [[rng.randrange(10, 2000) for _ in range(2048)] for _ in range(n_prompts)]
    base = {"model": model, "multiprocess": False, "omp_threads": omp_threads(False)}
    one = [{"tokens": p, "max_tokens": 1} for p in prompts]
    twice = [r for p in prompts for r in ({"tokens": p, "max_tokens": 1},) * 2]
    print("bench vllm (hybrid): vanilla engine, then kvcr engine A stores, B loads ...",
          file=sys.stderr, flush=True)
    vanilla = _probe({**base, "connector": "none", "requests": twice})
    workdir = Path(tempfile.mkdtemp(prefix="kvcrbh", dir="/tmp"))
    guard = bench_guard(workdir, pool_bytes="1GiB", back_ahead=BACK_AHEAD)
    try:
        extra = {"mode": "guarded", "socket": guard.socket}
        stored = _probe({**base, "connector": "plugin", "extra": extra, "requests": one})
        warm = [{"tokens": list(range(10, 74)), "max_tokens": 1}, *one]
        kvcr = _probe({**base, "connector": "plugin", "extra": extra, "requests": warm})[1:]
    finally:
        guard.stop()
    cases = {"recompute": vanilla[0::2], "local_prefix": vanilla[1::2], "kvcr": kvcr}
    a, b, c = (_median_seconds(cases[k]) for k in ("recompute", "local_prefix", "kvcr"))
    return {"cases": cases, "kv_blocks": {"vanilla": vanilla[0]["kv_blocks"],
                                          "kvcr": stored[0]["kv_blocks"]},
            "kv_groups": {"vanilla": vanilla[0]["kv_groups"], "kvcr": stored[0]["kv_groups"]},
            "summary": {"hybrid_ttft_ratio_kvcr_vs_recompute": c / a,
                        "hybrid_ttft_ratio_kvcr_vs_local_prefix": c / b,
                        "hybrid_kvcr_hit_tokens_min": min(r["cached"] for r in kvcr),
                        "hybrid_kv_blocks_ratio_kvcr_vs_vanilla":
                            stored[0]["kv_blocks"] / vanilla[0]["kv_blocks"]}}


def omp_threads(multiprocess: bool) -> int:
    """The engines' OpenMP threads in a mode: a core is left to the multiprocess engine
    core's busy-polling process (see the module header)."""
    cores = os.cpu_count() or 2
    return max(1, min(2, cores - 1 if multiprocess else cores))


def _ratios(cases: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    a, b, c, d = (_median_seconds(cases[k]) for k in
                  ("recompute", "local_prefix", "kvcr", "example_connector"))
    kvcr = spread_ms(cases["kvcr"])
    return {"ttft_ratio_kvcr_vs_recompute": c / a, "ttft_ratio_kvcr_vs_local_prefix": c / b,
            "ttft_ratio_kvcr_vs_example_connector": c / d,
            "ttft_kvcr_p90_over_median": kvcr["p90"] / kvcr["median"],
            "first_request_ratio_kvcr_vs_vanilla":
                cases["first_kvcr"][0]["seconds"] / cases["first_vanilla"][0]["seconds"],
            "first_request_ratio_kvcr_vs_vanilla_beside_guard":
                cases["first_kvcr"][0]["seconds"]
                / cases["first_vanilla_beside_guard"][0]["seconds"],
            "engine_start_s_vanilla": cases["first_vanilla"][0]["engine_start_s"],
            "engine_start_s_kvcr": cases["first_kvcr"][0]["engine_start_s"],
            "ttft_recompute_ms": 1000 * a, "ttft_local_prefix_ms": 1000 * b,
            "ttft_kvcr_cross_engine_ms": 1000 * c, "ttft_example_connector_ms": 1000 * d}


MODES = {"inproc": False, "mp": True}  # --modes: name -> multiprocess


def run_vllm_bench(*, quick: bool, as_json: bool, modes: str = "inproc,mp") -> int:
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    if not chosen or any(m not in MODES for m in chosen):
        print(f"kvcr bench vllm: --modes takes a comma-separated list of {', '.join(MODES)} "
              f"(got {modes!r})", file=sys.stderr)
        return 2
    preset = "bench"
    model = str(build(Path(".cache/models") / f"tiny-{preset}", preset))
    spec = PRESETS[preset]
    prompt_tokens, n_prompts = (2048, 2) if quick else (4096, 10)
    rng = random.Random(11)
    prompts = [[rng.randrange(10, spec["vocab_size"] - 10) for _ in range(prompt_tokens)]
               for _ in range(n_prompts)]
    base = {"model": model, "max_model_len": spec["max_position_embeddings"],
            "max_num_batched_tokens": 8192}
    runs = {mode: _cases(base, prompts, multiprocess=MODES[mode]) for mode in chosen}
    summary: dict[str, Any] = {}
    for mode, cases in runs.items():
        prefix = "" if mode == "inproc" else f"{mode}_"
        summary.update({f"{prefix}{k}": v for k, v in _ratios(cases).items()})
    kvcr = runs[chosen[0]]["kvcr"]
    last = kvcr[-1]["metrics"]
    kv_bytes_per_token = (2 * spec["num_hidden_layers"] * spec["num_key_value_heads"]
                          * spec["head_dim"] * 4)
    load_s = last.get("vllm:kvcr_load_seconds")
    loaded_tokens = last.get("vllm:kvcr_loaded_tokens", 0)
    load_sum = load_s.get("sum") if isinstance(load_s, dict) else None
    summary.update({
        "kvcr_hit_tokens_min": min(r["cached"] for m in runs.values() for r in m["kvcr"]),
        "example_hit_tokens_min": min(r["cached"] for m in runs.values()
                                      for r in m["example_connector"]),
        "kv_load_gbps": (loaded_tokens * kv_bytes_per_token / load_sum / 1e9
                         if load_sum else None)})
    hybrid = _hybrid_cases(n_prompts)
    summary.update(hybrid["summary"])
    targets = {k: v for k, v in TARGETS.items() if k in summary}
    result = {"bench": "vllm", "quick": quick, "model_preset": preset,
              "prompt_tokens": prompt_tokens, "prompts": n_prompts, "modes": chosen,
              "omp_threads": {mode: omp_threads(MODES[mode]) for mode in chosen},
              "kv_bytes_per_token": kv_bytes_per_token, "summary": summary,
              "spread_ms": {mode: {case: spread_ms(rows) for case, rows in cases.items()
                                   if not case.startswith("first_")}
                            for mode, cases in runs.items()},
              "samples_s": {mode: {case: [r["seconds"] for r in rows]
                                   for case, rows in cases.items()}
                            for mode, cases in runs.items()},
              "hybrid": {"model": "tiny Gemma 3 (sliding window 64 + full attention)",
                         "prompt_tokens": 2048, "kv_blocks": hybrid["kv_blocks"],
                         "kv_groups": hybrid["kv_groups"],
                         "spread_ms": {case: spread_ms(rows)
                                       for case, rows in hybrid["cases"].items()}},
              "targets": {k: f"{op} {v:g}" for k, (op, v) in targets.items()},
              "meets_targets": {k: meets(TARGETS, k, summary[k]) for k in targets}}
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    _print_tables(result, quick)
    return 0


def _print_tables(result: dict[str, Any], quick: bool) -> None:
    summary = result["summary"]
    print(f"kvcr bench vllm{' --quick' if quick else ''}: {result['prompts']} prompts of "
          f"{result['prompt_tokens']} tokens, model preset '{result['model_preset']}' "
          f"({result['kv_bytes_per_token'] // 1024} KiB of KV per token); TTFT in ms")
    titles = {"inproc": "in-process engine core", "mp": "multiprocess engine core (as vllm serve)"}
    for mode in result["modes"]:
        threads = omp_threads(MODES[mode])
        print(f"  {titles[mode]}, {threads} OpenMP thread{'s' if threads > 1 else ''} per engine "
              f"on {os.cpu_count()} cores:")
        _print_rows(result["spread_ms"][mode])
    hybrid = result["hybrid"]
    print(f"  hybrid attention: {hybrid['model']}, {hybrid['prompt_tokens']}-token prompts, "
          f"in-process; KV blocks vanilla {hybrid['kv_blocks']['vanilla']}, with kvcr "
          f"{hybrid['kv_blocks']['kvcr']} (KV cache groups {hybrid['kv_groups']['vanilla']} / "
          f"{hybrid['kv_groups']['kvcr']}):")
    _print_rows(hybrid["spread_ms"])
    for name, (op, bound) in TARGETS.items():
        if name not in summary:
            continue
        verdict = "meets" if meets(TARGETS, name, summary[name]) else "MISSES"
        print(f"{name:52} {summary[name]:>7.3f}   target {op} {bound:g}  {verdict}")
    for name in ("ttft_kvcr_p90_over_median", "first_request_ratio_kvcr_vs_vanilla",
                 "first_request_ratio_kvcr_vs_vanilla_beside_guard",
                 "mp_ttft_kvcr_p90_over_median", "mp_first_request_ratio_kvcr_vs_vanilla",
                 "mp_first_request_ratio_kvcr_vs_vanilla_beside_guard",
                 "mp_engine_start_s_vanilla", "mp_engine_start_s_kvcr",
                 "hybrid_ttft_ratio_kvcr_vs_recompute", "hybrid_ttft_ratio_kvcr_vs_local_prefix",
                 "hybrid_kv_blocks_ratio_kvcr_vs_vanilla"):
        if name in summary:
            print(f"{name:52} {summary[name]:>7.3f}")
    if summary["kv_load_gbps"]:
        print(f"{'kv_load_gbps':52} {summary['kv_load_gbps']:>7.2f}")


def _print_rows(spread: dict[str, dict[str, float]]) -> None:
    print(f"    {'case':32} {'min':>8} {'median':>8} {'p90':>8} {'max':>8}")
    for case, label in (("recompute", "(a) recompute"),
                        ("local_prefix", "(b) same-engine prefix hit"),
                        ("kvcr", "(c) cross-engine via kvcr"),
                        ("example_connector", "(d) ExampleConnector (disk)")):
        if case in spread:
            row = spread[case]
            print(f"    {label:32} {row['min']:>8.1f} {row['median']:>8.1f} "
                  f"{row['p90']:>8.1f} {row['max']:>8.1f}")
