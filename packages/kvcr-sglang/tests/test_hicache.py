"""KVCRHiCacheStorage against SGLang's real classes on CPU: the dynamic loader, real host
pools in every generic layout, a real HiCacheController with its own threads, a real
kvcr-guard shared by two processes, and the failure paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sglang = pytest.importorskip("sglang", reason="runs in .venv-sglang (scripts/setup_sglang.sh)")

import torch  # noqa: E402

from kvcr_bench import sglang_rig as cpu_rig  # noqa: E402
from kvcr_bench.sglang_rig import KVCR_EXTRA, PoolShape  # noqa: E402
from kvcr_core.errors import ConfigError  # noqa: E402

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
SHAPE = PoolShape()
SIDE = str(Path(__file__).with_name("sglang_side.py"))


@pytest.fixture(autouse=True, params=[0, 2], ids=["hash-in-line", "hash-threads"])
def hash_threads(request, monkeypatch):  # type: ignore[no-untyped-def]
    """Every test runs with pages hashed in line and on two sealer threads (kvcr_core.sealing:
    the commit then follows the write; the store's own reads wait for it)."""
    monkeypatch.setenv("KVCR_HASH_THREADS", str(request.param))
    return request.param


def rig(layout: str, extra: dict[str, object], **kw: object):  # type: ignore[no-untyped-def]
    alloc, dev = cpu_rig.device_pool(SHAPE)
    host = cpu_rig.host_pool(dev, SHAPE, layout)
    ctrl = cpu_rig.controller(alloc, host, SHAPE, extra={**KVCR_EXTRA, **extra}, **kw)
    return ctrl, host


def stop(ctrl) -> None:  # type: ignore[no-untyped-def]
    ctrl.detach_storage_backend()


def tokens(n_pages: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 30000, (n_pages * SHAPE.page_tokens,), generator=g).tolist()


def indices(first_page: int, n_pages: int) -> torch.Tensor:
    return torch.arange(first_page * SHAPE.page_tokens, (first_page + n_pages) * SHAPE.page_tokens,
                        dtype=torch.int64)


@pytest.mark.unit
def test_dynamic_backend_loads_from_real_sglang_cli_arguments() -> None:
    """Risk: the documented SGLang flags do not load kvcr (wrong keys, wrong constructor)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    extra = json.dumps({**KVCR_EXTRA, "interface_v1": 1, "pool_bytes": "64MiB"})
    args = parser.parse_args(["--model-path", "tiny", "--enable-hierarchical-cache",
                              "--hicache-mem-layout", "page_first",
                              "--hicache-storage-backend", "dynamic",
                              "--hicache-storage-backend-extra-config", extra])
    assert args.hicache_storage_backend == "dynamic"
    parsed = json.loads(args.hicache_storage_backend_extra_config)
    ctrl, _ = rig(args.hicache_mem_layout, parsed)
    try:
        assert type(ctrl.storage_backend).__name__ == "KVCRHiCacheStorage"
        assert ctrl.page_get_func.__name__ == "_page_get_zero_copy"
        assert ctrl.storage_backend.store.spec.layout.endswith("/page_first")
    finally:
        stop(ctrl)


@pytest.mark.unit
def test_a_typo_in_the_extra_config_is_an_error_naming_the_key() -> None:
    """Risk: a misspelt key silently runs without the intended setting."""
    with pytest.raises(ValueError) as err:
        rig("page_first", {"interface_v1": 1, "sokcet": "/tmp/x"})
    assert isinstance(err.value.__cause__ or err.value, ConfigError | ValueError)
    assert "sokcet" in str(err.value) or "sokcet" in str(err.value.__cause__)


@pytest.mark.unit
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interface", ["v1", "generic"])
def test_round_trip_is_bit_exact_through_the_controller_io_paths(layout: str,
                                                                 interface: str) -> None:
    """Risk: pages come back permuted or short in some layout / interface."""
    extra = {"interface_v1": 1} if interface == "v1" else {}
    ctrl, host = rig(layout, {**extra, "pool_bytes": "64MiB"})
    try:
        n = 6
        cpu_rig.fill_pages(host, 1, n, seed=3)
        want = cpu_rig.page_bytes(host, 1, n)
        keys = cpu_rig.page_keys(tokens(n, 1), SHAPE.page_tokens)
        assert ctrl.page_set_func(keys, indices(1, n)) is True
        assert ctrl.storage_backend.batch_exists(keys) == n
        assert ctrl.storage_backend.batch_exists([*keys[:3], "0" * 64, *keys[3:]]) == 3
        cpu_rig.zero_pages(host, 10, n)
        from sglang.srt.managers.cache_controller import PrefetchOperation

        op = PrefetchOperation("r1", [])
        assert ctrl.page_get_func(op, keys, indices(10, n)) == n
        assert cpu_rig.page_bytes(host, 10, n) == want
    finally:
        stop(ctrl)


@pytest.mark.unit
@pytest.mark.parametrize("layout", LAYOUTS)
def test_generic_and_zero_copy_store_the_same_bytes(layout: str) -> None:
    """Risk: a page written by one interface is read permuted by the other."""
    ctrl, host = rig(layout, {"pool_bytes": "64MiB"})
    try:
        backend = ctrl.storage_backend
        cpu_rig.fill_pages(host, 1, 3, seed=9)
        want = cpu_rig.page_bytes(host, 1, 3)
        keys = cpu_rig.page_keys(tokens(3, 2), SHAPE.page_tokens)
        assert ctrl._generic_page_set(keys, indices(1, 3))
        cpu_rig.zero_pages(host, 5, 3)
        assert backend.batch_get_v1(keys, indices(5, 3)) == [True] * 3
        assert cpu_rig.page_bytes(host, 5, 3) == want
    finally:
        stop(ctrl)


@pytest.mark.unit
def test_real_controller_threads_back_up_and_prefetch_through_kvcr() -> None:
    """Risk: kvcr works when called directly but not from SGLang's own backup / prefetch /
    I/O threads (thread safety, the prefix query, the ack protocol)."""
    ctrl, host = rig("page_first", {"interface_v1": 1, "pool_bytes": "64MiB"})
    try:
        n = 3
        toks = tokens(n, 5)
        keys = cpu_rig.page_keys(toks, SHAPE.page_tokens)
        cpu_rig.fill_pages(host, 2, n, seed=11)
        want = cpu_rig.page_bytes(host, 2, n)
        ctrl.write_storage(indices(2, n), toks, hash_value=keys)
        done = cpu_rig.drain(ctrl.ack_backup_queue, 30)
        assert done.completed_tokens == n * SHAPE.page_tokens
        op = ctrl.prefetch("req-1", toks)
        op = cpu_rig.drain(ctrl.prefetch_hit_queue, 30)
        assert op.storage_hit_count == n * SHAPE.page_tokens and op.hash_value == keys
        cpu_rig.zero_pages(host, 20, n)
        op.host_indices = indices(20, n)
        ctrl.prefetch_buffer.put(op)
        completed = 0
        while True:
            ack = cpu_rig.drain(ctrl.ack_prefetch_queue, 30)
            if ack.completed_tokens is not None:
                completed = max(completed, ack.completed_tokens)
            if ack.completed_req:
                break
        assert completed == n * SHAPE.page_tokens
        assert cpu_rig.page_bytes(host, 20, n) == want
        assert ctrl.storage_backend.kvcr_stats()["read_pages"] == n
        # SGLang's --enable-storage-metrics: per-call pages and bandwidth, drained per call
        metrics = ctrl.storage_backend.get_stats()
        assert type(metrics).__name__ == "StorageMetrics"
        assert metrics.prefetch_pgs == [n] and metrics.backup_pgs == [n]
        assert all(g > 0 for g in metrics.prefetch_bandwidth + metrics.backup_bandwidth)
        assert ctrl.storage_backend.get_stats().prefetch_pgs == []
    finally:
        stop(ctrl)


@pytest.mark.unit
def test_namespaces_keep_layouts_and_ranks_apart() -> None:
    """Risk: page_first bytes served to a layer_first pool, or rank 0's shard to rank 1."""
    ctrl_a, _host_a = rig("page_first", {"interface_v1": 1, "pool_bytes": "64MiB"})
    backend = ctrl_a.storage_backend
    try:
        spec_a = backend.store.spec
    finally:
        stop(ctrl_a)
    ctrl_b, _ = rig("layer_first", {"interface_v1": 1, "pool_bytes": "64MiB"})
    try:
        spec_b = ctrl_b.storage_backend.store.spec
    finally:
        stop(ctrl_b)
    assert spec_a.digest() != spec_b.digest()
    from kvcr_sglang.settings import namespace_for

    backend_geometry = backend.pages.geometry
    cfg = ctrl_a.storage_config
    settings = backend.settings
    import dataclasses

    rank1 = dataclasses.replace(cfg, tp_rank=1, tp_size=2)
    rank0 = dataclasses.replace(cfg, tp_rank=0, tp_size=2)
    assert (namespace_for(rank0, backend_geometry, settings).digest()
            != namespace_for(rank1, backend_geometry, settings).digest())
    mla0 = dataclasses.replace(rank0, is_mla_model=True)
    mla1 = dataclasses.replace(rank1, is_mla_model=True)
    assert (namespace_for(mla0, backend_geometry, settings).digest()
            == namespace_for(mla1, backend_geometry, settings).digest())


@pytest.mark.unit
def test_cache_salt_changes_sglang_keys_so_pages_never_cross_namespaces() -> None:
    """Risk: a salted request reads another tenant's pages."""
    from sglang.srt.mem_cache.utils import storage_namespace_seed

    toks = tokens(2, 8)
    plain = cpu_rig.page_keys(toks, SHAPE.page_tokens)
    salted = cpu_rig.page_keys(toks, SHAPE.page_tokens, storage_namespace_seed(None, "t1"))
    assert not set(plain) & set(salted)


@pytest.mark.integration
def test_clear_drops_this_namespace(harness, short_tmp: str) -> None:  # type: ignore[no-untyped-def]
    """Risk: SGLang's clear endpoint leaves pages that it promised were gone."""
    guard = harness.Guard(short_tmp).start()
    ctrl, host = rig("page_first", {"interface_v1": 1, "mode": "guarded",
                                    "socket": guard.socket})
    try:
        keys = cpu_rig.page_keys(tokens(2, 3), SHAPE.page_tokens)
        cpu_rig.fill_pages(host, 1, 2, seed=1)
        assert ctrl.page_set_func(keys, indices(1, 2))
        assert ctrl.storage_backend.batch_exists(keys) == 2
        ctrl.storage_backend.clear()
        assert ctrl.storage_backend.batch_exists(keys) == 0
    finally:
        stop(ctrl)


@pytest.mark.integration
def test_a_prefaulted_guards_pool_is_mapped_ahead_of_the_copies(harness, short_tmp: str
                                                                  ) -> None:  # type: ignore[no-untyped-def]
    """Risk: SGLang's first copies into and out of each page of a --prefault guard's pool
    pay a page fault each (a 64 MiB save 25 ms against 4 ms, measured), on its I/O path."""
    import time

    from kvcr_core.testing import mapped_kib

    guard = harness.Guard(short_tmp, "--prefault").start()
    ctrl, host = rig("page_first", {"interface_v1": 1, "mode": "guarded",
                                    "socket": guard.socket})
    try:
        keys = cpu_rig.page_keys(tokens(1, 5), SHAPE.page_tokens)
        cpu_rig.fill_pages(host, 1, 1, seed=5)
        assert ctrl.page_set_func(keys, indices(1, 1))
        region = ctrl.storage_backend.store.client.pool().region
        deadline = time.monotonic() + 30
        while mapped_kib(region.address) < region.size_bytes // 1024:
            assert time.monotonic() < deadline, mapped_kib(region.address)
            time.sleep(0.02)
    finally:
        stop(ctrl)


@pytest.mark.integration
def test_two_sglang_processes_share_pages_through_one_guard(harness, short_tmp: str
                                                            ) -> None:  # type: ignore[no-untyped-def]
    """Risk: pages stored by one SGLang process are not found, or not byte-exact, in another."""
    guard = harness.Guard(short_tmp).start()

    def side(role: str) -> dict[str, object]:
        out = subprocess.run([sys.executable, SIDE, guard.socket, role], capture_output=True,
                             text=True, timeout=240, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    wrote = side("write")
    read = side("read")
    assert wrote["stored"] == 8
    assert read["hits"] == 8 and read["filled"] == 8
    assert read["digest"] == wrote["digest"]
    assert guard.metric("kvcr_blocks_stored_total") == 8
    assert guard.metric("kvcr_lookup_hit_blocks_total") >= 8


@pytest.mark.unit
def test_guard_down_means_misses_and_sglang_proceeds(short_tmp: str) -> None:
    """Risk: kvcr being unreachable fails or hangs SGLang's storage threads."""
    ctrl, _host = rig("page_first", {"interface_v1": 1, "mode": "guarded",
                                    "socket": os.path.join(short_tmp, "none.sock"),
                                    "timeout_s": 0.5})
    try:
        keys = cpu_rig.page_keys(tokens(2, 4), SHAPE.page_tokens)
        assert ctrl.page_set_func(keys, indices(1, 2)) is False
        op = ctrl.prefetch("req-down", tokens(2, 4))
        op = cpu_rig.drain(ctrl.prefetch_hit_queue, 30)
        assert op.storage_hit_count == 0
        assert ctrl.storage_backend.batch_get_v1(keys, indices(3, 2)) == [False, False]
        assert ctrl.storage_backend.kvcr_stats()["failures"] >= 3
    finally:
        stop(ctrl)


@pytest.mark.unit
def test_random_backend_failures_never_serve_a_corrupted_page(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: with SGLang's failure injector on, a failed store leaves a page that reads back
    wrong (a page is only ever reported read when its bytes are exact)."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    ctrl, host = rig("page_first", {"interface_v1": 1, "pool_bytes": "64MiB"})
    try:
        assert type(ctrl.storage_backend).__name__ == "HiCacheStorageFailureInjector"
        from sglang.srt.managers.cache_controller import PrefetchOperation

        checked = 0
        for round_ in range(30):
            keys = cpu_rig.page_keys(tokens(2, 100 + round_), SHAPE.page_tokens)
            cpu_rig.fill_pages(host, 1, 2, seed=round_)
            want = cpu_rig.page_bytes(host, 1, 2)
            ctrl.page_set_func(keys, indices(1, 2))
            cpu_rig.zero_pages(host, 5, 2)
            got = ctrl.page_get_func(PrefetchOperation("r", []), keys, indices(5, 2))
            assert cpu_rig.page_bytes(host, 5, got) == want[:got]
            checked += got
        assert checked > 0
    finally:
        stop(ctrl)


@pytest.mark.unit
@pytest.mark.parametrize("verify", [False, True])
def test_verified_reads_never_serve_a_page_changed_in_the_pool(verify: bool) -> None:
    """Risk: a page scribbled over in the shared pool after its commit is read into SGLang's
    host pool as good KV. With verify_loads the read hashes what it copied: the changed page
    and those after it are misses (counted); without it the scribble is served (what the
    setting is for)."""
    from sglang.srt.managers.cache_controller import PrefetchOperation

    from kvcr_sglang.pagestore import block_key

    ctrl, host = rig("page_first", {"interface_v1": 1, "pool_bytes": "64MiB",
                                    "kvcr": {"verify_loads": verify}})
    try:
        keys = cpu_rig.page_keys(tokens(3, 7), SHAPE.page_tokens)
        cpu_rig.fill_pages(host, 1, 3, seed=9)
        want = cpu_rig.page_bytes(host, 1, 3)
        assert ctrl.page_set_func(keys, indices(1, 3)) is True
        assert ctrl.storage_backend.store.sealer.flush(10)  # (this reaches past the store)
        client = ctrl.storage_backend.store.client
        lease = client.acquire([block_key(k) for k in keys])
        client.pool().view(lease.slots[1])[64:72] = b"scribble"
        client.release(lease.op)
        cpu_rig.zero_pages(host, 8, 3)
        got = ctrl.page_get_func(PrefetchOperation("r", []), keys, indices(8, 3))
        stats = ctrl.storage_backend.kvcr_stats()
        if verify:
            assert got == 1 and stats["corrupt_pages"] == 1
            assert cpu_rig.page_bytes(host, 8, 1) == want[:1]
        else:
            assert got == 3 and stats["corrupt_pages"] == 0
    finally:
        stop(ctrl)


@pytest.mark.unit
def test_v2_hybrid_pools_round_trip_and_apply_sglang_hit_policies() -> None:
    """Risk: hybrid models (KV plus a Mamba state pool, SGLang's v2 interface) restore a
    prefix whose side state is missing, or restore side state permuted."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageConfig,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    _, dev = cpu_rig.device_pool(SHAPE)
    host = cpu_rig.host_pool(dev, SHAPE, "page_first")
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="kvcr-tiny", extra_config={**KVCR_EXTRA, "interface_v1": 1,
                                              "pool_bytes": "64MiB"})
    # SGLang's hybrid order: build, register the anchor pool, every v2 pool, then finalize.
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 9, 4, 8),
                                conv=(torch.zeros(2, 9, 3, 5),))
    mamba = MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False,
                          layout="page_first")
    backend.register_mem_pool_host(host)
    backend.register_mem_host_pool_v2(host, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.on_host_pools_registered()
    try:
        g = torch.Generator().manual_seed(4)
        for slot in (1, 2):
            flat = mamba.get_dummy_flat_data_page()
            mamba.set_from_flat_data_page(slot, torch.randn(flat.shape, generator=g))
        states = [mamba.get_data_page(s, flat=True).clone() for s in (1, 2)]
        keys = cpu_rig.page_keys(tokens(4, 12), SHAPE.page_tokens)
        cpu_rig.fill_pages(host, 1, 4, seed=12)
        want_kv = cpu_rig.page_bytes(host, 1, 4)
        done = backend.batch_set_v2([
            PoolTransfer(name=PoolName.KV, host_indices=indices(1, 4), keys=keys),
            PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1, 2]),
                         keys=[keys[1], keys[3]])])
        assert done == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True, True]}
        trailing = PoolTransfer(name=PoolName.MAMBA, keys=[keys[3]],
                                hit_policy=PoolHitPolicy.TRAILING_PAGES)
        result = backend.batch_exists_v2(keys, [trailing])
        assert result.restorable_prefix_pages == [2, 4] and result.kv_hit_pages == 4
        every = PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
        assert backend.batch_exists_v2(keys, [every]).kv_hit_pages == 0

        cpu_rig.zero_pages(host, 10, 4)
        for s in (5, 6):
            mamba.set_from_flat_data_page(s, mamba.get_dummy_flat_data_page())
        got = backend.batch_get_v2([
            PoolTransfer(name=PoolName.KV, host_indices=indices(10, 4), keys=keys),
            PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5, 6]),
                         keys=[keys[1], keys[3]])])
        assert got == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True, True]}
        assert cpu_rig.page_bytes(host, 10, 4) == want_kv
        assert all(torch.equal(mamba.get_data_page(s, flat=True), want)
                   for s, want in zip((5, 6), states, strict=True))
        assert backend.batch_get_v1(keys, indices(20, 4)) == [True] * 4  # v1 sees v2's KV
    finally:
        backend.close()
