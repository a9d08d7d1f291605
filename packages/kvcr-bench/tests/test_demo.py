"""The README's main job, as a user runs it (quick variant): real servers, real numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(900)  # the demo's own limit: a loaded machine must not fail it early
def test_demo_quick_reuses_kv_across_engines_and_writes_the_chart(tmp_path: Path) -> None:
    """Two vLLM servers + kvcr-guard: the second engine reuses the first one's prompt KV
    (counted by vLLM's external hit metric), nothing fails, and the chart is written."""
    out = subprocess.run([sys.executable, "-m", "kvcr_bench.demo", "--quick", "--out",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "median TTFT" in out.stdout
    data = json.loads((tmp_path / "demo.json").read_text())
    counters = data["counters"]
    assert counters["vllm:kvcr_loaded_tokens_total"] >= 512
    assert counters["vllm:external_prefix_cache_hits_total"] >= 512
    assert counters["vllm:kvcr_failures_total"] == 0
    kvcr_rows = [r for r in data["rows"] if r["phase"] == "kvcr"]
    assert any(r["kvcr_tokens"] > 0 and r["turn"] == 1 for r in kvcr_rows)
    png = (tmp_path / "ttft.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
