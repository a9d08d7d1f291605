"""Every SGLang command line of docs/sglang.md goes through SGLang 0.5.23's own argument parser
and checks (`ServerArgs`), then through kvcr-sglang's settings, in .venv-sglang (SGLang needs
another torch build than .venv's vLLM), by tests/deploy/sglang_cmdline.py, the helper the
manifests' command lines go through."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from kvcr_core.testing.setup import missing_setup

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "tests" / "deploy" / "sglang_cmdline.py"
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
LAUNCH = ["python", "-m", "sglang.launch_server"]
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def sglang_command_lines(page: str) -> list[list[str]]:
    """The page's `sh` commands that start SGLang, split as the shell splits them (with the
    placeholder model path `...` made a path)."""
    lines = []
    for block in SH_BLOCK.findall((REPO / "docs" / page).read_text()):
        argv = shlex.split(block.replace("\\\n", " "))
        if argv[:3] == LAUNCH:
            lines.append(["/models/placeholder" if a == "..." else a for a in argv[3:]])
    return lines


@pytest.mark.parametrize(("index", "module"), [(0, "kvcr_sglang.hicache"),
                                               (1, "kvcr_sglang.linker")])
def test_the_sglang_pages_flags_parse_through_sglang_and_kvcr_sglang(index: int,
                                                                     module: str) -> None:
    """Risk: docs/sglang.md shows flags SGLang refuses at start (the linker config once came as
    `@FILE`, which SGLang 0.5.23 rejects with "invalid loads value"), or a config kvcr-sglang
    refuses or does not load."""
    if not SGLANG_PYTHON.exists():
        missing_setup(".venv-sglang is missing: run bash scripts/setup_sglang.sh")
    argv = sglang_command_lines("sglang.md")
    assert len(argv) == 2, argv  # the HiCache backend, then the linker
    run = subprocess.run([str(SGLANG_PYTHON), str(HELPER), *argv[index]], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR":
                              str(REPO / ".cache" / "torch_extensions")})
    assert run.returncode == 0, run.stderr[-3000:]
    parsed = json.loads(run.stdout.strip().splitlines()[-1])
    assert parsed["module"] == module
    assert parsed["mode"] == "guarded" and parsed["socket"] == "/run/kvcr/guard.sock"
