"""Shared fixtures: a real kvcr-guard daemon, real client processes, short socket dirs.

At the repository root so every package's tests (guard, vLLM, SGLang) can use them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from kvcr_bench.processes import GuardProcess
from kvcr_core.testing.ports import free_port

WORKER = str(Path(__file__).parent / "packages" / "kvcr-core" / "tests" / "attach_worker.py")


class Guard:
    """One kvcr-guard daemon for a test (kvcr_bench's `GuardProcess`, the one way tests,
    benchmarks and the demo start it), on a short socket path with a 32 MiB pool and its
    metrics on a free port; `start()` starts it and waits for its socket."""

    def __init__(self, tmpdir: str, *extra: str) -> None:
        self.dir = tmpdir
        os.makedirs(tmpdir, exist_ok=True)
        self.socket = os.path.join(tmpdir, "g.sock")
        self.metrics_port = free_port()
        self.extra = extra
        self.wrap: list[str] = []  # a command to run the daemon under (prlimit...)
        self.daemon: GuardProcess | None = None

    def start(self) -> Guard:
        self.daemon = GuardProcess(Path(self.dir), "--pool-bytes", "32MiB",
                                   "--namespace-pool-bytes", "8MiB", *self.extra,
                                   socket_name="g.sock", metrics_port=self.metrics_port,
                                   wrap=self.wrap)
        return self

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.daemon is not None, "start() it first"
        return self.daemon.proc

    @property
    def log(self) -> IO[bytes]:
        assert self.daemon is not None, "start() it first"
        return self.daemon.log_file

    def logs(self) -> str:
        return Path(self.dir, "guard.log").read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.daemon is not None
        return self.daemon.signal(sig, timeout_s=20)

    def metric(self, name: str, **labels: str) -> float:
        assert self.daemon is not None
        return self.daemon.metric(name, **labels)

    def settled_metric(self, name: str, want: float, timeout_s: float = 5.0,
                       **labels: str) -> float:
        assert self.daemon is not None
        return self.daemon.settled_metric(name, want, timeout_s, **labels)

    def rss_anon_kib(self) -> int:
        assert self.daemon is not None
        return self.daemon.status_kib("RssAnon")


def run_worker(guard: Guard, mode: str, *args: int, timeout: float = 60) -> dict[str, int]:
    out = subprocess.run([sys.executable, WORKER, guard.socket, mode, *map(str, args)],
                         capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"worker {mode} failed {out.returncode}: {out.stderr}"
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def start_worker(guard: Guard, mode: str, *args: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, WORKER, guard.socket, mode, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """kvcr-vllm's `test` model preset (random weights, local tokenizer, no hub), built under
    .cache/ once; a file lock serialises xdist workers."""
    import fcntl

    from kvcr_bench.tiny_model import build

    cache = Path(__file__).parent / ".cache" / "models"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return str(build(cache / "tiny-test", "test"))


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A short directory for Unix sockets (AF_UNIX paths are limited to ~107 bytes)."""
    path = tempfile.mkdtemp(prefix="kg", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def guard(short_tmp: str) -> Iterator[Guard]:
    g = Guard(short_tmp).start()
    yield g
    if g.proc.poll() is None:
        assert g.stop() == 0, g.logs()
    g.log.close()


class Harness:
    """Starts daemons and client processes for one test and kills whatever is still running
    when the test ends, pass or fail (conftest is not importable as a module, so tests get
    this object from the `harness` fixture)."""

    run_worker = staticmethod(run_worker)

    def __init__(self) -> None:
        self._guards: list[Guard] = []
        self._procs: list[subprocess.Popen[str]] = []

    def Guard(self, tmpdir: str, *extra: str) -> Guard:
        guard = Guard(tmpdir, *extra)
        self._guards.append(guard)
        return guard

    def start_worker(self, guard: Guard, mode: str, *args: int) -> subprocess.Popen[str]:
        proc = start_worker(guard, mode, *args)
        self._procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        for guard in self._guards:
            if guard.daemon is not None:
                if guard.daemon.alive():
                    guard.daemon.proc.kill()
                guard.daemon.stop()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.cleanup()
