"""House rules that CI enforces: ruff clean, strict mypy on kvcr_core, no oversized modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          check=False)


def test_ruff_is_clean() -> None:
    """Lint findings fail CI instead of piling up."""
    out = run(str(BIN / "ruff"), "check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_mypy_strict_on_core() -> None:
    """Every kvcr package type-checks under --strict (pyproject.toml)."""
    out = run(str(BIN / "mypy"), "--config-file", "pyproject.toml", "-p", "kvcr_core",
              "-p", "kvcr_guard", "-p", "kvcr_router", "-p", "kvcr_sglang")
    assert out.returncode == 0, out.stdout + out.stderr


def test_modules_stay_short() -> None:
    """No source module grows past ~600 lines (STYLE.md rule 6; split by role instead)."""
    long = [f"{p.relative_to(REPO)}: {n}" for p in REPO.glob("packages/*/src/**/*.py")
            if (n := len(p.read_text().splitlines())) > 650]
    assert long == []
