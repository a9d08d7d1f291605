"""`kvcr bench serve`: time to first token and throughput of real vLLM OpenAI servers under
load from vLLM's own benchmark client (`vllm bench serve`), at concurrency 1, 4, 8 and 16.

Four cases, each on two vLLM servers (the same layout, started fresh per case): vanilla
vLLM (each engine its own prefix cache) as vLLM runs by default and with the prefill cap
kvcr's case runs with (below), vLLM + kvcr in guarded mode (both engines attached to one
kvcr-guard pool) and vLLM + ExampleConnector (both engines on one storage folder).
The prefill cap is vLLM's `--long-prefill-token-threshold` (256 tokens unless
`--prefill-cap` says otherwise; 0: none): while other requests wait, a long prefill gets at
most that many tokens per step, so a request whose prompt the cache serves is scheduled
beside a cold prompt's prefill instead of behind all of it. It helps where most prompts are
served from a cache and costs where they are not, so vanilla runs both ways and the ratios
take vanilla's better figure at each level (the lower p90, the higher throughput): a ratio
cannot improve by hurting the baseline. Both capped cases hold the cap by kvcr's rule
(`--cap-rule kvcr`, the default: kvcr_vllm.prefill_cap's scheduler, the cap held only while
another request wants prefill tokens) or by vLLM's own (`--cap-rule vllm`: while any other
request runs, decoding ones included). ExampleConnector serves nothing here (see docs) and
runs as vLLM's default.
kvcr-guard's 2 GiB pool is backed before the load (`--back-ahead` the pool's size, unless
`--back-ahead` says otherwise): the measured part is steady state, and a serving node's pool
is backed for good once it has filled once; backing it during the load is that node's first
fill, which `--back-ahead 256MiB` measures (the guard backs as the pool fills).
The traffic (serve_traffic.py) is multi-turn conversations with long shared prefixes, in
steady state (conversations start out of phase, after an unmeasured warm-up round); a
SplitProxy in front of the two servers sends a user's consecutive turns to alternate
engines, so each later turn lands where its conversation's last turn was not computed.
Each concurrency level runs new conversations (the system prompt stays the same); the
client runs closed loop at that concurrency. The two servers share the host's cores: each
engine runs `cores // 2` OpenMP threads (one here), as several vLLM CPU servers on one host
are run; with a thread per core each, both engines' threads fought for every core under load
(concurrency 8, output tokens/s: vanilla 40 against 55-56, kvcr 53-54 against 87-89).

Per case and level: the client's own TTFT p50/p90/p99 and output token throughput (from its
`--save-result --save-detailed` JSON), and the prompt tokens each cache served, read from
the servers' /metrics before and after (`vllm:prefix_cache_hits` for the engine's own cache,
`vllm:external_prefix_cache_hits` for the connector: kvcr or ExampleConnector). Ratios are
against the baselines of the same run; a PNG charts p90 TTFT against concurrency.
`--quick` runs concurrency 1 and 8 with shorter conversations (CI-sized).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcr_bench.copies import meets
from kvcr_bench.processes import GuardProcess
from kvcr_bench.serve_proxy import SplitProxy
from kvcr_bench.serve_traffic import Shape, Turn, schedule, write_trace
from kvcr_bench.tiny_model import build
from kvcr_bench.vllm_servers import (
    CPU_ENV,
    VllmServer,
    bench_guard,
    start_servers,
)
from kvcr_core.config import parse_size_bytes
from kvcr_core.errors import ConfigError
from kvcr_vllm import PREFILL_CAP_SCHEDULER

CASES = ("vanilla", "vanilla-cap", "kvcr", "example")
VANILLA = ("vanilla", "vanilla-cap")
CAPPED = ("vanilla-cap", "kvcr")
PREFILL_CAP = 256
CAP_RULES = {"kvcr": PREFILL_CAP_SCHEDULER, "vllm": None}  # --cap-rule: --scheduler-cls
GUARD_POOL = "2GiB"  # kvcr-guard's pool in kvcr's case; the model's namespace may take it whole
TARGETS = {"p90_ttft_ratio_kvcr_vs_vanilla_c8": ("<=", 0.5),
           "p90_ttft_ratio_kvcr_vs_example_c8": ("<=", 0.7),
           "throughput_ratio_kvcr_vs_vanilla_c8": (">=", 1.0)}
COUNTERS = {"prompt": "vllm:prompt_tokens_total", "local": "vllm:prefix_cache_hits_total",
            "connector": "vllm:external_prefix_cache_hits_total",
            "kvcr_loaded": "vllm:kvcr_loaded_tokens_total",
            "kvcr_failures": "vllm:kvcr_failures_total"}


@dataclass(frozen=True)
class Setup:
    preset: str
    levels: tuple[int, ...]
    shape: Shape
    requests_min: int = 0
    """Measured requests per level at least (whole conversations' worth of rounds): a p90
    over few requests is one burst of arrivals."""

    def seats(self, concurrency: int) -> int:
        """More users at once than requests in flight, so a user's next turn usually starts
        after the previous one ended."""
        return max(3, concurrency + 1)

    def plans(self) -> dict[str, list[Turn]]:
        """The client's traces by request-id prefix: `w<c>` the warm-up, `c<c>` the measured
        rounds (whole conversations' worth of turns per seat) of concurrency c."""
        out = {}
        for c in self.levels:
            per_seat = self.seats(c) * self.shape.turns
            conversations = max(1, -(-self.requests_min // per_seat))
            rounds = schedule(self.seats(c), self.shape.turns * conversations, self.shape,
                              100_000 * c)
            out[f"w{c}"] = rounds[0]
            out[f"c{c}"] = [turn for row in rounds[1:] for turn in row]
        return out


FULL = Setup("bench", (1, 4, 8, 16), Shape(turns=6, system_chunks=16, document_chunks=32,
                                           question_chunks=2, answer_chunks=2,
                                           output_tokens=16), requests_min=200)
QUICK = Setup("bench", (1, 8), Shape(turns=3, system_chunks=16, document_chunks=16,
                                     question_chunks=1, answer_chunks=1, output_tokens=16))


def _connector(case: str, workdir: Path, guard: GuardProcess | None) -> dict[str, Any] | None:
    if case == "kvcr":
        assert guard is not None
        return {"kv_connector": "KVCRConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"mode": "guarded", "socket": guard.socket}}
    if case == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "shared_storage_path": str(workdir / "example-store")}}
    return None


def _client_args(url: str, model: str, trace: Path, requests: int, concurrency: int,
                 chunk_tokens: int, prefix: str, result: Path) -> list[str]:
    """`vllm bench serve`'s command line for one trace (closed loop at `concurrency`)."""
    return ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", "model", "--tokenizer", model, "--dataset-name", "timed_trace",
            "--dataset-path", str(trace), "--timed-trace-chunk-hash-size", str(chunk_tokens),
            "--no-self-timed", "--no-oversample", "--num-prompts", str(requests),
            "--ignore-eos", "--temperature", "0", "--request-id-prefix", f"{prefix}-",
            "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(result.parent),
            "--result-filename", result.name, "--disable-tqdm", "--seed", "0"]


def _run_clients(case: str, setup: Setup, model: str, plans: dict[str, list[Turn]],
                 servers: list[VllmServer], workdir: Path) -> list[dict[str, Any]]:
    """Every trace through one SplitProxy and one client process; a row per measured one."""

    def route(request_id: str) -> int:
        prefix, index = request_id.rsplit("-", 1)
        return plans[prefix][int(index)].engine

    with SplitProxy([s.url for s in servers], route) as proxy:
        traces = []
        for prefix, turns in plans.items():
            name = f"{case}-{prefix}"
            trace = write_trace(turns, setup.shape, workdir / f"{name}.jsonl")
            traces.append({"args": _client_args(
                proxy.url, model, trace, len(turns), int(prefix[1:]), setup.shape.chunk_tokens,
                prefix, workdir / f"{name}.json"), "counters_path": (
                    str(workdir / f"{name}.counters.json") if prefix[0] == "c" else None)})
        job = workdir / f"{case}.job.json"
        job.write_text(json.dumps({"servers": [s.url for s in servers], "counters": COUNTERS,
                                   "levels": traces}))
        print(f"bench serve: {case}: vllm bench serve at concurrency "
              f"{', '.join(map(str, setup.levels))} ...", file=sys.stderr, flush=True)
        with open(workdir / f"{case}.client.log", "wb") as log:
            # the trace's tokens come from hash(): PYTHONHASHSEED makes them the same each run
            out = subprocess.run([sys.executable, "-m", "kvcr_bench.serve_client", str(job)],
                                 stdout=log, stderr=subprocess.STDOUT, timeout=3600,
                                 env={**os.environ, **CPU_ENV, "PYTHONHASHSEED": "0"},
                                 check=False)
    if out.returncode != 0:
        tail = (workdir / f"{case}.client.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vllm bench serve failed ({out.returncode}): {tail}")
    return [_row(case, c, plans[f"c{c}"], setup, workdir) for c in setup.levels]


def _median_ms(seconds: list[float]) -> float | None:
    return 1000 * sorted(seconds)[len(seconds) // 2] if seconds else None


def _p90_ms(seconds: list[float]) -> float | None:
    """The nearest-rank p90, in ms."""
    ranked = sorted(seconds)
    return 1000 * ranked[max(0, -(-9 * len(ranked) // 10) - 1)] if ranked else None


def _row(case: str, concurrency: int, turns: list[Turn], setup: Setup,
         workdir: Path) -> dict[str, Any]:
    name = f"{case}-c{concurrency}"
    res = json.loads((workdir / f"{name}.json").read_text())
    seen = json.loads((workdir / f"{name}.counters.json").read_text())
    delta = {k: seen["after"][k] - seen["before"][k] for k in COUNTERS}
    if res["completed"] != len(turns) or res.get("failed"):
        raise RuntimeError(f"{name}: {res['completed']} of {len(turns)} requests completed: "
                           f"{[e for e in res.get('errors', []) if e][:3]}")
    if res["input_lens"] != [len(t.hash_ids) * setup.shape.chunk_tokens for t in turns]:
        raise RuntimeError(f"{name}: the client's prompts are not the conversations' turns")
    ttfts = list(zip(res["ttfts"], turns, strict=True))
    first = [s for s, t in ttfts if t.turn == 0]
    later = [s for s, t in ttfts if t.turn > 0]
    return {"case": case, "concurrency": concurrency, "requests": len(turns),
            "ttft_p50_ms": res["p50_ttft_ms"], "ttft_p90_ms": res["p90_ttft_ms"],
            "ttft_p99_ms": res["p99_ttft_ms"], "ttft_mean_ms": res["mean_ttft_ms"],
            "first_turns_ttft_median_ms": _median_ms(first),
            "later_turns_ttft_median_ms": _median_ms(later),
            "first_turns_ttft_p90_ms": _p90_ms(first), "later_turns_ttft_p90_ms": _p90_ms(later),
            "first_turns_share": len(first) / len(ttfts),
            "output_throughput_tok_s": res["output_throughput"],
            "duration_s": res["duration"],
            "tokens": {"prompt": int(delta["prompt"]), "local_prefix": int(delta["local"]),
                       "connector": int(delta["connector"]),
                       "computed": int(delta["prompt"] - delta["local"] - delta["connector"]),
                       "kvcr_loaded": int(delta["kvcr_loaded"])},
            "kvcr_failures": int(delta["kvcr_failures"])}


def _case(case: str, setup: Setup, model: str, plans: dict[str, list[Turn]],
          workdir: Path, prefill_cap: int = PREFILL_CAP,
          back_ahead: str | None = GUARD_POOL, cap_rule: str = "kvcr") -> list[dict[str, Any]]:
    """`back_ahead`: kvcr-guard's --back-ahead (None: nothing backed ahead); `cap_rule`: a
    CAP_RULES key."""
    capped = case in CAPPED and prefill_cap > 0
    print(f"bench serve: {case}: two vLLM servers ...", file=sys.stderr, flush=True)
    # one model on the node: its namespace may take the whole pool (as the manifests run it)
    guard = (bench_guard(workdir, pool_bytes=GUARD_POOL, whole_pool=True,
                          back_ahead=back_ahead) if case == "kvcr" else None)
    try:
        servers = start_servers(model, workdir, [f"{case}-a", f"{case}-b"],
                                _connector(case, workdir, guard), max_num_seqs=16,
                                omp_threads=max(1, (os.cpu_count() or 2) // 2),
                                prefill_cap=prefill_cap if capped else None,
                                scheduler_cls=CAP_RULES[cap_rule] if capped else None)
        try:
            for n, server in enumerate(servers):  # a fresh engine's first request is slow
                server.ttft([10 + n] * 64, max_tokens=2)
            threads = [int(s.environ("OMP_NUM_THREADS") or 0) for s in servers]
            caps = [s.argument("--long-prefill-token-threshold") for s in servers]
            schedulers = [s.argument("--scheduler-cls") for s in servers]
            rows = _run_clients(case, setup, model, plans, servers, workdir)
            held = guard.status_kib("RssShmem") if guard is not None else None
            return [{**row, "omp_threads_per_server": threads,
                     "prefill_cap_per_server": [int(c) if c else None for c in caps],
                     "scheduler_cls_per_server": schedulers,
                     "guard_pool_resident_kib": held} for row in rows]
        finally:
            for server in servers:
                server.stop()
    finally:
        if guard is not None:
            guard.stop()
        shutil.rmtree(workdir / "example-store", ignore_errors=True)


def vanilla_best(rows: list[dict[str, Any]], concurrency: int, key: str,
                 higher: bool = False) -> dict[str, Any]:
    """Vanilla's row at a level with the better `key` (the lower, or the higher) over the
    configurations that ran: the baseline a ratio is taken against."""
    mine = [r for r in rows if r["case"] in VANILLA and r["concurrency"] == concurrency]
    return (max if higher else min)(mine, key=lambda r: r[key])


def _summary(rows: list[dict[str, Any]], levels: tuple[int, ...]) -> dict[str, Any]:
    at = {(r["case"], r["concurrency"]): r for r in rows}
    summary: dict[str, Any] = {}
    for c in levels:
        kvcr, example = at[("kvcr", c)], at[("example", c)]
        p90, later, tput = (vanilla_best(rows, c, "ttft_p90_ms"),
                            vanilla_best(rows, c, "later_turns_ttft_p90_ms"),
                            vanilla_best(rows, c, "output_throughput_tok_s", higher=True))
        summary[f"vanilla_baseline_p90_c{c}"] = p90["case"]
        summary[f"p90_ttft_ratio_kvcr_vs_vanilla_c{c}"] = kvcr["ttft_p90_ms"] / p90[
            "ttft_p90_ms"]
        summary[f"p90_ttft_ratio_kvcr_vs_example_c{c}"] = kvcr["ttft_p90_ms"] / example[
            "ttft_p90_ms"]
        summary[f"throughput_ratio_kvcr_vs_vanilla_c{c}"] = (
            kvcr["output_throughput_tok_s"] / tput["output_throughput_tok_s"])
        # what a cache can serve: the turns after a conversation's first (cold) prompt
        summary[f"later_turns_p90_ttft_ratio_kvcr_vs_vanilla_c{c}"] = (
            kvcr["later_turns_ttft_p90_ms"] / later["later_turns_ttft_p90_ms"])
    for case in sorted({r["case"] for r in rows}, key=CASES.index):
        served = [r["tokens"] for r in rows if r["case"] == case]
        summary[f"{case}_local_prefix_tokens"] = sum(t["local_prefix"] for t in served)
        summary[f"{case}_connector_tokens"] = sum(t["connector"] for t in served)
    summary["kvcr_failures"] = sum(r["kvcr_failures"] for r in rows)
    return summary


def chart(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"vanilla": "vLLM alone (own prefix cache per engine)",
              "vanilla-cap": "vLLM alone, prefill cap",
              "kvcr": "vLLM + kvcr (guarded, one pool for both engines), prefill cap",
              "example": "vLLM + ExampleConnector (one folder for both engines)"}
    styles = {"vanilla": ("#999999", "-"), "vanilla-cap": ("#999999", "--"),
              "kvcr": ("#1f77b4", "-"), "example": ("#ff7f0e", "-")}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for case in CASES:
        mine = sorted((r["concurrency"], r["ttft_p90_ms"]) for r in rows if r["case"] == case)
        if mine:
            colour, line = styles[case]
            ax.plot([c for c, _ in mine], [v for _, v in mine], marker="o", color=colour,
                    linestyle=line, label=labels[case])
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in rows})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests (vllm bench serve --max-concurrency)")
    ax.set_ylabel("p90 time to first token (ms)")
    ax.set_title("Multi-turn shared-prefix chats over two vLLM CPU engines")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_serve_bench(*, quick: bool, as_json: bool, out_dir: str = ".cache/bench-serve",
                    prefill_cap: int = PREFILL_CAP, back_ahead: str = GUARD_POOL,
                    cap_rule: str = "kvcr") -> int:
    if prefill_cap < 0:
        raise SystemExit(f"--prefill-cap {prefill_cap}: give a token count (0: no cap)")
    try:
        ahead = back_ahead if parse_size_bytes("--back-ahead", back_ahead, minimum=0) else None
    except ConfigError as exc:
        raise SystemExit(f"{exc} (kvcr-guard's pool is {GUARD_POOL}: that much backs it all "
                         "before the load, 0 backs nothing ahead)") from None
    setup = QUICK if quick else FULL
    model = str(build(Path(".cache/models") / f"tiny-{setup.preset}", setup.preset))
    plans = setup.plans()
    workdir = Path(tempfile.mkdtemp(prefix="kvcrserve", dir="/tmp"))
    cases = [c for c in CASES if prefill_cap or c != "vanilla-cap"]
    rows = [row for case in cases
            for row in _case(case, setup, model, plans, workdir, prefill_cap, ahead, cap_rule)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = _summary(rows, setup.levels)
    result = {"bench": "serve", "quick": quick, "model_preset": setup.preset,
              "prefill_cap": prefill_cap or None, "cap_rule": cap_rule if prefill_cap else None,
              "guard_pool": GUARD_POOL,
              "guard_back_ahead": back_ahead,
              "shape": asdict(setup.shape), "levels": list(setup.levels), "rows": rows,
              "summary": summary, "chart": str(chart(rows, out / "serve_p90_ttft.png")),
              "logs": str(workdir),
              "targets": {k: f"{op} {v:g}" for k, (op, v) in TARGETS.items()},
              "meets_targets": {k: meets(TARGETS, k, summary[k]) for k in TARGETS}}
    (out / "serve.json").write_text(json.dumps(result, indent=1))
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        _print_tables(result)
    return 0


def _ms(value: float | None) -> str:
    return f"{value:>6.0f}" if value is not None else f"{'-':>6}"


def _print_tables(result: dict[str, Any]) -> None:
    shape, summary = result["shape"], result["summary"]
    k = shape["chunk_tokens"]
    rule = f" (held by {result['cap_rule']}'s rule)" if result["cap_rule"] else ""
    print(f"kvcr bench serve{' --quick' if result['quick'] else ''}: vllm bench serve "
          f"against two vLLM servers per case; conversations of {shape['turns']} turns, "
          f"prompts {shape['system_chunks'] * k} tokens shared + "
          f"{shape['document_chunks'] * k} per user + "
          f"{(shape['question_chunks'] + shape['answer_chunks']) * k} per turn, "
          f"{shape['output_tokens']} output tokens; model preset '{result['model_preset']}'; "
          f"OpenMP threads per server {result['rows'][0]['omp_threads_per_server'][0]} on "
          f"{os.cpu_count()} cores; prefill cap (--long-prefill-token-threshold) "
          f"{result['prefill_cap'] or 'none'} for {' and '.join(CAPPED)}{rule}; kvcr-guard's pool "
          f"{result['guard_pool']}, --back-ahead {result['guard_back_ahead']}")
    print(f"{'case':11} {'conc':>4} {'reqs':>4} | {'TTFT p50':>8} {'p90':>6} {'p99':>6} "
          f"{'new':>6} {'p90':>6} {'later':>6} {'p90':>6} ms | {'out tok/s':>9} | "
          f"{'prompt':>7} {'local':>7} {'conn.':>7} {'computed':>8} | {'p90 vs':>7}")
    for row in sorted(result["rows"], key=lambda r: (r["concurrency"], CASES.index(r["case"]))):
        t = row["tokens"]
        base = vanilla_best(result["rows"], row["concurrency"], "ttft_p90_ms")
        print(f"{row['case']:11} {row['concurrency']:>4} {row['requests']:>4} | "
              f"{row['ttft_p50_ms']:>8.0f} {row['ttft_p90_ms']:>6.0f} {row['ttft_p99_ms']:>6.0f} "
              f"{_ms(row['first_turns_ttft_median_ms'])} {_ms(row['first_turns_ttft_p90_ms'])} "
              f"{_ms(row['later_turns_ttft_median_ms'])} {_ms(row['later_turns_ttft_p90_ms'])}"
              "    | "
              f"{row['output_throughput_tok_s']:>9.1f} | {t['prompt']:>7} "
              f"{t['local_prefix']:>7} {t['connector']:>7} {t['computed']:>8} | "
              f"{row['ttft_p90_ms'] / base['ttft_p90_ms']:>6.2f}x")
    print("(new / later: median and p90 TTFT of conversations' first turns (cold prompts no "
          "cache can serve) / of later turns, each on the engine that did not serve the "
          "previous turn; p90 vs: against vanilla's better p90 at that concurrency, with or "
          "without the cap; each ratio below takes vanilla's better figure)")
    for name, (op, bound) in TARGETS.items():
        verdict = "PASS" if meets(TARGETS, name, summary[name]) else "MISS"
        print(f"{name:40} {summary[name]:>7.3f}   target {op} {bound:g}  {verdict}")
    for c in result["levels"]:
        name = f"later_turns_p90_ttft_ratio_kvcr_vs_vanilla_c{c}"
        print(f"{name:48} {summary[name]:>7.3f}")
    print(f"kvcr failures: {summary['kvcr_failures']}   chart: {result['chart']}   "
          f"logs: {result['logs']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 8, short chats")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", default=".cache/bench-serve", help="where the chart and JSON go")
    ap.add_argument("--prefill-cap", type=int, default=PREFILL_CAP, metavar="TOKENS",
                    help="vLLM's --long-prefill-token-threshold for kvcr's engines (and a "
                    f"second vanilla case); 0: none (default {PREFILL_CAP})")
    ap.add_argument("--back-ahead", default=GUARD_POOL, metavar="SIZE",
                    help=f"kvcr-guard's --back-ahead (its pool is {GUARD_POOL}; default: all "
                    "of it before the load, steady state; 256MiB: backed as it fills, a node's "
                    "first fill)")
    ap.add_argument("--cap-rule", choices=sorted(CAP_RULES), default="kvcr",
                    help="when the capped cases hold the cap: kvcr (default; only while "
                    "another request wants prefill tokens) or vllm (while any other runs)")
    args = ap.parse_args(argv)
    return run_serve_bench(quick=args.quick, as_json=args.json, out_dir=args.out,
                           prefill_cap=args.prefill_cap, back_ahead=args.back_ahead,
                           cap_rule=args.cap_rule)


if __name__ == "__main__":
    sys.exit(main())
