"""The guard client's pipelined calls against a real daemon: ordering, bounds, reclaim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvcr_core.attach import AttachClient, RunnerUnavailable
from kvcr_core.checksums import block_checksum
from kvcr_core.keys import NamespaceSpec
from kvcr_core.testing import pattern_block, random_keys

pytestmark = pytest.mark.integration

BLOCK = 16384
SPEC = NamespaceSpec(model_id="tiny", dtype="float32", kv_dtype="float32", block_size_tokens=16,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/guard")


def test_requests_in_flight_resolve_in_any_order(guard) -> None:
    """Several submitted requests each get their own reply, whichever is awaited first."""
    client = AttachClient(guard.socket, SPEC, BLOCK)
    a, b = random_keys(3, seed=1), random_keys(2, seed=2)
    ra, rb = client.reserve_async(a), client.reserve_async(b)
    res_b, res_a = rb.result(), ra.result()
    assert (res_a.granted, res_b.granted) == (3, 2)
    assert set(res_a.slots).isdisjoint(res_b.slots)
    for keys, res in ((a, res_a), (b, res_b)):
        for key, slot in zip(keys, res.slots, strict=True):
            client.pool().write(slot, pattern_block(key, BLOCK))
        client.commit_nowait(res.op, checksums=[block_checksum(pattern_block(k, BLOCK))
                                                for k in keys])
    lease = client.acquire_async(a + b, prefix_only=False).result()  # sees the nowait commits
    assert lease.granted == 5
    client.release_nowait(lease.op)
    client.flush()
    assert client.stats().open_leases == 0 and client.connection.deferred_shortfalls == 0
    client.close()


def test_many_nowait_calls_stay_bounded(guard) -> None:
    """Thousands of fire-and-forget calls never pile up unread replies (no deadlock)."""
    client = AttachClient(guard.socket, SPEC, BLOCK)
    keys = random_keys(1, seed=3)
    client.store(keys, [pattern_block(keys[0], BLOCK)])
    for _ in range(2000):
        client.release_nowait(client.acquire(keys).op)
        assert len(client.connection._owed) <= 32
    client.flush()
    assert client.stats().open_leases == 0
    client.close()


def test_deferred_commit_of_a_reclaimed_op_is_counted_not_published(guard) -> None:
    """A nowait commit the daemon cannot honour publishes nothing and is counted."""
    client = AttachClient(guard.socket, SPEC, BLOCK)
    keys = random_keys(2, seed=4)
    res = client.reserve(keys)
    client.abort(res.op)
    client.commit_nowait(res.op, checksums=[0, 0])
    client.flush()
    assert client.connection.deferred_shortfalls == 1 and client.lookup(keys) == 0
    client.close()


def test_pending_request_fails_typed_when_daemon_dies(short_tmp, harness) -> None:
    """An in-flight request whose daemon dies raises RunnerUnavailable, never hangs."""
    guard = harness.Guard(short_tmp).start()
    client = AttachClient(guard.socket, SPEC, BLOCK, timeout_s=1.0)
    client.attach()
    pending = [client.reserve_async(random_keys(1, seed=s)) for s in range(5)]
    guard.stop(9)  # some may have been answered before the kill, some not
    start = time.monotonic()
    outcomes = []
    for handle in pending:
        try:
            outcomes.append(handle.result().granted)
        except RunnerUnavailable:
            outcomes.append(-1)
    assert time.monotonic() - start < 3.0
    assert all(o in (1, -1) for o in outcomes)
    with pytest.raises(RunnerUnavailable):
        client.reserve(random_keys(1, seed=9))
    client.close()
    guard.log.close()


@pytest.mark.slow
def test_bench_guard_quick_json_reports_every_summary_figure() -> None:
    """`kvcr bench guard --quick --json` runs its own daemons and reports the summary."""
    kvcr = os.path.join(os.path.dirname(sys.executable), "kvcr")
    out = subprocess.run([kvcr, "bench", "guard", "--quick", "--json"], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)["summary"]
    for name in ("min_ratio_vs_memcpy_256k", "batch64_roundtrip_p50_us", "attach_8gib_s"):
        assert summary[name] > 0
