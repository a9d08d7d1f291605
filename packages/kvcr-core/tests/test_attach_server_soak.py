"""Soak: 4 client processes, random operations for 60 s, random SIGKILLs and restarts."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest

from kvcr_core.attach import AttachClient
from kvcr_core.keys import NamespaceSpec

pytestmark = pytest.mark.integration

BLOCK = 16384
SPEC = NamespaceSpec(model_id="tiny", dtype="float32", kv_dtype="float32", block_size_tokens=16,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/guard")
SOAK_S = 60
CLIENTS = 4


@pytest.mark.slow
def test_soak_with_kills_has_no_corruption_leaks_or_growth(short_tmp, harness) -> None:
    """Zero corrupted reads, zero leaked leases/slots, consistent accounting, flat memory."""
    guard = harness.Guard(short_tmp, "--namespace-pool-bytes", "4MiB").start()  # forces eviction
    rng = random.Random(2026)
    end = time.monotonic() + SOAK_S
    seeds = list(range(CLIENTS))
    workers: list[subprocess.Popen[str]] = [
        harness.start_worker(guard, "soak", seed, SOAK_S) for seed in seeds]
    finished: list[subprocess.Popen[str]] = []
    kills = 0
    rss_warm = None
    while time.monotonic() < end - 3:
        time.sleep(rng.uniform(0.5, 2.0))
        if rss_warm is None and time.monotonic() > end - SOAK_S + 10:
            rss_warm = guard.rss_anon_kib()
        for w in workers:
            assert w.poll() in (None, 0), f"worker exited {w.returncode}: {w.stderr.read()}"
        victim = rng.randrange(CLIENTS)
        if not os.path.exists(f"{guard.socket}.attached.{seeds[victim]}"):
            continue  # still starting (a loaded machine): a kill now would test nothing
        workers[victim].send_signal(signal.SIGKILL)
        workers[victim].wait(timeout=10)
        kills += 1
        left = max(1, int(end - time.monotonic()))
        seeds[victim] = 100 + kills
        workers[victim] = harness.start_worker(guard, "soak", seeds[victim], left)
    finished = workers
    reports = []
    for w in finished:
        out, err = w.communicate(timeout=SOAK_S + 30)
        assert w.returncode == 0, f"worker failed {w.returncode} (3 = corrupted read): {err}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert kills >= 15
    assert sum(r["reads"] for r in reports) > 0 and sum(r["stores"] for r in reports) > 0

    observer = AttachClient(guard.socket, SPEC, BLOCK)
    stats = observer.stats()
    assert stats.filling_blocks == 0 and stats.open_reservations == 0
    assert stats.leased_slots == 0 and stats.open_leases == 0
    assert stats.ready_blocks + stats.free_slots == stats.capacity_slots
    assert stats.evictions > 0
    observer.close()
    assert rss_warm is not None
    growth_kib = guard.rss_anon_kib() - rss_warm
    assert growth_kib < 8 * 1024, f"daemon anonymous memory grew {growth_kib} KiB"
    assert guard.metric("kvcr_guard_connections_closed_total", reason="client_died") + \
        guard.metric("kvcr_guard_connections_closed_total", reason="eof") >= kills
    assert guard.stop() == 0
    guard.log.close()
