"""What users get from `pip install`: the packages build as wheels, and an engine's environment
gets kvcr-core with a connector and nothing else of kvcr's (not the daemon, not the tooling,
no progress-bar or plotting library)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def run(*cmd: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                         timeout=timeout, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels of every kvcr package, built as a release would build them."""
    folder = tmp_path_factory.mktemp("wheels")
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "-w", folder, *sorted(REPO.glob("packages/kvcr-*")))
    return folder


@pytest.mark.parametrize("connector", ["kvcr-vllm", "kvcr-sglang"])
def test_a_connector_installs_kvcr_core_and_nothing_else_of_kvcrs(
        connector: str, wheels: Path, tmp_path: Path) -> None:
    """Risk: every engine process carries the daemon, benchmarks, tqdm or matplotlib because a
    connector depends on them (kvcr-vllm used to pull kvcr-guard and, through kvcr-core,
    tqdm)."""
    names = {p.name.split("-")[0].replace("_", "-") for p in wheels.glob("*.whl")}
    assert names >= {"kvcr-core", "kvcr-guard", "kvcr-vllm", "kvcr-sglang", "kvcr-router",
                     "kvcr-bench"}
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    report = tmp_path / "report.json"
    run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--dry-run",
        "--ignore-installed", "--report", report, "--find-links", wheels, connector)
    installed = {item["metadata"]["name"].lower()
                 for item in json.loads(report.read_text())["install"]}
    assert {connector, "kvcr-core"} <= installed
    assert not installed & {"kvcr-guard", "kvcr-bench", "kvcr-router", "tqdm", "matplotlib",
                            "torch", "vllm", "sglang"}
