"""The rows of `kvcr bench copy`: kvcr's copy engine moving a save's (and a load's) blocks
between KV tensors and the pool as an engine hands them over, against one copy of the same
bytes measured in the same run, interleaved.

- Block ids come in runs of `run` consecutive ids with a free block between runs (vLLM's
  block ids after some churn); slots likewise, in runs of the same length, the runs in a
  shuffled order (a pool's free list after evictions).
- Layouts: `whole` (a block is one page: a block-outermost KV layout), `paged` (a block is
  32 KiB pages of separate planes, vLLM's K and V per layer, all handed over in one call:
  vLLM's loads, and its saves where a step ran without layer hooks) and `layerwise` (the
  same planes, one call per layer of its two planes: vLLM's `save_kv_layer`, SGLang's loads).
- Strategies (CUDA engine): each of `runs`, `gather` and `direct` forced, and `auto`, the
  engine's own choice, all through `copy_blocks` (no pair planned unless a call goes run by
  run); `pairs` is `auto` through `engine.copy(block_pairs(...))`, for callers that still
  plan pairs (a few microseconds of Python each). The CPU engine copies run by run only.
- Each strategy's bytes are checked in both directions on a sample of blocks (their pool
  bytes zeroed, or their KV pages, before the copy that must restore them).
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvcr_core.copyengine import CopyEngine, block_pairs, copy_blocks
from kvcr_core.cudacopy import CudaCopyEngine
from kvcr_core.memory import SlotPool

Plane = tuple[torch.Tensor, int, int]
PAGE_BYTES = 32 << 10
SAMPLE_BLOCKS = 16


def pattern(n: int, run: int, seed: int) -> tuple[list[int], list[int]]:
    """(block ids, slots) of `n` blocks in runs of `run`, one free id between runs; slot runs
    in a shuffled order."""
    blocks = [b + b // run for b in range(n)]
    order = list(range(-(-n // run)))
    random.Random(seed).shuffle(order)
    slots = [r * (run + 1) + i for r in order for i in range(run) if r * run + i < n]
    return blocks, slots


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def measure(runs: dict[str, Callable[[], object]], sync: Callable[[], None],
            reps: int) -> dict[str, float]:
    """Median seconds of each run, interleaved so kvcr and its baseline see the same machine
    state, after one untimed round (first touches, lazy CUDA set-up, staging)."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            times[name].append(_timed(fn, sync))
    return {k: statistics.median(v) for k, v in times.items()}


class Row:
    """One layout and run length on one pinned pool: the calls each strategy makes."""

    def __init__(self, engine: CopyEngine, rows: torch.Tensor, device: torch.device,
                 block_bytes: int, layout: str, run: int, n: int) -> None:
        self.engine, self.rows, self.layout = engine, rows, layout
        page = block_bytes if layout == "whole" else PAGE_BYTES
        self.blocks, self.slots = pattern(n, run, seed=run)
        gen = torch.Generator(device=device).manual_seed(block_bytes + run)
        self.planes: list[Plane] = [
            (torch.randint(0, 256, (self.blocks[-1] + 1, page), generator=gen,
                           dtype=torch.uint8, device=device), i * page, page)
            for i in range(block_bytes // page)]
        self.calls = ([self.planes] if layout != "layerwise" else
                      [self.planes[i:i + 2] for i in range(0, len(self.planes), 2)])
        self.copies = len(block_pairs(self.planes, rows, self.blocks, self.slots,
                                      into_pool=True))

    def run(self, strategy: str, into_pool: bool) -> None:
        """One save or load with `strategy` through `copy_blocks`; `pairs`: `auto` through
        `engine.copy(block_pairs(...))`, as callers that plan pairs themselves get it."""
        if isinstance(self.engine, CudaCopyEngine):
            self.engine.strategy = "auto" if strategy == "pairs" else strategy
        for planes in self.calls:
            if strategy == "pairs":
                self.engine.copy(block_pairs(planes, self.rows, self.blocks, self.slots,
                                             into_pool=into_pool))
            else:
                copy_blocks(self.engine, planes, self.rows, [(self.blocks, self.slots)],
                            into_pool=into_pool)
        self.engine.record().wait()

    def check(self, strategy: str) -> bool:
        """Saves then loads with `strategy` over zeroed samples: both land byte-exactly."""
        step = max(1, len(self.blocks) // SAMPLE_BLOCKS)
        sample = sorted({*range(0, len(self.blocks), step), len(self.blocks) - 1})
        slots = [self.slots[i] for i in sample]
        blocks = [self.blocks[i] for i in sample]
        width = sum(page for _, _, page in self.planes)
        want = torch.cat([p[blocks].cpu() for p, _, _ in self.planes], dim=1)
        self.rows[slots, :width] = 0
        self.run(strategy, into_pool=True)
        saved = torch.equal(self.rows[slots, :width], want)
        for plane, _, _ in self.planes:
            plane[blocks] = 0
        self.run(strategy, into_pool=False)
        loaded = torch.equal(torch.cat([p[blocks].cpu() for p, _, _ in self.planes], dim=1),
                             want)
        return saved and loaded


def measure_row(row: Row, strategies: list[str], baseline: Mapping[str, Callable[[], object]],
                sync: Callable[[], None], reps: int, bytes_moved: int) -> dict[str, Any]:
    """One table row: every strategy both ways against the baseline copies, interleaved;
    what `auto` chose; every strategy's bytes checked."""
    runs: dict[str, Callable[[], object]] = dict(baseline)
    for s in strategies:
        runs[f"save_{s}"] = functools.partial(row.run, s, True)
        runs[f"load_{s}"] = functools.partial(row.run, s, False)
    med = measure(runs, sync, reps)
    gb = bytes_moved / 1e9
    per: dict[str, dict[str, Any]] = {}
    for s in strategies:
        per[s] = {"save_gbps": gb / med[f"save_{s}"], "load_gbps": gb / med[f"load_{s}"],
                  "save_ratio": med["save_base"] / med[f"save_{s}"],
                  "load_ratio": med["load_base"] / med[f"load_{s}"],
                  "checked": row.check(s)}
    kvcr = per[strategies[-1]]  # auto (the CPU engine's only strategy: runs)
    forced = [s for s in strategies if s not in ("auto", "pairs")] or strategies
    return {"layout": row.layout, "planes": len(row.planes),
            "page_bytes": row.planes[0][2], "blocks": len(row.blocks),
            "copies_run_by_run": row.copies, "strategies": per,
            "auto_chose": {"save": _chosen(row, True), "load": _chosen(row, False)},
            "save_baseline_gbps": gb / med["save_base"],
            "load_baseline_gbps": gb / med["load_base"],
            "save_ratio": kvcr["save_ratio"], "load_ratio": kvcr["load_ratio"],
            "best_save": max(forced, key=lambda s: per[s]["save_ratio"]),
            "best_load": max(forced, key=lambda s: per[s]["load_ratio"]),
            "checked": all(p["checked"] for p in per.values())}


def _chosen(row: Row, into_pool: bool) -> list[str]:
    """The strategies `auto` took for the row's calls in one direction."""
    if not isinstance(row.engine, CudaCopyEngine):
        return ["runs"]
    before = dict(row.engine.strategy_counts)
    row.run("auto", into_pool)
    return sorted(k for k, v in row.engine.strategy_counts.items() if v > before[k])


def pool_rows(engine: CopyEngine, pool: SlotPool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pinned flat mapping, its [slots, stride] rows)."""
    flat = engine.pin_pool(pool.region)
    return flat, flat[:pool.capacity_slots * pool.stride_bytes].view(pool.capacity_slots,
                                                                     pool.stride_bytes)
