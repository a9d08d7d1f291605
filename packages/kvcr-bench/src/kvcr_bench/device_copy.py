"""`kvcr bench copy [--device auto|cpu|cuda]`: kvcr's copy engine between the pool and KV
tensors on a device, as an engine hands blocks over, against one copy of the same bytes in
the same run, both directions (save: KV -> pool, load: pool -> KV).

- Rows (kvcr_bench.copy_patterns): 256 KiB and 2 MiB blocks; block ids in runs of 1, 4, 16
  and 64 (scattered slots likewise); layouts `whole` (a block is one page), `paged` (32 KiB
  pages of per-layer planes, one call) and `layerwise` (one call per layer). On CUDA each of
  the engine's strategies (`runs`, `gather`, `direct`) is timed forced, and `auto`, the
  engine's own choice through `copy_blocks`, is kvcr's number (`pairs`: the same through
  `engine.copy(block_pairs(...))`); on CPU the engine copies run by run.
- Baseline: one `copy_` of all those bytes between a contiguous device tensor and a pinned
  host tensor (`--device cuda`: one cudaMemcpyAsync from torch's own pinned allocator), or
  between two host tensors (`--device cpu`: one memcpy; torch on one thread for both, as
  `kvcr bench pool` measures one core).
- The full save path (kvcr_bench.seal_timing): whole blocks copied and sealed (hashed beside
  the next copies, then committed) with 0 to 8 hashing threads; `sealed_save_ratio` is the
  one with the threads `hash_threads: auto` picks here.
- Registration (CUDA; kvcr_bench.pin_timing): cudaHostRegister seconds per GiB of a fresh and
  of a prefaulted pool, whole and in 1 GiB chunks, and the longest single call.
Ratios are baseline time / kvcr time (1.0 = as fast as one pinned copy). Targets (CUDA): at
least 0.9 both ways for every row; a checksummed save at least 0.8; a registration call
under 0.1 s (prefaulted, chunked).
Needs torch only (and kvcr-core): `python -m kvcr_bench.device_copy` runs it where kvcr's
entry points are not installed (scripts/gpu_check.sh, with `--json-out`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from kvcr_bench.copies import KIB, MIB, meets
from kvcr_bench.copy_patterns import Row, measure_row, pool_rows
from kvcr_bench.pin_timing import registration
from kvcr_bench.seal_timing import print_sealed, sealed_saves
from kvcr_core.copyengine import CopyEngine, engine_for
from kvcr_core.cudacopy import CudaCopyEngine
from kvcr_core.memory import SlotPool

BLOCK_SIZES = (256 * KIB, 2 * MIB)
RUNS = (1, 4, 16, 64)
LAYOUTS = ("whole", "paged", "layerwise")
CUDA_STRATEGIES = ("runs", "gather", "direct", "pairs", "auto")
STAGING_SWEEP_MIB = (16, 256)  # beside the engine's default (64 MiB, in the rows)
TARGETS = {"min_save_ratio": (">=", 0.9), "min_load_ratio": (">=", 0.9),
           "sealed_save_ratio": (">=", 0.8), "longest_prefaulted_chunk_register_s": ("<=", 0.1)}


def _rows_for(engine: CopyEngine, device: torch.device, block_bytes: int, total: int,
              reps: int, strategies: list[str], sweep: list[dict[str, Any]],
              sealed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every layout and run length of one block size, on one pinned pool of twice the
    blocks (slots have gaps), against the same baseline copies. On CUDA, for the smallest
    block size, `sweep` gets the gather's ratios in runs of 1 with other staging sizes."""
    n = total // block_bytes
    pool = SlotPool.create(2 * n, block_bytes)
    pool.region.prefault()
    flat, rows = pool_rows(engine, pool)
    cuda = device.type == "cuda"
    host = torch.empty(n * block_bytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(n * block_bytes, dtype=torch.uint8, device=device)
    baseline = {"save_base": lambda: host.copy_(dev, non_blocking=cuda),
                "load_base": lambda: dev.copy_(host, non_blocking=cuda)}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = []
    for layout in LAYOUTS:
        for run in RUNS:
            row = Row(engine, rows, device, block_bytes, layout, run, n)
            out.append({"block_bytes": block_bytes, "run_blocks": run,
                        **measure_row(row, strategies, baseline, sync, reps,
                                      n * block_bytes)})
            del row
    sealed += sealed_saves(engine, pool, rows, device, block_bytes, n, baseline, sync, reps)
    if isinstance(engine, CudaCopyEngine) and block_bytes == BLOCK_SIZES[0]:
        for staging_mib in STAGING_SWEEP_MIB:
            other = CudaCopyEngine(device, strategy="gather", staging_bytes=staging_mib << 20)
            for layout in LAYOUTS[1:]:
                row = Row(other, rows, device, block_bytes, layout, 1, n)
                got = measure_row(row, ["gather"], baseline, sync, reps, n * block_bytes)
                sweep.append({"staging_mib": staging_mib, "block_bytes": block_bytes,
                              "layout": layout, "run_blocks": 1,
                              "save_ratio": got["save_ratio"], "load_ratio": got["load_ratio"],
                              "checked": got["checked"]})
            del row, other
    engine.unpin_pool(flat)
    del flat, rows
    pool.close()
    return out


def _device(name: str) -> torch.device | None:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        print("kvcr bench copy --device cuda: no CUDA device (torch.cuda.is_available() is "
              f"False; torch {torch.__version__}). Run it on a GPU machine with a CUDA torch, "
              "or use --device cpu.", file=sys.stderr)
        return None
    return torch.device(name)


def _summary(rows: list[dict[str, Any]], pins: dict[str, Any] | None,
             sealed: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "sealed_save_ratio": min(r["sealed_ratio"] for r in sealed if r["auto"]),
        "min_save_ratio": min(r["save_ratio"] for r in rows),
        "min_load_ratio": min(r["load_ratio"] for r in rows),
        "all_checked": all(r["checked"] for r in rows),
        "auto_shortfall": max(max(r["strategies"][r["best_save"]]["save_ratio"]
                                  - r["save_ratio"],
                                  r["strategies"][r["best_load"]]["load_ratio"]
                                  - r["load_ratio"]) for r in rows)}
    if all("pairs" in r["strategies"] for r in rows):
        summary["min_ratio_pairs"] = min(min(r["strategies"]["pairs"]["save_ratio"],
                                             r["strategies"]["pairs"]["load_ratio"])
                                         for r in rows)
    for layout in LAYOUTS:
        mine = [r for r in rows if r["layout"] == layout]
        summary[f"min_ratio_{layout}"] = min(min(r["save_ratio"], r["load_ratio"])
                                             for r in mine)
    if pins is not None:
        chunked = pins["prefaulted_1gib_chunks"]["longest_call_s"]
        summary["longest_prefaulted_chunk_register_s"] = chunked
        summary["fresh_register_s_per_gib"] = pins["fresh_whole"]["register_s_per_gib"]
        summary["prefaulted_register_s_per_gib"] = pins["prefaulted_whole"][
            "register_s_per_gib"]
    return summary


def run_copy_bench(*, quick: bool, as_json: bool, device: str = "auto",
                   strategies: list[str] | None = None, json_out: str | None = None,
                   register_gib: int | None = None) -> int:
    dev = _device(device)
    if dev is None:
        return 2
    total = (16 if quick else 256) * MIB
    reps = 2 if quick else 7
    engine = engine_for(dev)
    cuda = isinstance(engine, CudaCopyEngine)
    if not cuda:
        torch.set_num_threads(1)
    chosen = (strategies or list(CUDA_STRATEGIES)) if cuda else ["runs"]
    if chosen[-1] != "auto" and cuda:
        chosen.append("auto")
    result: dict[str, Any] = {
        "bench": "copy", "device": str(dev), "engine": type(engine).__name__, "quick": quick,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(dev) if cuda else None,
        "bytes_per_row": total, "reps": reps, "strategies": chosen,
        "memcpy2d": getattr(engine, "memcpy2d", False), "complete": False, "rows": [],
        "registration": None, "staging_sweep": [], "sealed_saves": []}
    for block in BLOCK_SIZES[:1] if quick else BLOCK_SIZES:
        result["rows"] += _rows_for(engine, dev, block, total, reps, chosen,
                                    result["staging_sweep"], result["sealed_saves"])
        _dump(json_out, result)  # what a run cut short by its time limit still shows
    gib = register_gib if register_gib is not None else (0 if quick or not cuda else 2)
    if isinstance(engine, CudaCopyEngine) and gib > 0:
        result["registration"] = registration(engine.runtime, gib)
    summary = _summary(result["rows"], result["registration"], result["sealed_saves"])
    summary["all_checked"] = summary["all_checked"] and all(
        r["checked"] for r in result["staging_sweep"])
    targets = {k: v for k, v in TARGETS.items() if summary.get(k) is not None} if cuda else {}
    result.update(
        complete=True, summary=summary, pin_failures=engine.pin_failures,
        cuda_failures=engine.cuda_failures if isinstance(engine, CudaCopyEngine) else 0,
        targets={k: f"{op} {v:g}" for k, (op, v) in targets.items()},
        meets_targets={k: meets(targets, k, summary[k]) for k in targets})
    _dump(json_out, result)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        _print(result, targets)
    return 0 if summary["all_checked"] else 1


def _dump(path: str | None, result: dict[str, Any]) -> None:
    if path is not None:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def _print(result: dict[str, Any], targets: dict[str, tuple[str, float]]) -> None:
    print(f"kvcr bench copy --device {result['device']}{' --quick' if result['quick'] else ''}"
          f": {result['engine']} ({result['gpu'] or 'CPU'}), {result['bytes_per_row'] // MIB}"
          f" MiB per row, median of {result['reps']}; memcpy2d {result['memcpy2d']}, pin "
          f"failures {result['pin_failures']}, CUDA call failures {result['cuda_failures']}")
    names = result["strategies"]
    print(f"{'block':>8} {'layout':>9} {'run':>3} {'copies':>6} | {'1 copy GB/s':>11} | "
          + " ".join(f"{s:>13}" for s in names) + " | auto took | bytes")
    print(f"{'':>31} | {'save / load':>11} | " + " ".join(f"{'save / load':>13}" for _ in names)
          + " |")
    for r in result["rows"]:
        cells = " ".join(f"{r['strategies'][s]['save_ratio']:>6.2f}/"
                         f"{r['strategies'][s]['load_ratio']:<6.2f}" for s in names)
        took = "+".join(sorted(set(r["auto_chose"]["save"]) | set(r["auto_chose"]["load"])))
        print(f"{r['block_bytes'] // KIB:>5} KiB {r['layout']:>9} {r['run_blocks']:>3} "
              f"{r['copies_run_by_run']:>6} | {r['save_baseline_gbps']:>5.1f}/"
              f"{r['load_baseline_gbps']:<5.1f} | {cells} | {took:>9} | "
              f"{'ok' if r['checked'] else 'WRONG'}")
    for r in result["staging_sweep"]:
        print(f"gather with {r['staging_mib']:>3} MiB of staging, {r['layout']:>9}, runs of 1: "
              f"save {r['save_ratio']:.2f}, load {r['load_ratio']:.2f}")
    print_sealed(result["sealed_saves"])
    if result["registration"] is not None:
        print(f"cudaHostRegister of a {result['registration']['pool_gib']} GiB pool:")
        for name, v in result["registration"].items():
            if isinstance(v, dict) and "calls" in v and v["register_s_per_gib"] is not None:
                print(f"  {name:22} {v['register_s_per_gib']:.3f} s/GiB, longest call "
                      f"{v['longest_call_s']:.3f} s in {v['calls']} call(s); prefault "
                      f"{v['prefault_s_per_gib']:.3f} s/GiB")
    for name, value in result["summary"].items():
        verdict = ""
        if name in targets:
            op, bound = targets[name]
            verdict = f"   target {op} {bound:g}  " + (
                "meets" if meets(targets, name, value) else "MISSES")
        print(f"{name:36} {value!s:>8}{verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcr_bench.device_copy",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="short run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--json-out", help="also write the JSON object to this file")
    parser.add_argument("--strategies", help="CUDA strategies to time, comma separated "
                        f"(default {','.join(CUDA_STRATEGIES)}; auto is always timed)")
    parser.add_argument("--register-gib", type=int,
                        help="pool size for the registration timing (CUDA; 0: skip)")
    args = parser.parse_args(argv)
    strategies = args.strategies.split(",") if args.strategies else None
    return run_copy_bench(quick=args.quick, as_json=args.json, device=args.device,
                          strategies=strategies, json_out=args.json_out,
                          register_gib=args.register_gib)


if __name__ == "__main__":
    sys.exit(main())
