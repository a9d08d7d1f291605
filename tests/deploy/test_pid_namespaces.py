"""kvcr-guard and an engine in sibling PID namespaces, as two containers of a pod without
shareProcessNamespace: the guard cannot see the engine's pid (SO_PEERCRED gives 0, so no
pidfd), and still reclaims a killed engine's reservations, by its socket's EOF. This is the
behaviour docs/kubernetes-guard.md relies on when it keeps the PID namespaces apart."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "packages" / "kvcr-core" / "tests" / "attach_worker.py"

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="new PID namespaces need root and unshare (util-linux); CI runs as root")]


def test_guard_reclaims_a_killed_engine_in_a_sibling_pid_namespace(short_tmp) -> None:
    """Risk: with separate PID namespaces (the pods' default) the guard never notices a dead
    engine, so its reserved (FILLING) blocks stay held forever."""
    from kvcr_bench.processes import GuardProcess
    from kvcr_core.attach import AttachClient
    from kvcr_core.keys import NamespaceSpec

    guard = GuardProcess(Path(short_tmp), "--pool-bytes", "32MiB", "--namespace-pool-bytes",
                         "8MiB", socket_name="g.sock",
                         wrap=["unshare", "--pid", "--fork", "--kill-child"])  # its own PID 1
    sock = guard.socket
    worker = None
    try:
        worker = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", sys.executable, str(WORKER), sock,
             "hang-writing", "7", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert worker.stdout is not None
        assert b"reserved" in worker.stdout.readline(), worker.stderr
        spec = NamespaceSpec(model_id="tiny", dtype="float32", kv_dtype="float32",
                             block_size_tokens=16, num_layers=2, num_kv_heads=2, head_dim=64,
                             layout="test/guard")  # attach_worker.py's namespace
        observer = AttachClient(sock, spec, 16384, identity="observer")
        assert observer.stats().filling_blocks == 4
        worker.kill()  # unshare dies; --kill-child takes the worker with it
        worker.wait(timeout=10)
        deadline = time.monotonic() + 10
        while observer.stats().filling_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert observer.stats().filling_blocks == 0
        observer.close()
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(timeout=10)
        guard.stop()
    log = guard.tail(100_000)
    assert "(pid 0, " in log and "worker-hang-writing) closed: eof" in log, log
