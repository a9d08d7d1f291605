"""`kvcr bench sglang` (run in .venv-sglang): HiCache L3 throughput through SGLang's own
controller I/O paths on a real host pool, in one run, for
(a) kvcr zero-copy v1 (`batch_set_v1` / `batch_get_v1`, embedded Runner),
(b) SGLang's built-in `file` backend (its generic path, files in a temporary directory),
(c) memcpy of the same page segments into one preallocated buffer (the floor).

Each batch is SGLang's storage batch (128 pages); every write uses fresh keys (a present page
is not copied again). GB/s = page bytes moved / wall time, median of several batches. The kvcr
pool and the memcpy buffer are both touched before timing (neither pays first-touch faults).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvcr_bench.copies import meets

TARGETS = {"ratio_vs_memcpy_v1": (">=", 0.85), "ratio_vs_file_backend_v1": (">=", 3.0)}
BATCH_PAGES = 128


def _median_gbps(nbytes: int, run: Callable[[int], None], reps: int) -> float:
    times = []
    for rep in range(reps):
        start = time.perf_counter()
        run(rep)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def run_sglang_bench(*, quick: bool, as_json: bool) -> int:
    try:
        import torch
        from sglang.srt.managers.cache_controller import PrefetchOperation
    except ImportError:
        print("kvcr bench sglang: SGLang is not installed here (run it in .venv-sglang: "
              "bash scripts/setup_sglang.sh)", file=sys.stderr)
        return 2
    from kvcr_bench import sglang_rig as cpu_rig
    from kvcr_bench.sglang_rig import KVCR_EXTRA, PoolShape
    from kvcr_sglang.pagestore import copy_segments

    shape = PoolShape(layers=16, heads=4, head_dim=128, page_tokens=32,
                      device_tokens=BATCH_PAGES * 32 * 2)
    reps = 3 if quick else 7
    alloc, dev = cpu_rig.device_pool(shape)
    host = cpu_rig.host_pool(dev, shape, "page_first", ratio=1.0)
    page_bytes = host.get_dummy_flat_data_page().numel() * host.dtype.itemsize
    n = BATCH_PAGES
    nbytes = n * page_bytes
    cpu_rig.fill_pages(host, 0, n, seed=1)
    src = torch.arange(0, n * shape.page_tokens, dtype=torch.int64)
    dst = torch.arange(n * shape.page_tokens, 2 * n * shape.page_tokens, dtype=torch.int64)
    pool_bytes = (reps + 2) * nbytes * 2
    tokens = [list(range(r * 10**6, r * 10**6 + n * shape.page_tokens)) for r in range(reps)]
    keys = [cpu_rig.page_keys(t, shape.page_tokens) for t in tokens]
    op = PrefetchOperation("bench", [])
    rows: dict[str, dict[str, float]] = {}

    kvcr = cpu_rig.controller(alloc, host, shape, extra={
        **KVCR_EXTRA, "interface_v1": 1, "pool_bytes": pool_bytes})
    try:
        backend = kvcr.storage_backend
        backend.store.client.pool().region.prefault()  # as the memcpy floor's buffer: no faults
        rows["kvcr_v1"] = {
            "write_gbps": _median_gbps(nbytes, lambda r: kvcr.page_set_func(keys[r], src), reps),
            "read_gbps": _median_gbps(
                nbytes, lambda r: kvcr.page_get_func(op, keys[r], dst), reps)}
        assert backend.kvcr_stats()["read_pages"] == reps * n, backend.kvcr_stats()
        assert cpu_rig.page_bytes(host, n, 2) == cpu_rig.page_bytes(host, 0, 2)
    finally:
        kvcr.detach_storage_backend()

    with tempfile.TemporaryDirectory(prefix="kvcr-bench-hicache-") as path:
        files = cpu_rig.controller(alloc, host, shape, backend="file",
                                   extra={"file_storage_path": path})
        try:
            rows["file"] = {
                "write_gbps": _median_gbps(
                    nbytes, lambda r: files.page_set_func(keys[r], src), reps),
                "read_gbps": _median_gbps(
                    nbytes, lambda r: files.page_get_func(op, keys[r], dst), reps)}
        finally:
            files.detach_storage_backend()

    segments = backend.pages.segments(src, n)
    floor = torch.zeros(nbytes, dtype=torch.uint8)
    base = floor.data_ptr()

    def copy(_: int, *, out: bool) -> None:  # the same page copy kvcr does, minus kvcr
        for i, page in enumerate(segments):
            copy_segments(base + i * page_bytes, page, into_slot=not out)

    rows["memcpy"] = {"write_gbps": _median_gbps(nbytes, lambda r: copy(r, out=False), reps),
                      "read_gbps": _median_gbps(nbytes, lambda r: copy(r, out=True), reps)}
    ours = rows["kvcr_v1"]
    summary = {
        "ratio_vs_memcpy_v1": min(ours[k] / rows["memcpy"][k] for k in ours),
        "ratio_vs_file_backend_v1": min(ours[k] / rows["file"][k] for k in ours),
        "page_bytes": page_bytes, "batch_pages": n}
    result: dict[str, Any] = {"rows": rows, "summary": summary,
                              "targets": {k: f"{o} {v:g}" for k, (o, v) in TARGETS.items()}}
    result["meets_targets"] = {k: meets(TARGETS, k, summary[k]) for k in TARGETS}
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"kvcr bench sglang{' --quick' if quick else ''}: page_first, {page_bytes >> 10} KiB "
          f"pages, batches of {n}, median of {reps}")
    print(f"{'path':>10} | {'batch_set GB/s':>14} | {'batch_get GB/s':>14}")
    for name, row in rows.items():
        print(f"{name:>10} | {row['write_gbps']:>14.2f} | {row['read_gbps']:>14.2f}")
    print()
    for name, (o, bound) in TARGETS.items():
        verdict = "meets" if result["meets_targets"][name] else "MISSES"
        print(f"{name:28} {summary[name]:>8.2f}   target {o} {bound:g}  {verdict}")
    return 0
