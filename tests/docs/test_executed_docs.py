"""The task pages' commands run as written, and the outputs they show are real.

A page in EXECUTED is parsed by Sybil: its `bash` blocks run in order in one bash shell (so
variables, functions and background servers carry from block to block, as they would in a
reader's terminal), its `python` blocks in one namespace, and each `output` block must equal
what the block before it printed (`KVCR_DOCS_UPDATE=1` writes them instead, for a
maintainer who changed a page). A command that fails anywhere in a block (bash's ERR trap)
fails the page. As root, the shell gets a network namespace of its own, so the ports a page
uses never meet another test's; everything the page started is killed at the end.

On every page of docs/, every block names its language: commands a reader is told to run
are `bash` (on an executed page) or `sh` (and `python` off an executed page) right after a
sentence saying "Not run in CI" and why; listings and outputs are `text`, `json`, `yaml`..."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("sybil", reason="scripts/setup.sh installs sybil")

from sybil import Example, Sybil
from sybil.parsers.markdown import PythonCodeBlockParser
from sybil.parsers.markdown.codeblock import CodeBlockParser

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
EXECUTED = ["configure-vllm.md", "keys.md"]
BLOCK_TIMEOUT_S = 900


class Shell:
    """One bash process fed block by block; `run` returns what a block printed."""

    def __init__(self) -> None:
        bash = ["bash", "--noprofile", "--norc"]
        if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"):
            bash = ["unshare", "--net", "--", "sh", "-c",
                    "ip link set lo up && exec bash --noprofile --norc"]
        env = {"PATH": f"{REPO / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin",
               "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
               "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
        self.proc = subprocess.Popen(bash, cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.marker = f"__kvcr_docs_{uuid.uuid4().hex}__"
        self._send(f"set -E; trap 'echo \"{self.marker} ERR $BASH_COMMAND\"' ERR")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def run(self, block: str, timeout_s: float = BLOCK_TIMEOUT_S) -> str:
        self._send(f"{block}\necho \"{self.marker} END\"")
        out: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"block still running after {timeout_s:.0f} s:\n{block}\n"
                                     f"printed:\n{''.join(out)}") from None
            if line == "":
                raise AssertionError(f"the shell exited in:\n{block}\nprinted:\n{''.join(out)}")
            if line.startswith(f"{self.marker} ERR"):
                failed = line.split(" ERR ", 1)[1].strip()
                raise AssertionError(f"`{failed}` failed in:\n{block}\nprinted:\n{''.join(out)}")
            if line.startswith(f"{self.marker} END"):
                return "".join(out)
            out.append(line)

    def close(self) -> None:
        """Kills the shell and everything it started (one process group)."""
        for signum in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                break
            time.sleep(3 if signum == signal.SIGTERM else 0)
        self.proc.wait(timeout=30)


class BashBlocks(CodeBlockParser):
    language = "bash"

    def evaluate(self, example: Example) -> None:
        shell: Shell = example.namespace["shell"]
        example.namespace["printed"] = shell.run(example.parsed)


class OutputBlocks(CodeBlockParser):
    language = "output"

    def evaluate(self, example: Example) -> None:
        printed = example.namespace.get("printed")
        assert printed is not None, f"line {example.line}: an output block before any command"
        example.namespace.setdefault("outputs", []).append(printed.rstrip())
        if os.environ.get("KVCR_DOCS_UPDATE"):  # rewriting the page's outputs: nothing checked
            return
        assert printed.rstrip() == example.parsed.rstrip(), (
            f"{example.path} line {example.line}: the page shows\n{example.parsed}\n"
            f"but the command printed\n{printed}")


SYBIL = Sybil(parsers=[BashBlocks(), OutputBlocks(), PythonCodeBlockParser()],
              path=str(DOCS), patterns=["*.md"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page", EXECUTED)
def test_task_page_runs_as_written(page: str) -> None:
    """Risk: a reader follows a task page and a command fails, or prints something else than
    the page shows (a renamed flag, a changed default, a figure nobody re-measured)."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    document = SYBIL.parse(DOCS / page)
    shell = Shell()
    document.namespace["shell"] = shell
    try:
        examples = list(document.examples())
        assert any(e.region.evaluator is not None for e in examples)
        for example in examples:
            example.evaluate()
    finally:
        shell.close()
        if os.environ.get("KVCR_DOCS_UPDATE"):
            rewrite_outputs(DOCS / page, document.namespace.get("outputs", []))


def rewrite_outputs(path: Path, outputs: list[str]) -> None:
    """KVCR_DOCS_UPDATE=1: writes what the commands printed into the page's `output` blocks,
    in order (for a maintainer who changed a page; the diff is theirs to review)."""
    found = iter(outputs)
    pattern = re.compile(r"^```output\n.*?^```$", re.MULTILINE | re.DOTALL)

    def replace(match: re.Match[str]) -> str:
        printed = next(found, None)
        return match.group(0) if printed is None else f"```output\n{printed}\n```"

    path.write_text(pattern.sub(replace, path.read_text()))


FENCE = re.compile(r"^```(\S*)", re.MULTILINE)


def test_commands_are_marked_runnable_or_not() -> None:
    """Risk: a page tells a reader to run a command CI never ran, without saying so, and
    the command rots unnoticed."""
    wrong = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        fences = list(FENCE.finditer(text))
        for opening in fences[::2]:  # opening fences; closings have no language
            language = opening.group(1)
            where = f"{page.name}:{text.count(chr(10), 0, opening.start()) + 1}"
            before = text[max(0, opening.start() - 300):opening.start()]
            not_run = "Not run in CI" in before
            if language == "sh" and not not_run:
                wrong.append(f"{where}: an `sh` block without a 'Not run in CI' sentence")
            if language == "python" and page.name not in EXECUTED and not not_run:
                wrong.append(f"{where}: a `python` block on a page CI does not execute, "
                             "without a 'Not run in CI' sentence")
            if language in ("bash", "output") and page.name not in EXECUTED:
                wrong.append(f"{where}: a `{language}` block on a page CI does not execute")
            if language == "":
                wrong.append(f"{where}: a block without a language (commands are `bash`, run "
                             "in CI, or `sh` after a 'Not run in CI' sentence; anything else "
                             "`text`, `json`, `yaml`...)")
    assert not wrong, "\n".join(wrong)
