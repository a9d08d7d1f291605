"""Child processes of the benchmarks, the demo and the tests, stopped by PID: `Process` (any
command, with its log file) and `GuardProcess`, the one way a kvcr-guard daemon is started
outside production (with this checkout's code, on a short socket path, ready when its
socket answers). Every child gets SIGTERM if the process that started it dies first.

Threading: one owner thread per object.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def _die_with_parent() -> None:
    """In the child: SIGTERM when the process that started it dies (Linux PR_SET_PDEATHSIG),
    so a killed demo, benchmark or test never leaves engines or daemons behind."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class Process:
    """A child process with its log file, stopped by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self.log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})},
                                     preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def environ(self, name: str) -> str | None:
        """The running process's own value of environment variable `name` (Linux /proc)."""
        for entry in Path(f"/proc/{self.proc.pid}/environ").read_bytes().split(b"\0"):
            key, _, value = entry.partition(b"=")
            if key.decode(errors="replace") == name:
                return value.decode(errors="replace")
        return None

    def argument(self, flag: str) -> str | None:
        """The value after `flag` on the running process's own command line (Linux /proc)."""
        args = Path(f"/proc/{self.proc.pid}/cmdline").read_bytes().split(b"\0")
        for given, value in itertools.pairwise(args):
            if given.decode(errors="replace") == flag:
                return value.decode(errors="replace")
        return None

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def status_kib(self, field: str) -> int:
        """A memory figure of the running process (/proc status: RssShmem, RssAnon...)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def signal(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        """Sends `sig` (if still running) and returns the exit code."""
        if self.alive():
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 30) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log_file.close()


class GuardProcess(Process):
    """`kvcr-guard --socket DIR/guard.sock FLAGS...`, started and waited for at once."""

    def __init__(self, workdir: Path, *flags: str, env: dict[str, str] | None = None,
                 socket_name: str = "guard.sock", metrics_port: int | None = None,
                 ready_s: float = 30, wrap: Sequence[str] = ()) -> None:
        """`wrap`: a command the daemon runs under (`prlimit --nofile=48:48`...)."""
        self.socket = str(workdir / socket_name)
        self.metrics_port = metrics_port
        metrics = ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
        super().__init__([*wrap, sys.executable, "-m", "kvcr_guard", "--socket", self.socket,
                          *metrics, *flags], workdir / "guard.log", env)
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                s.connect(self.socket)
                return
            if not self.alive():
                break
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"kvcr-guard did not start: {self.tail()}")

    def metrics_text(self) -> str:
        assert self.metrics_port is not None, "started without --metrics-port"
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=10) as answer:
            text: str = answer.read().decode()
        return text

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the daemon's /metrics (KeyError if absent)."""
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
                       if labels else "")
        for line in self.metrics_text().splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        raise KeyError(want)

    def settled_metric(self, name: str, want: float, timeout_s: float = 5.0,
                       **labels: str) -> float:
        """The metric once it reached `want` (or its value at the deadline): counters the
        daemon bumps after the work that a client already saw completed."""
        deadline = time.monotonic() + timeout_s
        while (value := self.metric(name, **labels)) < want and time.monotonic() < deadline:
            time.sleep(0.02)
        return value
