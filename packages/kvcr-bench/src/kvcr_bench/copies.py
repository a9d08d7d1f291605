"""Shared parts of the `kvcr bench` programs: the copy-path measurement and the report.

`measure_copy` times reserve + copy-in + seal (what every kvcr writer does: the sealer hashes
each block beside the next copies and commits it, kvcr_core.sealing; the time runs until the
last commit is sent) and
acquire + copy-out + release, in batches of 64 blocks, against a baseline that copies the
same source bytes into (or out of) the very pool pages kvcr used, in the same order, with the
same copy primitive, right after each kvcr run (copy order alone moves throughput by 25% here,
and two regions of one size can differ by 10% in a VM). A second write baseline hashes each
block after copying it (what any writer that checksums must do at least), and a verified
read (`verify_loads`: copy out, hash, compare) is timed against the plain read. Ratios are
baseline time / kvcr time (1.0 = no overhead). The sealer has the engines' default threads
(`hash_threads`, from `KVCR_HASH_THREADS` like an engine's; none below 4 cores: each block
is hashed in line). `hash_gbps`: hashed bytes per second of hashing time; `inline_blocks`:
blocks hashed in the writer's thread (no threads, or the sealer's queue was full).
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvcr_core.blockcopy import SlotOwner
from kvcr_core.checksums import block_checksum
from kvcr_core.config import load_config
from kvcr_core.memory import HostRegion, RegionKind, SlotPool
from kvcr_core.sealing import Sealer, hash_thread_count
from kvcr_core.testing import random_keys
from kvcr_core.types import BlockKey

KIB = 1024
MIB = 1024 * KIB
BLOCK_SIZES = (64 * KIB, 256 * KIB, 2 * MIB)
BATCH = 64
Targets = dict[str, tuple[str, float]]


CopyTarget = SlotOwner  # a Runner namespace store or a kvcr-guard client


def median_time(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_copy(target: CopyTarget, pool: SlotPool, block_bytes: int, total_bytes: int,
                 reps: int, clear: Callable[[list[BlockKey]], None] | None = None
                 ) -> dict[str, Any]:
    """One table row. Without `clear`, each repetition writes fresh keys (the pool must hold
    `reps` times `total_bytes`)."""
    n = total_bytes // block_bytes
    source = HostRegion.create(n * block_bytes, RegionKind.ANONYMOUS)
    source.prefault()
    src = source.view
    src[:] = bytes(range(256)) * (len(src) // 256)
    sources = [src[i * block_bytes:(i + 1) * block_bytes] for i in range(n)]
    dst = pool.region.view
    order: list[int] = []
    keys: list[BlockKey] = []

    def memcpy_in() -> None:
        for off, chunk in zip(order, sources, strict=True):
            dst[off:off + block_bytes] = chunk

    def memcpy_checksum_in() -> None:
        for off, chunk in zip(order, sources, strict=True):
            dst[off:off + block_bytes] = chunk
            block_checksum(dst[off:off + block_bytes])

    def memcpy_out() -> None:
        for off, chunk in zip(order, sources, strict=True):
            chunk[:] = dst[off:off + block_bytes]

    # A target with async calls (the guard client) is driven as an engine would: the next
    # batch's slots are requested before this batch is copied, commits and releases are
    # sent without waiting. A local store answers at once and is driven synchronously.
    reserve_next = _ahead(target, "reserve_async", target.reserve)
    acquire_next = _ahead(target, "acquire_async", target.acquire)
    commit = getattr(target, "commit_nowait", target.commit)
    release = getattr(target, "release_nowait", target.release)
    sealer = Sealer(hash_thread_count(load_config().hash_threads),  # KVCR_HASH_THREADS
                    name="kvcr-bench-sealer")

    def kvcr_in() -> None:
        view, stride = pool.view, pool.stride_bytes
        order.clear()
        pending = reserve_next(keys[0:BATCH])
        for b in range(0, n, BATCH):
            res = pending()
            if b + BATCH < n:
                pending = reserve_next(keys[b + BATCH:b + 2 * BATCH])
            seal = sealer.batch()
            for j, slot in enumerate(res.slots):
                if slot is not None:
                    seal.write(view(slot), sources[b + j])
                    order.append(slot * stride)
            seal.publish(functools.partial(_commit_with, commit, res.op))
        if not sealer.flush(60.0):
            raise RuntimeError("the sealer did not finish within 60 s")
        if len(order) != n:
            raise RuntimeError(f"only {len(order)} of {n} blocks got slots: pool too small")

    def kvcr_out(verify: bool = False) -> None:
        read_into = pool.read_into
        pending = acquire_next(keys[0:BATCH], verify)
        for b in range(0, n, BATCH):
            lease = pending()
            if b + BATCH < n:
                pending = acquire_next(keys[b + BATCH:b + 2 * BATCH], verify)
            sums = committed(lease) if verify else ()
            for j, slot in enumerate(lease.slots):
                if slot is not None:
                    read_into(slot, sources[b + j])
                    if verify and block_checksum(sources[b + j]) != sums[j]:
                        raise RuntimeError("a block changed in the pool since its commit")
            release(lease.op)

    def committed(lease: Any) -> Sequence[int]:
        if lease.checksums:
            return tuple(lease.checksums)
        return [target.checksums.of(s) for s in lease.slots if s is not None]  # type: ignore

    w_base, w_sum, w_kvcr, r_base, r_kvcr, r_checked = [], [], [], [], [], []
    for rep in range(reps):
        if clear is not None:
            clear(keys)
        if clear is None or not keys:
            keys = random_keys(n, seed=block_bytes * 1000 + rep)
        w_kvcr.append(median_time(kvcr_in, 1))
        w_base.append(median_time(memcpy_in, 1))
        w_sum.append(median_time(memcpy_checksum_in, 1))
        r_kvcr.append(median_time(kvcr_out, 1))
        r_checked.append(median_time(lambda: kvcr_out(verify=True), 1))
        r_base.append(median_time(memcpy_out, 1))
    sealer.close()
    hashed = sealer.sealed_blocks + sealer.inline_blocks
    hash_gbps = hashed * block_bytes / 1e9 / sealer.hash_seconds if sealer.hash_seconds else 0.0
    for chunk in sources:
        chunk.release()
    source.close()
    gb = n * block_bytes / 1e9
    wb, ws, wk, rb, rk, rc = (statistics.median(x) for x in (w_base, w_sum, w_kvcr, r_base,
                                                            r_kvcr, r_checked))
    return {"block_bytes": block_bytes, "blocks": n,
            "write_gbps": gb / wk, "write_memcpy_gbps": gb / wb, "write_ratio": wb / wk,
            "write_ratio_vs_memcpy_checksum": ws / wk,
            "read_gbps": gb / rk, "read_memcpy_gbps": gb / rb, "read_ratio": rb / rk,
            "verified_read_gbps": gb / rc, "verify_loads_ratio": rk / rc,
            "hash_gbps": hash_gbps, "hash_threads": sealer.threads,
            "inline_blocks": sealer.inline_blocks}


def _commit_with(commit: Callable[..., object], op: Any, checksums: list[int]) -> None:
    commit(op, checksums=checksums)


def _ahead(target: object, async_name: str,
           sync: Callable[..., Any]) -> Callable[..., Any]:
    """(keys[, checksums]) -> a thunk that yields the result: async where the target offers
    it; `checksums` asks an attach client for each leased block's committed checksum."""
    start_async = getattr(target, async_name, None)
    if start_async is not None:
        return lambda keys, *sums: start_async(
            keys, **({"checksums": sums[0]} if sums else {})).result

    def now(keys: Sequence[BlockKey], *_: bool) -> Callable[[], Any]:
        result = sync(keys)
        return lambda: result

    return now


def min_ratio_256k(rows: list[dict[str, Any]]) -> float:
    """The worst of the write and read ratios at 256 KiB blocks and above."""
    return float(min(min(r["write_ratio"], r["read_ratio"]) for r in rows
                     if r["block_bytes"] >= 256 * KIB))


def checksum_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """What checksums cost at 256 KiB blocks and above: writes against a copy that hashes too,
    and loads with `verify_loads` against plain loads (the worst block size of each)."""
    big = [r for r in rows if r["block_bytes"] >= 256 * KIB]
    return {"write_ratio_vs_memcpy_checksum_256k":
            float(min(r["write_ratio_vs_memcpy_checksum"] for r in big)),
            "verify_loads_ratio_256k": float(min(r["verify_loads_ratio"] for r in big))}


def meets(targets: Targets, name: str, value: float) -> bool:
    op, bound = targets[name]
    return value >= bound if op == ">=" else value <= bound


def report(title: str, result: dict[str, Any], targets: Targets, *, as_json: bool) -> None:
    summary = result["summary"]
    result["targets"] = {k: f"{op} {v:g}" for k, (op, v) in targets.items()}
    result["meets_targets"] = {k: meets(targets, k, summary[k]) for k in targets}
    if as_json:
        print(json.dumps(result, indent=2))
        return
    print(title)
    print(f"{'block':>8} | {'write GB/s':>10} {'memcpy':>8} {'ratio':>6} {'vs+xxh3':>7} | "
          f"{'read GB/s':>10} {'memcpy':>8} {'ratio':>6} | {'verified':>8} {'ratio':>6} | "
          f"{'hash GB/s':>9} {'threads':>7} {'inline':>6}")
    for r in result["rows"]:
        print(f"{r['block_bytes'] // KIB:>5} KiB | {r['write_gbps']:>10.2f} "
              f"{r['write_memcpy_gbps']:>8.2f} {r['write_ratio']:>6.2f} "
              f"{r['write_ratio_vs_memcpy_checksum']:>7.2f} | {r['read_gbps']:>10.2f} "
              f"{r['read_memcpy_gbps']:>8.2f} {r['read_ratio']:>6.2f} | "
              f"{r['verified_read_gbps']:>8.2f} {r['verify_loads_ratio']:>6.2f} | "
              f"{r['hash_gbps']:>9.2f} {r['hash_threads']:>7} {r['inline_blocks']:>6}")
    print()
    for name, value in summary.items():
        if name in targets:
            op, bound = targets[name]
            verdict = "meets" if meets(targets, name, value) else "MISSES"
            print(f"{name:28} {value:>14,.2f}   target {op} {bound:g}  {verdict}")
        else:
            print(f"{name:28} {value:>14,.2f}")
