"""`kvcr bench serve --quick` end to end: real vLLM OpenAI servers under vLLM's own benchmark
client. Guards the risk that the benchmark measures nothing: every case must have served its
traffic, kvcr's pool must have served prompt tokens across the two engines (and vanilla's
connector none), and the ratios, the targets and the chart must all be produced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcr_vllm import PREFILL_CAP_SCHEDULER

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]


def test_bench_serve_is_a_kvcr_bench_entry_point() -> None:
    """`kvcr bench serve` finds the benchmark: the entry point names a real function."""
    import tomllib

    from kvcr_bench.serve_load import run_serve_bench

    project = tomllib.loads((REPO / "packages/kvcr-bench/pyproject.toml").read_text())
    assert project["project"]["entry-points"]["kvcr.bench"]["serve"] == (
        f"{run_serve_bench.__module__}:{run_serve_bench.__name__}")


@pytest.mark.timeout(1200)  # eight vLLM servers start one pair at a time: minutes on 2 cores
def test_bench_serve_quick_serves_tokens_from_each_cache_and_charts(tmp_path: Path) -> None:
    """Four cases x two levels ran to completion through the proxy; kvcr loaded prompt
    tokens on the engine that did not compute them, without a fault; the c8 ratios and
    target verdicts are in the JSON and the PNG chart is written; each server ran with its
    share of the cores' OpenMP threads (two engines on every core fight for them), and the
    prefill cap, held by kvcr's rule (kvcr_vllm.prefill_cap, loaded by vLLM), reached exactly
    the engines of kvcr's case and of vanilla's second case; the
    guard held its whole pool backed (the steady state the benchmark measures)."""
    out = subprocess.run([sys.executable, "-m", "kvcr_bench.serve_load", "--quick", "--json",
                          "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=1200, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    summary = result["summary"]
    for name in ("p90_ttft_ratio_kvcr_vs_vanilla_c8", "p90_ttft_ratio_kvcr_vs_example_c8",
                 "throughput_ratio_kvcr_vs_vanilla_c8"):
        assert summary[name] > 0
        assert isinstance(result["meets_targets"][name], bool)
    assert summary["later_turns_p90_ttft_ratio_kvcr_vs_vanilla_c8"] > 0
    rows = {(r["case"], r["concurrency"]): r for r in result["rows"]}
    cases = ("vanilla", "vanilla-cap", "kvcr", "example")
    assert set(rows) == {(case, c) for case in cases for c in (1, 8)}
    threads = max(1, (os.cpu_count() or 2) // 2)  # the two servers do not share threads
    for (case, _), row in rows.items():
        assert row["omp_threads_per_server"] == [threads, threads]
        cap = 256 if case in ("vanilla-cap", "kvcr") else None
        assert row["prefill_cap_per_server"] == [cap, cap]
        rule = PREFILL_CAP_SCHEDULER if cap else None  # vLLM loaded kvcr's cap rule in both
        assert row["scheduler_cls_per_server"] == [rule, rule]
        assert row["ttft_p90_ms"] > 0 and row["output_throughput_tok_s"] > 0
        # first (cold) and later turns are told apart: the p90's make-up is visible
        assert 0 < row["first_turns_share"] < 1
        assert row["first_turns_ttft_p90_ms"] >= row["first_turns_ttft_median_ms"] > 0
        assert row["later_turns_ttft_p90_ms"] >= row["later_turns_ttft_median_ms"] > 0
        assert row["tokens"]["prompt"] > 0
        assert row["tokens"]["local_prefix"] > 0  # the shared system prompt, on every engine
    assert summary["kvcr_connector_tokens"] > 0
    assert all(rows[("kvcr", c)]["tokens"]["kvcr_loaded"] > 0 for c in (1, 8))
    assert summary["vanilla_connector_tokens"] == summary["vanilla-cap_connector_tokens"] == 0
    assert summary["vanilla_baseline_p90_c8"] in ("vanilla", "vanilla-cap")
    assert summary["kvcr_failures"] == 0
    # steady state: the guard's whole 2 GiB pool was backed (held resident) before the load
    assert result["guard_back_ahead"] == "2GiB"
    assert all(rows[("kvcr", c)]["guard_pool_resident_kib"] > 0.9 * (2 << 20) for c in (1, 8))
    png = Path(result["chart"]).read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
