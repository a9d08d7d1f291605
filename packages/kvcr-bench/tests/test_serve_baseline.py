"""`kvcr bench serve`'s ratios against vanilla vLLM. Guards the risk that a server setting
which helps kvcr (the prefill cap) flatters kvcr's ratios by hurting the baseline: each
ratio must take vanilla's better figure over the configurations that ran, and a bad cap
or guard margin must be refused with the fix before any server starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcr_bench.serve_load import _summary, vanilla_best


def _row(case: str, p90: float, later_p90: float, tput: float) -> dict[str, Any]:
    tokens = {"local_prefix": 1, "connector": 0 if case != "kvcr" else 5}
    return {"case": case, "concurrency": 8, "ttft_p90_ms": p90,
            "later_turns_ttft_p90_ms": later_p90, "output_throughput_tok_s": tput,
            "tokens": tokens, "kvcr_failures": 0}


@pytest.mark.unit
def test_each_ratio_takes_vanillas_better_configuration() -> None:
    """Vanilla with the cap has the worse p90 but the better later turns, without it the
    better throughput: every kvcr ratio is taken against the better of the two."""
    rows = [_row("vanilla", 1000, 900, 100), _row("vanilla-cap", 1200, 600, 120),
            _row("kvcr", 450, 240, 180), _row("example", 1300, 1100, 80)]
    summary = _summary(rows, (8,))
    assert summary["p90_ttft_ratio_kvcr_vs_vanilla_c8"] == 450 / 1000
    assert summary["vanilla_baseline_p90_c8"] == "vanilla"
    assert summary["later_turns_p90_ttft_ratio_kvcr_vs_vanilla_c8"] == 240 / 600
    assert summary["throughput_ratio_kvcr_vs_vanilla_c8"] == 180 / 120
    assert summary["p90_ttft_ratio_kvcr_vs_example_c8"] == 450 / 1300
    assert vanilla_best(rows, 8, "ttft_p90_ms")["case"] == "vanilla"


@pytest.mark.unit
def test_without_a_cap_the_baseline_is_vanilla_alone() -> None:
    """`--prefill-cap 0` runs no second vanilla case: the baseline is the one that ran."""
    rows = [_row("vanilla", 1000, 900, 100), _row("kvcr", 500, 300, 150),
            _row("example", 1300, 1100, 80)]
    summary = _summary(rows, (8,))
    assert summary["p90_ttft_ratio_kvcr_vs_vanilla_c8"] == 0.5
    assert "vanilla-cap_connector_tokens" not in summary


@pytest.mark.integration
def test_a_negative_cap_is_refused_with_the_fix() -> None:
    """A negative token count names the option and what to give, and starts no server."""
    kvcr = str(Path(sys.executable).parent / "kvcr")
    out = subprocess.run([kvcr, "bench", "serve", "--prefill-cap", "-5"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode != 0
    assert "--prefill-cap -5: give a token count (0: no cap)" in out.stderr


@pytest.mark.integration
def test_a_bad_back_ahead_is_refused_with_the_fix() -> None:
    """A margin that is not a size names the option, the sizes it takes and what the pool
    holds, and starts no server."""
    kvcr = str(Path(sys.executable).parent / "kvcr")
    out = subprocess.run([kvcr, "bench", "serve", "--back-ahead", "lots"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode != 0
    assert "--back-ahead" in out.stderr and "'lots'" in out.stderr
    assert "kvcr-guard's pool is 2GiB" in out.stderr
    assert "bench serve:" not in out.stderr  # no case started
