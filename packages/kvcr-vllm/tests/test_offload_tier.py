"""kvcr's pool as a secondary tier of vLLM's OffloadingConnector, driven through vLLM's real
tiering classes on CPU (`TieringOffloadingSpec` builds the real `TieringOffloadingManager`
with its shared-memory CPU primary tier and this tier; vLLM's offloading worker needs a GPU
and is not run): chunks the primary stores cascade into kvcr byte-exactly, a chunk the
primary lost is promoted back byte-exactly, a second engine's manager on the same kvcr-guard
finds the first one's chunks, and kvcr faults are misses and failed jobs, never errors.
(Integration: real Runner, real kvcr-guard, no engine.)"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from kvcr_bench.offload_tier import settle, tiering_manager
from kvcr_core.errors import ConfigError
from kvcr_vllm.offload_tier import KVCRPoolTier

pytestmark = pytest.mark.integration

CHUNK = 64 * 1024
CHUNKS = 8


def offloading(engine_id: str, tier: dict[str, Any], events: bool = False) -> Any:
    """vLLM's real tiering manager with kvcr's tier, as the OffloadingConnector builds it."""
    return tiering_manager(engine_id, tier, chunk_bytes=CHUNK, chunks=CHUNKS, events=events)


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [make_offload_key(bytes([salt, i]) * 16, 0) for i in range(n)]


def store(manager: Any, chunk_keys: list[bytes], seed: int) -> list[np.ndarray]:
    """What vLLM does after a GPU -> primary copy: prepare, write the rows, complete."""
    primary = np.asarray(manager.secondary_tiers[0]._primary_kv_view).view(np.uint8)
    ctx = ReqContext(req_id=f"store-{seed}")
    manager.on_new_request(ctx)
    out = manager.prepare_store(chunk_keys, ctx)
    rng = np.random.default_rng(seed)
    data = []
    for chunk in out.store_spec.chunk_ids:
        row = rng.integers(0, 256, CHUNK, dtype=np.uint8)
        primary[int(chunk)] = row
        data.append(row)
    manager.complete_store(chunk_keys, ctx)
    manager.on_request_finished(ctx)
    settle(manager)
    return data


def promote(manager: Any, chunk_keys: list[bytes]) -> list[np.ndarray]:
    """A lookup that misses the primary: promotion from kvcr, then a primary hit; the rows
    vLLM would copy to the GPU."""
    ctx = ReqContext(req_id=f"load-{time.monotonic_ns()}")
    manager.on_new_request(ctx)
    first = [manager.lookup(k, ctx) for k in chunk_keys]
    assert first == [LookupResult.HIT_PENDING] * len(chunk_keys)
    settle(manager)
    assert [manager.lookup(k, ctx) for k in chunk_keys] == [LookupResult.HIT] * len(chunk_keys)
    spec = manager.prepare_load(chunk_keys, ctx)
    primary = np.asarray(manager.secondary_tiers[0]._primary_kv_view).view(np.uint8)
    rows = [primary[int(c)].copy() for c in spec.chunk_ids]
    manager.complete_load(chunk_keys, ctx)
    manager.on_request_finished(ctx)
    return rows


def test_chunks_cascade_into_kvcr_and_come_back_byte_exact() -> None:
    """Risk: a chunk the primary tier evicted is served from kvcr with other bytes (another
    chunk's, a torn copy), or never reaches kvcr at all."""
    manager = offloading("cascade", {"pool_bytes": 64 * CHUNK})
    tier = manager.secondary_tiers[0]
    try:
        chunk_keys = keys(3)
        data = store(manager, chunk_keys, seed=1)
        assert tier.counts["stored_chunks"] == 3
        manager.reset_cache()  # the primary tier forgets; kvcr's pool keeps them
        assert [np.array_equal(a, b) for a, b in zip(promote(manager, chunk_keys), data,
                                                     strict=True)] == [True] * 3
        assert tier.counts["promoted_chunks"] == 3
        values = manager.get_stats().data["data"]  # what vLLM's /metrics exports
        assert values["vllm:kvcr_tier_chunks"] == {("stored",): 3, ("promoted",): 3}
        assert manager.get_stats().data["data"]["vllm:kvcr_tier_jobs"] == {(): 0}  # deltas
        ctx = ReqContext(req_id="unknown")
        manager.on_new_request(ctx)
        assert manager.lookup(keys(1, salt=9)[0], ctx) == LookupResult.MISS
    finally:
        manager.shutdown()


def test_a_second_engine_on_the_same_guard_finds_the_first_ones_chunks(guard) -> None:
    """Risk: the tier's keys depend on the engine (its id, its process): engines on a node
    never share, and an engine restarted after a crash starts cold."""
    tier = {"mode": "guarded", "socket": guard.socket}
    first = offloading("engine-a", tier)
    try:
        data = store(first, keys(4, salt=3), seed=2)
    finally:
        first.shutdown()  # (an engine that exited: kvcr-guard keeps the pool)
    second = offloading("engine-b", tier)
    try:
        rows = promote(second, keys(4, salt=3))
        assert all(np.array_equal(a, b) for a, b in zip(rows, data, strict=True))
    finally:
        second.shutdown()


def test_runner_faults_are_misses_and_failed_jobs_never_errors(short_tmp, harness) -> None:
    """Risk: kvcr-guard gone (crashed, restarting) raises into vLLM's scheduler and takes the
    engine down, or a job never reports and a request waits for ever."""
    guard = harness.Guard(short_tmp, "--pool-bytes", "64MiB", "--namespace-pool-bytes",
                          "32MiB").start()
    manager = offloading("faults", {"mode": "guarded", "socket": guard.socket,
                                    "timeout_s": 1})
    tier = manager.secondary_tiers[0]
    try:
        store(manager, keys(2, salt=5), seed=3)
        guard.stop()
        store(manager, keys(2, salt=6), seed=4)  # the cascade fails: reported, not raised
        assert tier.counts["store_failed"] >= 1
        manager.reset_cache()
        ctx = ReqContext(req_id="after")
        manager.on_new_request(ctx)
        assert manager.lookup(keys(2, salt=5)[0], ctx) == LookupResult.MISS
        assert tier.counts["runner_unavailable"] >= 1
    finally:
        manager.shutdown()
        guard.log.close()


def test_the_tier_takes_the_connectors_keys_and_refuses_others() -> None:
    """Risk: a typo in the tier's config silently runs a default (an embedded pool nobody
    shares) where the operator asked for kvcr-guard."""
    with pytest.raises(ConfigError, match=r"secondary_tiers\[KVCRPoolTier\].*sockett"):
        offloading("typo", {"mode": "guarded", "sockett": "/run/kvcr/guard.sock"})
    with pytest.raises(ConfigError, match=r"\.mode"):
        offloading("mode", {"mode": "guraded"})
    assert KVCRPoolTier.medium is not None


def test_the_documented_configuration_parses_through_vllm_and_loads_the_tier() -> None:
    """Risk: the guide's --kv-transfer-config for the tier is rejected by vLLM, or names a
    class vLLM's tier factory cannot load."""
    import shlex
    from pathlib import Path

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    page = (Path(__file__).resolve().parents[3] / "docs" / "vllm.md").read_text()
    command = next(block for block in (part.split("```")[0]
                                       for part in page.split("```sh\n")[1:])
                   if "KVCRPoolTier" in block)
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    kv = args.kv_transfer_config
    assert (kv.kv_connector, kv.kv_role) == ("OffloadingConnector", "kv_both")
    (tier,) = kv.kv_connector_extra_config["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(tier) is KVCRPoolTier
    # its keys pass the tier's validation; no kvcr-guard there: lookups are misses
    manager = offloading("documented", {**tier, "socket": f"/tmp/kvcr-none-{os.getpid()}.sock"})
    try:
        ctx = ReqContext(req_id="r")
        manager.on_new_request(ctx)
        assert manager.lookup(keys(1)[0], ctx) == LookupResult.MISS
        assert manager.secondary_tiers[0].counts["runner_unavailable"] == 1
    finally:
        manager.shutdown()


def test_chunks_kvcr_evicted_are_forgotten_and_a_stale_hit_recomputes() -> None:
    """Risk: the tier keeps answering HIT for chunks kvcr evicted (every such request waits
    for a promotion that fails), or announces chunks it no longer holds to a router."""
    from kvcr_vllm import offload_tier

    manager = offloading("evict", {"pool_bytes": 6 * CHUNK}, events=True)
    tier = manager.secondary_tiers[0]
    capacity = tier.runner.stats().capacity_slots
    assert capacity <= CHUNKS  # (one store fits the primary tier)
    try:
        old = keys(2, salt=7)
        store(manager, old, seed=5)
        ctx = ReqContext(req_id="probe")
        manager.on_new_request(ctx)
        assert tier.lookup(old[0], ctx) == LookupResult.HIT
        for salt in (8, 9):  # twice the pool's slots of new chunks: the old ones are evicted
            store(manager, keys(capacity, salt=salt), seed=salt)
        assert tier.runner.lookup([tier.kvcr_key(old[0])]) == 0
        time.sleep(offload_tier.FORGET_EVERY_S)
        settle(manager)  # the end of a step reads the Runner's removal log
        assert tier.lookup(old[0], ctx) == LookupResult.MISS
        assert tier.lookup(old[1], ctx) == LookupResult.MISS
        # KV events: each chunk the tier stored announced once, the evicted ones removed
        mine = [e for e in manager.take_events() if e.ownership == "KVCRPoolTier"]
        stored = [k for e in mine if not e.removed for k in e.keys]
        removed = {k for e in mine if e.removed for k in e.keys}
        assert stored[:2] == old and len(stored) == len(set(stored)) == 2 + 2 * capacity
        assert set(old) <= removed and len(removed) == len(stored) - capacity
    finally:
        manager.shutdown()


def test_the_tiers_metrics_are_declared_to_vllm() -> None:
    """Risk: the tier's counters reach vLLM's stats but no metric is declared for them, so
    /metrics never shows them."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    declared = TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": [
        {"type": "KVCRPoolTier", "module_path": "kvcr_vllm.offload_tier"}]})
    assert declared["vllm:kvcr_tier_chunks"].labelnames == ("event",)
    assert declared["vllm:kvcr_tier_failures"].labelnames == ("reason",)
    assert "vllm:kvcr_tier_jobs" in declared
