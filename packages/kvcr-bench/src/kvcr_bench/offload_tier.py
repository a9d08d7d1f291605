"""`kvcr bench tier`: kvcr's pool as a secondary tier of vLLM's OffloadingConnector
(kvcr_vllm.offload_tier), through vLLM's real `TieringOffloadingManager` on CPU: the time
per block of the tier's lookup (in vLLM's scheduler process; of chunks it knows, and at
first sight: another engine's, one Runner round trip each), and the throughput of a store
(cascade: primary -> kvcr, checksums included) and of a promotion (kvcr -> primary) of 1 GiB
of host KV in 2 MiB chunks (256 MiB with --quick), against a memcpy of the same bytes in the
same run; embedded and through kvcr-guard. Steady state: a warm-up run fills the pool (its
pages backed), and each measured run evicts the oldest chunks, as a full pool does. Also
`tiering_manager`, the rig the tier's tests share.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvcr_bench.copies import MIB, meets, report
from kvcr_bench.vllm_servers import bench_guard

TARGETS = {"lookup_us_per_block": ("<=", 50.0),
           "store_ratio_vs_memcpy": (">=", 0.85), "promote_ratio_vs_memcpy": (">=", 0.85)}
CHUNK = 2 * MIB


def tiering_manager(engine_id: str, tier: dict[str, Any], *, chunk_bytes: int,
                    chunks: int, events: bool = False) -> Any:
    """vLLM's real tiering manager (CPU primary tier of `chunks` chunks) with kvcr's tier,
    configured as the OffloadingConnector configures it (`events`: vLLM's KV events on)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": chunks * chunk_bytes, "secondary_tiers": [
            {"type": "KVCRPoolTier", "module_path": "kvcr_vllm.offload_tier", **tier}]},
        engine_id=f"{engine_id}-{os.getpid()}",
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False))
    return TieringOffloadingSpec(config).get_manager()


def settle(manager: Any, timeout_s: float = 60.0) -> None:
    """Scheduler steps until the tier's jobs are done and processed."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    tier = manager.secondary_tiers[0]
    deadline = time.monotonic() + timeout_s
    manager.on_schedule_end(ScheduleEndContext((), ()))  # (submits deferred promotions)
    while tier.has_pending_work() or manager._jobs:
        if time.monotonic() > deadline:
            raise TimeoutError("the tier's jobs never finished")
        time.sleep(0.0005)
        manager.on_schedule_end(ScheduleEndContext((), ()))


def _keys(n: int, rep: int) -> list[Any]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(rep.to_bytes(4, "big") + i.to_bytes(28, "big"), 0)
            for i in range(n)]


def _measure(tier: dict[str, Any], chunks: int, reps: int) -> dict[str, float]:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    manager = tiering_manager("bench", tier, chunk_bytes=CHUNK, chunks=chunks)
    kvcr = manager.secondary_tiers[0]
    primary = np.asarray(kvcr._primary_kv_view).view(np.uint8)
    primary[:] = np.random.default_rng(1).integers(0, 256, primary.shape, dtype=np.uint8)
    other = np.empty_like(primary)
    memcpy, stores, promotes = [], [], []
    try:
        for rep in range(-1, reps):  # rep -1 warms up: the pool's pages backed, then reused
            start = time.perf_counter()
            np.copyto(other, primary)
            memcpy.append(time.perf_counter() - start)
            keys = _keys(chunks, rep + 1)
            ctx = ReqContext(req_id=f"store-{rep}")
            manager.on_new_request(ctx)
            out = manager.prepare_store(keys, ctx)
            assert out is not None and len(out.store_spec.chunk_ids) == chunks
            start = time.perf_counter()
            manager.complete_store(keys, ctx)
            settle(manager)
            stores.append(time.perf_counter() - start)
            manager.on_request_finished(ctx)
            manager.reset_cache()  # the primary forgets: the next lookups promote
            ctx = ReqContext(req_id=f"load-{rep}")
            manager.on_new_request(ctx)
            start = time.perf_counter()
            pending = [manager.lookup(k, ctx) for k in keys]
            settle(manager)
            promotes.append(time.perf_counter() - start)
            if pending != [LookupResult.HIT_PENDING] * chunks:
                raise RuntimeError("kvcr did not hold every chunk the bench stored")
            manager.on_request_finished(ctx)
            manager.reset_cache()
        ctx = ReqContext(req_id="lookups")
        lookups = []
        for _ in range(5):
            start = time.perf_counter()
            hits = sum(kvcr.lookup(k, ctx) is LookupResult.HIT for k in _keys(chunks, reps))
            lookups.append((time.perf_counter() - start) / chunks)
        if hits != chunks:
            raise RuntimeError(f"the tier found {hits} of {chunks} chunks")
        first = []  # chunks this tier never saw (another engine's): one round trip each
        for _ in range(5):
            kvcr._known.clear()
            start = time.perf_counter()
            hits = sum(kvcr.lookup(k, ctx) is LookupResult.HIT for k in _keys(chunks, reps))
            first.append((time.perf_counter() - start) / chunks)
    finally:
        del primary, other  # vLLM unmaps the primary tier at shutdown
        manager.shutdown()
    copy_s, store_s, promote_s = (statistics.median(x[1:]) for x in (memcpy, stores, promotes))
    nbytes = chunks * CHUNK
    return {"memcpy_gbps": nbytes / copy_s / 1e9, "store_gbps": nbytes / store_s / 1e9,
            "promote_gbps": nbytes / promote_s / 1e9,
            "store_ratio_vs_memcpy": copy_s / store_s,
            "promote_ratio_vs_memcpy": copy_s / promote_s,
            "lookup_us_per_block": 1e6 * statistics.median(lookups),
            "lookup_first_sight_us_per_block": 1e6 * statistics.median(first),
            "store_spread_s": max(stores[1:]) - min(stores[1:])}


def run_tier_bench(*, quick: bool, as_json: bool) -> int:
    total = (256 if quick else 1024) * MIB
    chunks, reps = total // CHUNK, 3
    pool = f"{5 * total // 4 // MIB}MiB"  # one run's chunks and some: later runs evict
    rows = {"embedded": _measure({"pool_bytes": pool}, chunks, reps)}
    workdir = Path(tempfile.mkdtemp(prefix="kvcrbt", dir="/tmp"))
    guard = bench_guard(workdir, pool_bytes=pool, back_ahead=pool, whole_pool=True)
    try:
        rows["guarded"] = _measure({"mode": "guarded", "socket": guard.socket}, chunks, reps)
    finally:
        guard.stop()
    summary = {name: min(rows[m][name] for m in rows) if op == ">=" else
               max(rows[m][name] for m in rows) for name, (op, _) in TARGETS.items()}
    result = {"bench": "tier", "quick": quick, "chunk_bytes": CHUNK, "bytes": total,
              "reps": reps, "cores": os.cpu_count(), "rows": rows, "summary": summary}
    if as_json:
        report("", result, TARGETS, as_json=True)
        return 0
    print(f"kvcr bench tier{' --quick' if quick else ''}: {total // MIB} MiB of host KV in "
          f"{CHUNK // MIB} MiB chunks through vLLM's TieringOffloadingManager, median of "
          f"{reps}")
    print(f"{'mode':10} {'memcpy GB/s':>11} {'store GB/s':>10} {'ratio':>6} "
          f"{'promote GB/s':>12} {'ratio':>6} {'lookup us/block':>15} {'first sight':>11}")
    for mode, r in rows.items():
        print(f"{mode:10} {r['memcpy_gbps']:>11.2f} {r['store_gbps']:>10.2f} "
              f"{r['store_ratio_vs_memcpy']:>6.2f} {r['promote_gbps']:>12.2f} "
              f"{r['promote_ratio_vs_memcpy']:>6.2f} {r['lookup_us_per_block']:>15.1f} "
              f"{r['lookup_first_sight_us_per_block']:>11.1f}")
    for name, (op, bound) in TARGETS.items():
        verdict = "meets" if meets(TARGETS, name, summary[name]) else "MISSES"
        print(f"{name:28} {summary[name]:>10.2f}   target {op} {bound:g}  {verdict}")
    sys.stdout.flush()
    return 0
