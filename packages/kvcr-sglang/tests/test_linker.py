"""KVCRUnifiedCacheLinker through SGLang's real linker factory, on a real device KV pool
(CPU tensors): offload, lookup, layer-wise load, and the failure paths; with a copy engine that
completes later (as a GPU stream does), the ordering rules: no layer reported loaded and no
offload committed before its copies completed, a failed copy publishes nothing, the pool is
unpinned before it is unmapped."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.unit

sglang = pytest.importorskip("sglang", reason="runs in .venv-sglang (scripts/setup_sglang.sh)")

import torch  # noqa: E402

from kvcr_bench import sglang_rig as cpu_rig  # noqa: E402
from kvcr_bench.sglang_rig import PoolShape  # noqa: E402
from kvcr_core.testing import ThreadedCopyEngine  # noqa: E402

SHAPE = PoolShape()


def build(extra: dict[str, object]):  # type: ignore[no-untyped-def]
    import argparse

    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
    from sglang.srt.server_args import ServerArgs

    config = {"linker": "KVCRUnifiedCacheLinker", "linker_module_path": "kvcr_sglang.linker",
              "linker_extra_config": extra}
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "tiny", "--enable-unified-cache-external-linker",
                              "--unified-cache-external-linker-backend", "dynamic",
                              "--unified-cache-external-linker-config", json.dumps(config)])
    assert args.unified_cache_external_linker_config == config  # parsed by SGLang's flag
    cpu_rig.single_rank()
    alloc, dev = cpu_rig.device_pool(SHAPE)
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=alloc, page_size=SHAPE.page_tokens)
    linker = create_unified_cache_linker(
        args, params, backend=args.unified_cache_external_linker_backend,
        config=args.unified_cache_external_linker_config,
        components={ComponentType.FULL})
    return linker, dev


def idx(first_page: int, n: int) -> torch.Tensor:
    p = SHAPE.page_tokens
    return torch.arange(first_page * p, (first_page + n) * p, dtype=torch.int64)


def fill(dev, first_page: int, n: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    rows = idx(first_page, n)
    for buf in (*dev.k_buffer, *dev.v_buffer):
        raw = torch.randint(0, 256, (rows.numel(), buf[0].numel() * buf.element_size()),
                            generator=g, dtype=torch.uint8)
        buf.view(torch.uint8).view(buf.shape[0], -1)[rows] = raw


def pages(dev, first_page: int, n: int) -> list[bytes]:  # type: ignore[no-untyped-def]
    rows = idx(first_page, n)
    return [buf.view(torch.uint8).view(buf.shape[0], -1)[rows].numpy().tobytes()
            for buf in (*dev.k_buffer, *dev.v_buffer)]


def kv(keys: list[str], first_page: int):  # type: ignore[no-untyped-def]
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.KV, keys=keys, device_indices=idx(first_page, len(keys)))]


def wait_offloads(linker, n: int) -> list[bool]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 30
    while linker.num_completed_offloads() < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return [linker.pop_completed_offload() for _ in range(n)]


def load(linker, keys: list[str], first_page: int) -> bool:  # type: ignore[no-untyped-def]
    assert linker.load("rid-1", kv(keys, first_page))
    index = linker.start_layer_wise_loading()
    linker.layer_done_counter.set_consumer(index)
    for layer in range(SHAPE.layers):  # what the forward does before reading each layer
        linker.layer_done_counter.wait_until(layer)
    return bool(linker.finish_layer_wise_loading(index))


def test_offload_lookup_and_layer_wise_load_are_bit_exact() -> None:
    """Risk: the linker restores pages permuted across layers, K/V or pages."""
    linker, dev = build({"pool_bytes": "64MiB"})
    try:
        keys = cpu_rig.page_keys(list(range(1000, 1000 + 4 * SHAPE.page_tokens)),
                                 SHAPE.page_tokens)
        fill(dev, 1, 4, seed=5)
        want = pages(dev, 1, 4)
        assert linker.offload(kv(keys, 1))
        assert wait_offloads(linker, 1) == [True]
        assert linker.lookup("rid-1", kv([*keys, "f" * 64], 1)) == [1, 2, 3, 4]
        assert load(linker, keys, 10)
        assert pages(dev, 10, 4) == want
        assert linker.cancel_queued_load("nobody") is False
    finally:
        linker.close()


def test_a_page_gone_before_loading_fails_the_batch_not_the_bytes() -> None:
    """Risk: a load whose pages were evicted after lookup returns stale slots as loaded."""
    linker, dev = build({"pool_bytes": "64MiB"})
    try:
        keys = cpu_rig.page_keys(list(range(7, 7 + 2 * SHAPE.page_tokens)), SHAPE.page_tokens)
        fill(dev, 1, 2, seed=1)
        linker.offload(kv(keys, 1))
        assert wait_offloads(linker, 1) == [True]
        linker.store.clear()  # gone between lookup and load
        assert load(linker, keys, 5) is False
    finally:
        linker.close()


def test_linker_with_guard_down_misses_and_offloads_report_failure(short_tmp: str) -> None:
    """Risk: an unreachable kvcr-guard blocks SGLang's scheduler or reports offloads done."""
    linker, _dev = build({"mode": "guarded", "socket": f"{short_tmp}/none.sock",
                         "timeout_s": 0.5})
    try:
        keys = cpu_rig.page_keys(list(range(64)), SHAPE.page_tokens)
        assert linker.lookup("rid-1", kv(keys, 1)) == []
        linker.offload(kv(keys, 1))
        assert wait_offloads(linker, 1) == [False]
        assert load(linker, keys, 5) is False
    finally:
        linker.close()


@pytest.fixture
def delayed(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The linker built next copies through a ThreadedCopyEngine (returned)."""
    import kvcr_sglang.linker

    engine = ThreadedCopyEngine()
    monkeypatch.setattr(kvcr_sglang.linker, "engine_for", lambda device: engine)
    yield engine
    engine.close()


def test_nothing_is_reported_before_its_copies_completed(delayed) -> None:
    """Risk (GPU ordering): an offload committed, or a layer reported loaded, while its copy
    is still in flight: peers or the forward read bytes that have not landed."""
    linker, dev = build({"pool_bytes": "64MiB"})
    try:
        keys = cpu_rig.page_keys(list(range(500, 500 + 2 * SHAPE.page_tokens)),
                                 SHAPE.page_tokens)
        fill(dev, 1, 2, seed=9)
        want = pages(dev, 1, 2)
        delayed.hold()
        linker.offload(kv(keys, 1))
        time.sleep(0.3)
        assert linker.num_completed_offloads() == 0 and linker.store.prefix_hits(keys) == 0
        delayed.release()
        assert wait_offloads(linker, 1) == [True] and linker.store.prefix_hits(keys) == 2
        delayed.hold()
        assert linker.load("rid-2", kv(keys, 20))
        index = linker.start_layer_wise_loading()
        time.sleep(0.3)
        assert not linker.layer_done_counter.futures[index][0].done()
        delayed.release()
        assert linker.finish_layer_wise_loading(index) and pages(dev, 20, 2) == want
    finally:
        linker.close()


def test_a_failed_copy_publishes_nothing_and_fails_the_load(delayed) -> None:
    """Risk: a copy that fails on the device is committed (offload) or reported loaded."""
    linker, dev = build({"pool_bytes": "64MiB"})
    try:
        keys = cpu_rig.page_keys(list(range(900, 900 + 2 * SHAPE.page_tokens)),
                                 SHAPE.page_tokens)
        fill(dev, 1, 2, seed=3)
        delayed.fail_next_copy()
        linker.offload(kv(keys, 1))
        assert wait_offloads(linker, 1) == [False] and linker.store.prefix_hits(keys) == 0
        linker.offload(kv(keys, 1))
        assert wait_offloads(linker, 1) == [True]
        delayed.fail_next_copy()
        assert load(linker, keys, 30) is False
    finally:
        linker.close()


def test_closing_unpins_the_pool_before_unmapping_it(delayed) -> None:
    """Risk: the pool mapping is unmapped while still registered for DMA."""
    linker, dev = build({"pool_bytes": "64MiB"})
    keys = cpu_rig.page_keys(list(range(64)), SHAPE.page_tokens)
    fill(dev, 1, 1, seed=4)
    linker.offload(kv(keys, 1))
    assert wait_offloads(linker, 1) == [True]
    linker.close()
    assert [event for event, _ in delayed.log] == ["pin", "unpin", "unmap"]
