"""Registration timing for `kvcr bench copy --device cuda`: what `cudaHostRegister` of a pool
mapping costs per GiB, fresh (its pages first touched by the registration) against
prefaulted (touched before, off CUDA's path), as one registration and in 1 GiB chunks. While
a registration runs it blocks every CUDA call of the process (measured on an H200), so the
longest single call is the stall an engine would see; the target is under 0.1 s.

Through kvcr's checked runtime calls (`kvcr_core.cudart`); a failed call is counted there and
reported here as a failure, never left pending.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvcr_core.cudart import REGISTER_PORTABLE_MAPPED, CudaRuntime
from kvcr_core.memory import HostRegion

GIB = 1 << 30


def _register(runtime: CudaRuntime, region: HostRegion, chunk_bytes: int) -> list[float]:
    """Seconds of each registration of `region` in `chunk_bytes` pieces (then unregistered);
    empty if one failed."""
    flat = torch.frombuffer(region.view, dtype=torch.uint8)
    address, size = flat.data_ptr(), flat.numel()
    del flat
    times: list[float] = []
    done: list[int] = []
    for start in range(0, size, chunk_bytes):
        begin = time.perf_counter()
        error = runtime.host_register(address + start, min(chunk_bytes, size - start),
                                      REGISTER_PORTABLE_MAPPED)
        times.append(time.perf_counter() - begin)
        if error:
            times = []
            break
        done.append(address + start)
    for chunk in done:
        runtime.host_unregister(chunk)
    return times


def registration(runtime: CudaRuntime, gib: int) -> dict[str, Any]:
    """Fresh and prefaulted `gib` GiB memfd pools, registered whole and in 1 GiB chunks."""
    result: dict[str, Any] = {"pool_gib": gib}
    for prefault in (False, True):
        for shape, chunk_gib in (("whole", gib), ("1gib_chunks", 1)):
            region = HostRegion.create(gib * GIB)
            fault_s = 0.0
            if prefault:
                begin = time.perf_counter()
                region.prefault()
                fault_s = time.perf_counter() - begin
            times = _register(runtime, region, chunk_gib * GIB)
            region.close()
            result[f"{'prefaulted' if prefault else 'fresh'}_{shape}"] = {
                "register_s_per_gib": sum(times) / gib if times else None,
                "longest_call_s": max(times) if times else None,
                "calls": len(times), "prefault_s_per_gib": fault_s / gib}
    result["failures"] = dict(runtime.failures)
    return result
