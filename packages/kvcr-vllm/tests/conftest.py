"""Fixtures for kvcr-vllm tests: a runner for real vLLM engine processes (the tiny local
model, `tiny_model`, is a root conftest fixture shared with the router tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
ENGINE_ARGS = [sys.executable, "-m", "kvcr_bench.vllm_probe"]


EngineRun = Callable[..., list[dict[str, Any]]]


@pytest.fixture
def run_engine(tiny_model: str) -> EngineRun:
    """Runs one engine process to completion; returns its JSON lines."""

    def run(connector: str, requests: list[dict[str, Any]], extra: dict[str, Any] | None = None,
            **job: Any) -> list[dict[str, Any]]:
        spec = {"model": tiny_model, "connector": connector, "extra": extra or {},
                "requests": requests, **job}
        out = subprocess.run([*ENGINE_ARGS, "-"], input=json.dumps(spec), capture_output=True,
                             text=True, timeout=600, check=False)
        assert out.returncode == 0, out.stderr[-4000:]
        return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

    return run


@pytest.fixture
def start_engine(tiny_model: str) -> Callable[..., subprocess.Popen[str]]:
    def start(connector: str, requests: list[dict[str, Any]], extra: dict[str, Any],
              **job: Any) -> subprocess.Popen[str]:
        spec = {"model": tiny_model, "connector": connector, "extra": extra,
                "requests": requests, **job}
        proc = subprocess.Popen([*ENGINE_ARGS, "-"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        return proc

    return start


@pytest.fixture
def guard(short_tmp: str, harness: Any) -> Any:
    """A kvcr-guard with room for the tiny model's blocks (128 KiB each)."""
    g = harness.Guard(short_tmp, "--pool-bytes", "512MiB", "--namespace-pool-bytes",
                      "256MiB").start()
    yield g
    if g.proc is not None and g.proc.poll() is None:
        assert g.stop() == 0, g.logs()
    g.log.close()
