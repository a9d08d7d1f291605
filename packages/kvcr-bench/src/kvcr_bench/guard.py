"""`kvcr bench guard`: the copy path through an attached kvcr-guard pool, the control round
trip and the attach time, each against what it must beat, in one run.

Starts its own `python -m kvcr_guard` daemons on a private socket (kvcr-guard must be
installed). Copy rows come from bench_copy (baseline: memcpy into the same pages, same order,
same run); the client prefaults its mapping first so neither side pays page faults.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvcr_bench.copies import (
    BATCH,
    BLOCK_SIZES,
    MIB,
    checksum_summary,
    measure_copy,
    min_ratio_256k,
    report,
)
from kvcr_bench.processes import GuardProcess
from kvcr_core.attach import AttachClient
from kvcr_core.attach import protocol as p
from kvcr_core.keys import NamespaceSpec
from kvcr_core.memory import SlotPool
from kvcr_core.testing import pattern_block, random_keys

TARGETS = {"min_ratio_vs_memcpy_256k": (">=", 0.85), "batch64_roundtrip_p50_us": ("<=", 150.0),
           "attach_8gib_s": ("<=", 1.0)}


def _spec(block_bytes: int) -> NamespaceSpec:
    return NamespaceSpec(model_id="kvcr-bench", dtype="float32", kv_dtype="float32",
                         block_size_tokens=16, num_layers=1, num_kv_heads=1, head_dim=128,
                         layout="bench", extra={"block_bytes": str(block_bytes)})


@contextlib.contextmanager
def _daemon(pool_bytes: int, namespace_bytes: int) -> Iterator[str]:
    """A private kvcr-guard; yields its socket path, stops it (by PID) on exit."""
    tmp = tempfile.mkdtemp(prefix="kvcrb", dir="/tmp")
    try:
        guard = GuardProcess(Path(tmp), "--pool-bytes", str(pool_bytes),
                             "--namespace-pool-bytes", str(namespace_bytes),
                             "--log-level", "WARNING", socket_name="g.sock")
        try:
            yield guard.socket
        finally:
            guard.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _copy_rows(total: int, reps: int, bar: tqdm) -> list[dict[str, Any]]:
    per_ns = {b: SlotPool.region_bytes_for(reps * (total // b), b) + MIB for b in BLOCK_SIZES}
    rows = []
    with _daemon(sum(per_ns.values()), max(per_ns.values())) as path:
        for block_bytes in BLOCK_SIZES:
            client = AttachClient(path, _spec(block_bytes), block_bytes, identity="bench")
            client.attach()
            client.pool().region.prefault()
            rows.append(measure_copy(client, client.pool(), block_bytes, total, reps))
            client.flush()
            if client.connection.deferred_shortfalls:
                raise RuntimeError("a pipelined commit published nothing")
            client.close()
            bar.update()
    return rows


def _roundtrip_us(iterations: int) -> tuple[float, float]:
    with _daemon(64 * MIB, 64 * MIB) as path:
        client = AttachClient(path, _spec(4096), 4096, identity="bench")
        keys = random_keys(BATCH, seed=5)
        client.store(keys, [pattern_block(k, 4096) for k in keys])
        ops = [p.Lookup(list(keys))]
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            client.batch(ops)
            samples.append(time.perf_counter() - start)
        client.close()
    samples.sort()
    return statistics.median(samples) * 1e6, samples[int(0.99 * len(samples))] * 1e6


def _attach_s(pool_bytes: int) -> tuple[float, float]:
    with _daemon(pool_bytes, pool_bytes) as path:
        times = []
        for _ in range(2):  # first: the daemon creates the namespace's memfd; then map only
            client = AttachClient(path, _spec(2 * MIB), 2 * MIB, identity="bench")
            start = time.perf_counter()
            client.attach()
            times.append(time.perf_counter() - start)
            assert client.pool().region.size_bytes >= pool_bytes - 2 * MIB
            client.close()
    return times[0], times[1]


def run_guard_bench(*, quick: bool, as_json: bool, under_attack: bool = False) -> int:
    if importlib.util.find_spec("kvcr_guard") is None:
        print("kvcr bench guard: kvcr-guard is not installed (install it from this "
              "repository: pip install ./packages/kvcr-guard)",
              file=sys.stderr)
        return 2
    if under_attack:
        from kvcr_bench.guard_attack import run_under_attack

        return run_under_attack(quick=quick, as_json=as_json)
    total = 64 * MIB if quick else 128 * MIB
    reps = 3 if quick else 5
    bar = tqdm(total=len(BLOCK_SIZES) + 2, desc="kvcr bench guard", file=sys.stderr,
               disable=None, leave=False)
    rows = _copy_rows(total, reps, bar)
    p50_us, p99_us = _roundtrip_us(1000 if quick else 5000)
    bar.update()
    first_s, again_s = _attach_s(8 << 30)
    bar.update()
    bar.close()
    summary = {"min_ratio_vs_memcpy_256k": min_ratio_256k(rows), **checksum_summary(rows),
               "batch64_roundtrip_p50_us": p50_us, "batch64_roundtrip_p99_us": p99_us,
               "attach_8gib_s": first_s, "reattach_8gib_s": again_s}
    result = {"bench": "guard", "quick": quick, "batch_blocks": BATCH, "bytes_per_size": total,
              "rows": rows, "summary": summary}
    report(f"kvcr bench guard{' --quick' if quick else ''}: copy through an attached pool, "
           f"{total // MIB} MiB per size, batches of {BATCH}, median of {reps}; control round "
           f"trip of a {BATCH}-key batch; attach to an 8 GiB pool", result, TARGETS,
           as_json=as_json)
    return 0
