"""`kvcr bench pool`: the Runner's local data path against a same-run memcpy (bench_copy),
plus the index: lookup of 1,000 READY keys, index operations per second (per-key reserve,
commit, acquire and release through the store, metrics included) and index bytes per block
measured with tracemalloc at 1M READY blocks; and a vLLM scheduler's lookup against its
embedded Runner, in-process against over its socket (kvcr_bench.embedded).
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from typing import Any

from tqdm import tqdm

from kvcr_bench.copies import (
    BATCH,
    BLOCK_SIZES,
    KIB,
    MIB,
    checksum_summary,
    measure_copy,
    median_time,
    min_ratio_256k,
    report,
)
from kvcr_bench.embedded import embedded_lookup_us
from kvcr_core.config import KVCRConfig, MemoryBacking
from kvcr_core.eviction import LRUPolicy
from kvcr_core.index import BlockIndex
from kvcr_core.memory import SlotPool
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.testing import random_keys
from kvcr_core.types import BlockKey, NamespaceDigest

TARGETS = {"min_ratio_vs_memcpy_256k": (">=", 0.9), "lookup_1000_keys_us": ("<=", 100.0),
           "index_ops_per_s": (">=", 500_000.0), "index_bytes_per_block": ("<=", 200.0),
           "embedded_lookup_tp2_speedup": (">=", 1.0)}


def _copy_row(block_bytes: int, total_bytes: int, reps: int) -> dict[str, Any]:
    n = total_bytes // block_bytes
    config = KVCRConfig(pool_bytes=SlotPool.region_bytes_for(n, block_bytes) + 4 * MIB,
                        memory_backing=MemoryBacking.MEMFD)
    with Runner(config) as runner:
        store = runner.open_namespace(NamespaceDigest(bytes(16)), block_bytes, prefault=True)

        def clear(keys: list[BlockKey]) -> None:
            with store.lock:
                store.index.discard(keys)

        return measure_copy(store, store.pool, block_bytes, total_bytes, reps, clear)


def _filled_store(n_blocks: int) -> tuple[Runner, NamespaceStore, list[BlockKey]]:
    runner = Runner(KVCRConfig(pool_bytes=(n_blocks + 16) * 4096,
                               memory_backing=MemoryBacking.ANONYMOUS))
    store = runner.open_namespace(NamespaceDigest(bytes(16)), 4096)
    keys = random_keys(n_blocks, seed=7)
    for i in range(0, n_blocks, 1024):
        store.commit(store.reserve(keys[i:i + 1024]).op)
    return runner, store, keys


def _lookup_us(reps: int) -> float:
    runner, store, keys = _filled_store(100_000)
    probe = keys[5_000:6_000]
    assert store.lookup(probe) == 1000
    per_call = median_time(lambda: [store.lookup(probe) for _ in range(100)], 3 * reps) / 100
    runner.close()
    return per_call * 1e6


def _index_ops_per_s(cycles: int, reps: int) -> float:
    runner, store, _ = _filled_store(50_000)
    fresh = random_keys(cycles * BATCH, seed=11)
    batches = [fresh[i:i + BATCH] for i in range(0, len(fresh), BATCH)]
    sums = [0] * BATCH

    def cycle() -> None:  # writers send the checksums they took while copying
        for batch in batches:
            res = store.reserve(batch)
            store.commit(res.op, checksums=sums[:res.granted])
            store.release(store.acquire(batch).op)
        with store.lock:
            store.index.discard(fresh)

    seconds = median_time(cycle, reps)
    runner.close()
    return 4 * len(fresh) / seconds


def _index_bytes_per_block(n_blocks: int) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = BlockIndex(n_blocks, LRUPolicy(n_blocks))
    keys = random_keys(n_blocks, seed=3)
    for i in range(0, n_blocks, 4096):
        index.commit(index.reserve(keys[i:i + 4096]).op)
    del keys
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.ready_blocks == n_blocks
    return used / n_blocks


def run_pool_bench(*, quick: bool, as_json: bool) -> int:
    total = 96 * MIB if quick else 256 * MIB
    reps = 3 if quick else 7
    steps = [*(f"copy {b // KIB} KiB" for b in BLOCK_SIZES), "lookup", "index ops", "index size",
             "embedded lookup"]
    bar = tqdm(steps, desc="kvcr bench pool", file=sys.stderr, disable=None, leave=False)
    rows = []
    for block_bytes in BLOCK_SIZES:
        rows.append(_copy_row(block_bytes, total, reps))
        bar.update()
    lookup_us = _lookup_us(reps)
    bar.update()
    ops = _index_ops_per_s(200 if quick else 1000, reps)
    bar.update()
    bytes_per_block = _index_bytes_per_block(1_000_000)
    bar.update()
    embedded = embedded_lookup_us(500 if quick else 2000)
    bar.update()
    bar.close()
    summary = {"min_ratio_vs_memcpy_256k": min_ratio_256k(rows), **checksum_summary(rows),
               "lookup_1000_keys_us": lookup_us, "index_ops_per_s": ops,
               "index_bytes_per_block": bytes_per_block, **embedded}
    result = {"bench": "pool", "quick": quick, "batch_blocks": BATCH, "bytes_per_size": total,
              "rows": rows, "summary": summary}
    report(f"kvcr bench pool{' --quick' if quick else ''}: {total // MIB} MiB per size, "
           f"batches of {BATCH} blocks, median of {reps}", result, TARGETS, as_json=as_json)
    return 0
