"""A vLLM scheduler's lookup against its own embedded Runner, the two ways it can ask: over
the embedded Runner's socket (an `AttachClient`, as every engine process did before the
Runner service) and in-process (`EmbeddedRunner.service`, what the scheduler does now), at
TP 1 and 2, measured in the same run against the same Runner (`kvcr bench pool`).
"""

from __future__ import annotations

import functools
import os

from kvcr_bench.copies import median_time
from kvcr_core.attach import AttachClient, EmbeddedRunner, EngineSettings, RunnerOps
from kvcr_core.config import KVCRConfig
from kvcr_core.keys import NamespaceSpec, block_keys
from kvcr_core.testing import pattern_block

_BLOCK = 16384
_KEYS = 256  # a 4,096-token prompt of 16-token blocks, per rank


def _spec(rank: int, tp: int) -> NamespaceSpec:
    return NamespaceSpec(model_id="bench", dtype="float32", kv_dtype="float32",
                         block_size_tokens=16, num_layers=2, num_kv_heads=2, head_dim=64,
                         layout="bench/embedded", tp_size=tp, tp_rank=rank)


def embedded_lookup_us(reps: int) -> dict[str, float]:
    """Median microseconds of one scheduler lookup (`lookup_all` of 256 keys per rank, half
    of them READY), over the socket and in-process, TP 1 and 2."""
    settings = EngineSettings(socket=f"\0kvcr-bench-embedded-{os.getpid()}",
                              runner=KVCRConfig(pool_bytes=96 << 20,
                                                namespace_pool_bytes=16 << 20))
    embedded = EmbeddedRunner(settings)
    out: dict[str, float] = {}
    try:
        for tp in (1, 2):
            specs = [_spec(r, tp) for r in range(tp)]
            keys = [list(block_keys(s.digest(), list(range(_KEYS * 16)), 16)) for s in specs]
            socket_client = AttachClient(embedded.socket_path, specs, _BLOCK, identity="bench")
            in_process = embedded.service(specs, _BLOCK, identity="bench-in-process")
            for ns, rank_keys in enumerate(keys):
                stored = rank_keys[:_KEYS // 2]
                in_process.stores[ns].store(stored, [pattern_block(k, _BLOCK) for k in stored])
            ops: dict[str, RunnerOps] = {"socket": socket_client, "in_process": in_process}
            for name, runner in ops.items():
                assert runner.lookup_all(keys) == _KEYS // 2
                out[f"embedded_lookup_tp{tp}_{name}_us"] = 1e6 * median_time(
                    functools.partial(runner.lookup_all, keys), reps)
            socket_client.close()
            in_process.close()
    finally:
        embedded.stop()
    for tp in (1, 2):
        out[f"embedded_lookup_tp{tp}_speedup"] = (out[f"embedded_lookup_tp{tp}_socket_us"]
                                                  / out[f"embedded_lookup_tp{tp}_in_process_us"])
    return out
