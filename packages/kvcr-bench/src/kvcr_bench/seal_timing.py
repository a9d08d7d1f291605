"""The full save path of `kvcr bench copy`: blocks copied into the pool batch by batch (64
whole blocks in runs of 64, as a block-contiguous engine saves a step), each batch sealed
(kvcr_core.sealing: hashed, then handed to a publish that stands for the commit) as soon as
its copy completed, while the next batch copies; timed until the last batch is sealed.

Rows: the sealer with 0 threads (every block hashed in line), then 1, 2, 4 and 8 threads (as
many as the host has cores), each against one copy of the same bytes (the bench's baseline) and
against the same batches copied without hashing, interleaved. `hash_gbps` is bytes hashed per
second of hashing, per thread (the threads hash side by side). What `hash_threads: auto` picks
on this host is marked: its ratio is the summary's `sealed_save_ratio` (target on CUDA: at least
0.8 of one pinned copy).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kvcr_bench.copy_patterns import Row, measure
from kvcr_core.copyengine import CopyEngine, copy_blocks
from kvcr_core.memory import SlotPool
from kvcr_core.sealing import Sealer, hash_thread_count

BATCH = 64
THREADS = (0, 1, 2, 4, 8)


def _save(row: Row, pool: SlotPool, engine: CopyEngine, sealer: Sealer | None) -> None:
    published: list[int] = []
    for start in range(0, len(row.blocks), BATCH):
        blocks, slots = row.blocks[start:start + BATCH], row.slots[start:start + BATCH]
        copy_blocks(engine, row.planes, row.rows, [(blocks, slots)], into_pool=True)
        engine.record().wait()
        if sealer is not None:
            sealer.seal([pool.view(s) for s in slots], published.extend)  # type: ignore[arg-type]
    if sealer is not None and not sealer.flush(120.0):
        raise RuntimeError("the sealer did not finish within 120 s")


def sealed_saves(engine: CopyEngine, pool: SlotPool, rows: torch.Tensor,
                 device: torch.device, block_bytes: int, n: int,
                 baseline: Mapping[str, Callable[[], object]], sync: Callable[[], None],
                 reps: int) -> list[dict[str, Any]]:
    """One row per thread count (see the module's docstring)."""
    row = Row(engine, rows, device, block_bytes, "whole", BATCH, n)
    auto = hash_thread_count("auto")
    counts = sorted({t for t in THREADS if t <= (os.cpu_count() or 1)} | {auto})
    sealers = {t: Sealer(t, name=f"kvcr-bench-seal-{t}") for t in counts}
    runs: dict[str, Callable[[], object]] = {
        "save_base": baseline["save_base"],
        "plain": functools.partial(_save, row, pool, engine, None)}
    for t, sealer in sealers.items():
        runs[f"sealed_{t}"] = functools.partial(_save, row, pool, engine, sealer)
    med = measure(runs, sync, reps)
    gb = n * block_bytes / 1e9
    out = []
    for t, sealer in sealers.items():
        hashed = (sealer.sealed_blocks + sealer.inline_blocks) * block_bytes / 1e9
        out.append({"block_bytes": block_bytes, "threads": t, "auto": t == auto,
                    "sealed_gbps": gb / med[f"sealed_{t}"],
                    "sealed_ratio": med["save_base"] / med[f"sealed_{t}"],
                    "vs_unhashed": med["plain"] / med[f"sealed_{t}"],
                    "hash_gbps": hashed / sealer.hash_seconds if sealer.hash_seconds else 0.0,
                    "inline_blocks": sealer.inline_blocks})
        sealer.close()
    return out


def print_sealed(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print("full save path (copy, hash, commit) of whole blocks in batches of 64:")
    for r in rows:
        print(f"  {r['block_bytes'] >> 10:>5} KiB, {r['threads']} hashing thread(s)"
              f"{' (auto)' if r['auto'] else '':7}: {r['sealed_gbps']:6.2f} GB/s = "
              f"{r['sealed_ratio']:.2f} of one copy, {r['vs_unhashed']:.2f} of the same saves "
              f"unhashed; hash {r['hash_gbps']:.1f} GB/s per thread")
