"""A hybrid model's KV cache groups on the scheduler side and in the connector's settings:
one namespace per group, a prefix served only when every group holds it, each group's load
and save plans naming the blocks vLLM holds for it (a sliding-window group's null blocks
never copied), and KV cache groups kvcr cannot serve refused at start. (Unit: in-process
Runner, no engine; real engines in test_vllm_hybrid.py.)"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the scheduler side ships vLLM's metadata and stats types")

from kvcr_core.errors import ConfigError
from kvcr_vllm.settings import kv_groups

sys.path.insert(0, os.path.dirname(__file__))
from scheduler_rig import BLOCK, Blocks, FakeRequest, Node, output

pytestmark = pytest.mark.unit

TOKENS = list(range(100, 133))  # 33 tokens: 8 full blocks of 4 and one partial
HYBRID = ("sliding_window:8", "full")  # group 0: a 2-block window; group 1: full attention


def slots_of(node: Node, ns: int, tokens: list[int]) -> list[int]:
    lease = node.stores[ns].acquire(node.keys(tokens, ns))
    node.stores[ns].release(lease.op)
    return [int(s) for s in lease.slots if s is not None]


def test_each_group_has_its_own_namespace_and_a_single_group_keeps_the_old_one() -> None:
    """Risk: a sliding-window group's blocks and a full group's blocks under one key (the
    load of one group would copy the other's KV), or a full-attention model's keys changed
    by hybrid support (every pool and router table of existing users invalidated)."""
    hybrid = Node(attention=HYBRID).specs
    assert len({s.digest() for s in hybrid}) == 2
    assert [s.extra["attention"] for s in hybrid] == list(HYBRID)
    plain = Node().specs
    assert len(plain) == 1 and plain[0].extra == {}


def test_a_prefix_is_a_hit_only_as_far_as_every_group_holds_it() -> None:
    """Risk: a hit reported for blocks one group lacks: vLLM skips computing them and its
    sliding-window layers read KV nobody wrote."""
    node = Node(attention=HYBRID)
    node.stock(TOKENS[:24], namespaces=[1])  # full attention: 6 blocks
    node.stock(TOKENS[:12], namespaces=[0])  # sliding window: 3 blocks
    request = FakeRequest("r1", TOKENS)
    node.scheduler.on_new_request(request)
    assert node.scheduler.get_num_new_matched_tokens(request, 0) == (12, True)


def test_each_group_loads_the_blocks_vllm_holds_for_it_and_no_null_block() -> None:
    """Risk: the null block (vLLM's block 0, shared by every skipped position) overwritten by
    a load, or a sliding-window group loaded from the full group's slots; a request reported
    loaded before its last group's copy."""
    node = Node(attention=HYBRID)
    node.stock(TOKENS[:24])
    request = FakeRequest("r1", TOKENS)
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 8) == (16, True)  # blocks 2..5
    window = [0, 0, 0, 0, 24, 25, 26, 27, 28]  # positions 0-3 outside the window: null
    sched.update_state_after_alloc(request, Blocks(window, list(range(10, 19))), 16)
    sliding, full = sched.build_connector_meta(output()).loads
    assert (sliding.group, full.group) == (0, 1)
    assert full.block_ids == (12, 13, 14, 15)
    assert full.slots_by_rank == (tuple(slots_of(node, 1, TOKENS[:24])[2:6]),)
    assert sliding.block_ids == (24, 25)  # positions 4 and 5: the window's
    assert sliding.slots_by_rank == (tuple(slots_of(node, 0, TOKENS[:24])[4:6]),)
    assert sliding.failed_block_ids == full.failed_block_ids == ()
    assert all(store.index.open_leases == 1 for store in node.stores)  # every group leased


def test_each_group_saves_its_own_blocks_without_the_null_ones() -> None:
    """Risk: a group's saves filed under another group's keys, or vLLM's null block saved
    as the KV of a position (every later hit there would load zeros)."""
    node = Node(attention=HYBRID)
    request = FakeRequest("r1", TOKENS)
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 16) == (0, False)
    window = ([0, 0, 0, 33, 34, 35, 36, 37, 38])  # a local hit of 4 blocks: 3 outside
    meta = sched.build_connector_meta(output(new=[("r1", (window, list(range(10, 19))),
                                                    16, 17)]))
    sliding, full = meta.saves
    assert (sliding.group, full.group) == (0, 1)
    assert full.block_ids == tuple(range(10, 18))
    assert full.keys_by_rank == (tuple(node.keys(TOKENS[:32], 1)),)
    assert sliding.block_ids == (33, 34, 35, 36, 37)
    assert sliding.keys_by_rank == (tuple(node.keys(TOKENS[:32], 0)[3:]),)


def test_two_tp_ranks_of_a_hybrid_model_plan_per_rank_and_group() -> None:
    """Risk: rank-major namespaces mixed up with group-major ones: rank 1 copying rank 0's
    sliding-window slots."""
    node = Node(tp=2, attention=HYBRID)
    node.stock(TOKENS[:16])
    request = FakeRequest("r1", TOKENS)
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (16, True)
    sched.update_state_after_alloc(request, Blocks([0, 0, 12, 13, 14], [5, 6, 7, 8, 9]), 16)
    sliding, full = sched.build_connector_meta(output()).loads
    assert full.slots_by_rank == tuple(tuple(slots_of(node, ns, TOKENS[:16])) for ns in (1, 3))
    assert sliding.slots_by_rank == tuple(tuple(slots_of(node, ns, TOKENS[:16])[2:])
                                          for ns in (0, 2))


def group(spec: object, *layers: str) -> SimpleNamespace:
    return SimpleNamespace(layer_names=list(layers), kv_cache_spec=spec)


def test_kv_cache_groups_kvcr_cannot_serve_are_refused_with_the_model_type() -> None:
    """Risk: a Mamba hybrid served with attention-only KV (its state missing from every hit),
    or groups of unequal block sizes packed into one slot size."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64,
                               dtype=torch.float32, sliding_window=64)
    ok = kv_groups(SimpleNamespace(kv_cache_groups=[group(window, "a"), group(full, "b")]))
    assert [g.attention for g in ok] == ["sliding_window:64", "full"]
    assert ok[0].block_bytes == ok[1].block_bytes == full.page_size_bytes
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ConfigError, match=r"model_type nemotron_h.*MambaSpec.*without KVCR"):
        kv_groups(SimpleNamespace(kv_cache_groups=[group(full, "a"), group(mamba, "m")]),
                  "nemotron_h")
    with pytest.raises(ConfigError, match="one size"):
        kv_groups(SimpleNamespace(kv_cache_groups=[group(full, "a", "b"), group(window, "c")]),
                  "gemma3")
    assert BLOCK  # (the rig's slot size: the groups above are vLLM's own specs)


def test_an_mla_model_keeps_one_namespace_for_every_tp_rank() -> None:
    """Risk: latent-attention KV (the same on every TP rank) stored once per rank: TP times
    the pool room and the save bytes for nothing; or one namespace shared by a TP 1 engine
    with no marker (a full-attention model's keys of its TP 1 layout)."""
    node = Node(tp=2, attention=("mla",))
    (shared,) = node.specs
    assert shared.tp_rank == 0 and shared.tp_size == 2 and shared.extra == {"tp_ranks": "shared"}
    assert node.namespaces.of_group(0) == [0, 0]
    assert node.namespaces.writes(0, 0) and not node.namespaces.writes(1, 0)
    assert Node(tp=1, attention=("mla",)).specs[0].extra == {}
    assert len(Node(tp=2, attention=("full",)).specs) == 2  # other KV differs per rank
    node.stock(TOKENS[:16])
    request = FakeRequest("r1", TOKENS)
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (16, True)
    sched.update_state_after_alloc(request, Blocks([5, 6, 7, 8, 9]), 16)
    (plan,) = sched.build_connector_meta(output()).loads
    slots = tuple(slots_of(node, 0, TOKENS[:16]))
    assert plan.slots_by_rank == (slots, slots)  # every rank reads the one copy
    assert node.stores[0].index.open_leases == 1
    saving = FakeRequest("r2", TOKENS[:8] + [7] * 25)
    sched.on_new_request(saving)
    sched.get_num_new_matched_tokens(saving, 0)
    (save,) = sched.build_connector_meta(output(new=[("r2", [1, 2], 0, 8)])).saves
    keys = tuple(node.keys(saving.all_token_ids[:8], 0))
    assert save.keys_by_rank[0] == save.keys_by_rank[1] == keys


def test_a_hybrid_hit_cut_short_before_its_load_is_recomputed_whole() -> None:
    """Risk: a block evicted between lookup and lease shortens a hybrid model's hit, and the
    sliding-window layers of the shorter prefix's end read blocks nobody loaded (vLLM
    allocated the window at the planned end)."""
    node = Node(attention=HYBRID)
    node.stock(TOKENS[:24])
    request = FakeRequest("r1", TOKENS)
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (24, True)
    store = node.stores[1]
    with store.lock:  # the full group's block 4 evicted before the lease
        store.index.discard([node.keys(TOKENS[:24], 1)[4]])
    window = [0, 0, 0, 0, 24, 25, 26]
    sched.update_state_after_alloc(request, Blocks(window, list(range(10, 17))), 24)
    sliding, full = sched.build_connector_meta(output()).loads
    assert sliding.block_ids == full.block_ids == ()
    assert full.failed_block_ids == tuple(range(10, 16)) and sliding.failed_block_ids == (24, 25)
    assert node.counters()["failures_evicted_before_load"] == 6
