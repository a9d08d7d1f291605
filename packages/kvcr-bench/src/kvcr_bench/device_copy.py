"""`kvcr bench copy [--device auto|cpu|cuda]`: kvcr's copy engine between the pool and KV
tensors on a device, against one copy of the same bytes in the same run, both directions
(save: KV -> pool, load: pool -> KV), for 256 KiB, 1 MiB and 2 MiB blocks.

- kvcr: `block_pairs` + `CopyEngine.copy` + `record().wait()`, exactly what the vLLM worker
  runs (with `--device cuda`: the pool mapping pinned with cudaHostRegister, copies on the
  engine's stream, strided runs through cudaMemcpy2DAsync when found). Blocks come in runs of
  16 consecutive block ids into consecutive slots, in two layouts: `whole` (a block is one
  page) and `paged` (a block is 32 KiB pages of separate planes, as vLLM's K and V per layer).
- baseline: one `copy_` of all those bytes between a contiguous device tensor and a pinned
  host tensor (`--device cuda`: one cudaMemcpyAsync from torch's own pinned allocator), or
  between two host tensors (`--device cpu`: one memcpy; torch on one thread for both, as
  `kvcr bench pool` measures one core: idle OpenMP threads on a busy machine dominate).
Ratios are baseline time / kvcr time (1.0 = as fast as one pinned copy). Targets (CUDA): at
least 0.9 both ways. Needs torch only (and kvcr-core): `python -m kvcr_bench.device_copy`
runs it where kvcr's entry points are not installed (scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcr_bench.copies import KIB, MIB, meets
from kvcr_core.copyengine import CopyEngine, block_pairs, engine_for
from kvcr_core.memory import SlotPool
from kvcr_core.types import SlotId

BLOCK_SIZES = (256 * KIB, MIB, 2 * MIB)
PAGE_BYTES = 32 * KIB
RUN_BLOCKS = 16
TARGETS = {"min_save_ratio": (">=", 0.9), "min_load_ratio": (">=", 0.9)}


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _kvcr(engine: CopyEngine, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    engine.copy(pairs)
    engine.record().wait()


def _measure(engine: CopyEngine, runs: dict[str, Callable[[], object]],
             sync: Callable[[], None], reps: int) -> dict[str, float]:
    """Median seconds of each run, interleaved so kvcr and its baseline see the same machine
    state, after one untimed round (first touches, lazy CUDA set-up)."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            times[name].append(_timed(fn, sync))
    return {k: statistics.median(v) for k, v in times.items()}


def _row(engine: CopyEngine, device: torch.device, block_bytes: int, page_bytes: int,
         total_bytes: int, reps: int) -> dict[str, Any]:
    n = total_bytes // block_bytes
    pool = SlotPool.create(n, block_bytes)
    pool.region.prefault()
    med, checked = _on_pool(engine, pool, device, page_bytes, reps)
    pool.close()  # every view of it went with _on_pool
    gb = n * block_bytes / 1e9
    return {"block_bytes": block_bytes, "layout": "whole" if page_bytes == block_bytes
            else "paged", "page_bytes": page_bytes, "blocks": n, "checked": checked,
            "save_gbps": gb / med["save"], "save_baseline_gbps": gb / med["save_base"],
            "save_ratio": med["save_base"] / med["save"],
            "load_gbps": gb / med["load"], "load_baseline_gbps": gb / med["load_base"],
            "load_ratio": med["load_base"] / med["load"]}


def _on_pool(engine: CopyEngine, pool: SlotPool, device: torch.device, page_bytes: int,
             reps: int) -> tuple[dict[str, float], bool]:
    """Median seconds of each run on `pool` (all its slots), and whether a saved block's
    slot holds its pages."""
    n, block_bytes = pool.capacity_slots, pool.slot_bytes
    flat = engine.pin_pool(pool.region)
    rows = flat[:n * pool.stride_bytes].view(n, pool.stride_bytes)
    block_ids = [b + b // RUN_BLOCKS for b in range(n)]  # runs of 16, one block apart
    gen = torch.Generator(device=device).manual_seed(block_bytes)
    planes = [(torch.randint(0, 256, (block_ids[-1] + 1, page_bytes), generator=gen,
                             dtype=torch.uint8, device=device), i * page_bytes, page_bytes)
              for i in range(block_bytes // page_bytes)]
    save = block_pairs(planes, rows, block_ids, range(n), into_pool=True)
    load = block_pairs(planes, rows, block_ids, range(n), into_pool=False)
    cuda = device.type == "cuda"
    host = torch.empty(n * block_bytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(n * block_bytes, dtype=torch.uint8, device=device)
    med = _measure(engine, {
        "save": lambda: _kvcr(engine, save),
        "save_base": lambda: host.copy_(dev, non_blocking=cuda),
        "load": lambda: _kvcr(engine, load),
        "load_base": lambda: dev.copy_(host, non_blocking=cuda),
    }, torch.cuda.synchronize if cuda else (lambda: None), reps)
    _kvcr(engine, save)
    last = b"".join(p[block_ids[-1]].cpu().numpy().tobytes() for p, _, _ in planes)
    checked = bytes(pool.view(SlotId(n - 1))) == last
    engine.unpin_pool(flat)
    return med, checked


def _device(name: str) -> torch.device | None:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        print("kvcr bench copy --device cuda: no CUDA device (torch.cuda.is_available() is "
              f"False; torch {torch.__version__}). Run it on a GPU machine with a CUDA torch, "
              "or use --device cpu.", file=sys.stderr)
        return None
    return torch.device(name)


def run_copy_bench(*, quick: bool, as_json: bool, device: str = "auto") -> int:
    dev = _device(device)
    if dev is None:
        return 2
    total = (8 if quick else 256) * MIB
    reps = 2 if quick else 7
    engine = engine_for(dev)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    rows = [_row(engine, dev, block, page, total, reps) for block in BLOCK_SIZES
            for page in (block, PAGE_BYTES)]
    summary = {"min_save_ratio": min(r["save_ratio"] for r in rows),
               "min_load_ratio": min(r["load_ratio"] for r in rows),
               "all_checked": all(r["checked"] for r in rows)}
    result: dict[str, Any] = {
        "bench": "copy", "device": str(dev), "engine": type(engine).__name__, "quick": quick,
        "torch": torch.__version__, "bytes_per_row": total, "reps": reps,
        "memcpy2d": getattr(engine, "memcpy2d", None) is not None,
        "pin_failures": engine.pin_failures, "rows": rows, "summary": summary}
    targets = TARGETS if dev.type == "cuda" else {}
    result["targets"] = {k: f"{op} {v:g}" for k, (op, v) in targets.items()}
    result["meets_targets"] = {k: meets(targets, k, summary[k]) for k in targets}
    if as_json:
        import json

        print(json.dumps(result, indent=2))
    else:
        _print(result, targets)
    return 0 if summary["all_checked"] else 1


def _print(result: dict[str, Any], targets: dict[str, tuple[str, float]]) -> None:
    print(f"kvcr bench copy --device {result['device']}{' --quick' if result['quick'] else ''}"
          f": {result['engine']}, {result['bytes_per_row'] // MIB} MiB per row, median of "
          f"{result['reps']}; memcpy2d {result['memcpy2d']}, pin failures "
          f"{result['pin_failures']}")
    print(f"{'block':>8} {'layout':>6} | {'save GB/s':>9} {'1 copy':>8} {'ratio':>6} | "
          f"{'load GB/s':>9} {'1 copy':>8} {'ratio':>6} | bytes")
    for r in result["rows"]:
        print(f"{r['block_bytes'] // KIB:>5} KiB {r['layout']:>6} | {r['save_gbps']:>9.2f} "
              f"{r['save_baseline_gbps']:>8.2f} {r['save_ratio']:>6.2f} | "
              f"{r['load_gbps']:>9.2f} {r['load_baseline_gbps']:>8.2f} "
              f"{r['load_ratio']:>6.2f} | {'ok' if r['checked'] else 'WRONG'}")
    for name, value in result["summary"].items():
        verdict = ""
        if name in targets:
            op, bound = targets[name]
            verdict = f"   target {op} {bound:g}  " + (
                "meets" if meets(targets, name, value) else "MISSES")
        print(f"{name:16} {value!s:>8}{verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcr_bench.device_copy",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="short run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    return run_copy_bench(quick=args.quick, as_json=args.json, device=args.device)


if __name__ == "__main__":
    sys.exit(main())
