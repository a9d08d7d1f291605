"""scripts/gpu_check.sh, the GPU checks a GPU machine runs with torch alone. CI has no GPU, so
this only guards the plumbing. Risk: the script rots between GPU runs (a moved test file, a
PYTHONPATH that misses a package, a bench it cannot start), and the first GPU machine lent
spends its time on that instead of on measurements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch", reason="the GPU checks need torch")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_its_tests_and_bench_and_says_there_is_no_gpu(tmp_path: Path) -> None:
    """Without CUDA: every test the script names runs (the CUDA ones skip with their reason),
    the bench refuses with a clear message, the script exits 3, and its one JSON file says
    all of that."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: run scripts/gpu_check.sh itself")
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    assert out.returncode == 3, out.stdout + out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["gpu-check.json"]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    tests = result["tests"]
    assert tests["passed"] > 0 and tests["failure"] == tests["error"] == 0
    assert "needs a CUDA device" in tests["log_tail"]
    assert result["bench_exit"] == 2 and result["bench"] is None
    assert "no CUDA device" in out.stderr
