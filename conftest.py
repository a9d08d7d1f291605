"""Shared fixtures: a real kvcr-guard daemon, real client processes, short socket dirs.

At the repository root so every package's tests (guard, vLLM, SGLang) can use them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcr_core.testing.ports import free_port

WORKER = str(Path(__file__).parent / "packages" / "kvcr-guard" / "tests" / "guard_worker.py")


class Guard:
    """One daemon process on a short socket path; started and stopped by PID."""

    def __init__(self, tmpdir: str, *extra: str) -> None:
        self.dir = tmpdir
        self.socket = os.path.join(tmpdir, "g.sock")
        self.metrics_port = free_port()
        self.log = open(os.path.join(tmpdir, "guard.log"), "ab")  # noqa: SIM115
        self.args = [sys.executable, "-m", "kvcr_guard", "--socket", self.socket,
                     "--pool-bytes", "32MiB", "--namespace-pool-bytes", "8MiB",
                     "--metrics-port", str(self.metrics_port), *extra]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Guard:
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvcr-guard exited {self.proc.returncode}: {self.logs()}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.socket)
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("kvcr-guard did not start")

    def logs(self) -> str:
        return Path(self.dir, "guard.log").read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=20)

    def metric(self, name: str, **labels: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=10).read().decode()
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
                       if labels else "")
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        raise KeyError(want)

    def settled_metric(self, name: str, want: float, timeout_s: float = 5.0,
                       **labels: str) -> float:
        """The metric once it reached `want` (or its value at the deadline): counters the
        daemon bumps after the work that a client already saw completed (a peer fetch's
        served blocks are counted once the last byte was sent, which the fetcher may have
        read first)."""
        deadline = time.monotonic() + timeout_s
        while (value := self.metric(name, **labels)) < want and time.monotonic() < deadline:
            time.sleep(0.02)
        return value

    def rss_anon_kib(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
        raise KeyError("RssAnon")


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
    if g.proc is not None and g.proc.poll() is None:
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
            if guard.proc is not None and guard.proc.poll() is None:
                guard.proc.kill()
                guard.proc.wait(timeout=30)
            if not guard.log.closed:
                guard.log.close()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.cleanup()
