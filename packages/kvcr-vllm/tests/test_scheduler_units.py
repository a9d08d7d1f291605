"""The connector's scheduler side without an engine: request arrival, lookup, asynchronous load,
"ask again" while a hinted fetch runs (on every TP rank), the fetch deadline, finish,
preemption, a lost Runner. Driven through the same calls vLLM makes, on the real RunnerService
over an in-process Runner per node (kvcr_core.testing: peers are other in-process Runners, no
socket, a manual clock); the end-to-end tests with real engines are in test_vllm_e2e.py."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the scheduler side ships vLLM's metadata and stats types")

import os
import sys

from prometheus_client import CollectorRegistry

from kvcr_core.attach.service import Grant
from kvcr_core.checksums import block_checksum
from kvcr_core.config import KVCRConfig
from kvcr_core.keys import router_hash_kvcr_v1
from kvcr_core.runner import Runner
from kvcr_core.testing import pattern_block
from kvcr_vllm.metadata import WorkerReport

sys.path.insert(0, os.path.dirname(__file__))
from scheduler_rig import (
    BLOCK,
    PEER,
    Blocks,
    FakeRequest,
    Node,
    output,
)

pytestmark = pytest.mark.unit


def hint(tokens: list[int], node: Node, source: str = PEER) -> dict[str, Any]:
    hashes = [router_hash_kvcr_v1(k) for k in node.keys(tokens)]
    return {"kv_hint": json.dumps({
        "protocol_version": "0.1", "message_id": "m-1",
        "actions": [{"action_type": "kv.fetch", "action_version": "1.0",
                     "payload": {"source_control_endpoint": source,
                                 "block_hashes": hashes}}]})}


TOKENS = list(range(100, 133))  # 33 tokens: 8 full blocks and one partial


def test_a_hit_loads_asynchronously_under_a_lease_released_when_the_load_ends() -> None:
    """Risk: blocks evicted while workers copy them, leases leaked after the load, or a hit
    reported that vLLM already holds itself."""
    node = Node()
    node.stock(TOKENS[:24])  # 6 blocks in kvcr
    request = FakeRequest("r1", TOKENS)
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 8) == (16, True)  # blocks 2..5
    sched.update_state_after_alloc(request, Blocks(list(range(10, 19))), 16)
    meta = sched.build_connector_meta(output())
    (plan,) = meta.loads
    assert plan.block_ids == (12, 13, 14, 15) and len(plan.slots_by_rank[0]) == 4
    store = node.stores[0]
    assert store.index.open_leases == 1
    sched.update_connector_output(SimpleNamespace(finished_recving={"r1"}))
    assert store.index.open_leases == 0
    assert sched.get_num_new_matched_tokens(FakeRequest("r2", TOKENS), 24) == (0, False)
    finished, params = sched.request_finished(request, [])
    assert not finished and params == {"kvcr_loaded_tokens": 16, "kvcr_saved_blocks": 6}
    assert node.counters()["lookup_hit_tokens"] == 16


def test_a_synchronous_load_runs_in_its_step_and_its_lease_ends_when_the_step_did() -> None:
    """Risk (host KV caches load in the step that runs the request): a lease released before
    the workers copied (the blocks could be evicted and overwritten mid-copy) or never; a hit
    that leaves vLLM no token to compute (a whole-prompt hit must stop one token short)."""
    node = Node(tp=2, synchronous_loads=True)
    node.stock(TOKENS[:32])  # all 8 full blocks in kvcr; the prompt has 33 tokens
    sched = node.scheduler
    whole = FakeRequest("r0", TOKENS[:32])
    sched.on_new_request(whole)
    assert sched.get_num_new_matched_tokens(whole, 0) == (31, False)  # vLLM computes token 32
    request = FakeRequest("r1", TOKENS)
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 8) == (24, False)  # blocks 2..7
    sched.update_state_after_alloc(request, Blocks(list(range(10, 19))), 24)
    meta = sched.build_connector_meta(output())
    (plan,) = meta.loads
    assert plan.synchronous and plan.block_ids == (12, 13, 14, 15, 16, 17)
    stores = node.stores
    assert [s.index.open_leases for s in stores] == [1, 1]
    sched.update_connector_output(SimpleNamespace(finished_recving=None,
                                                  kv_connector_worker_meta=None))
    assert [s.index.open_leases for s in stores] == [1, 1]  # that step did not carry it
    done = WorkerReport(frozenset({"r1"})).aggregate(WorkerReport(frozenset({"other"})))
    sched.update_connector_output(SimpleNamespace(finished_recving=None,
                                                  kv_connector_worker_meta=done))
    assert [s.index.open_leases for s in stores] == [0, 0]
    finished, params = sched.request_finished(request, [])
    assert not finished and params == {"kvcr_loaded_tokens": 24, "kvcr_saved_blocks": 8}


@pytest.mark.parametrize("params", ["kv_hint", ["kv_hint"], 7, {"kv_hint": ["x"]},
                                    {"kv_hint": "not json"}])
def test_kv_transfer_params_of_any_shape_never_break_the_scheduler(params: Any) -> None:
    """Risk: kv_transfer_params reach the scheduler as whatever a client put in vllm_xargs
    (a string or a list: vLLM passes them on unchecked); `"kv_hint" in params` matched a
    string and indexing it crashed the engine's scheduler."""
    node = Node()
    node.stock(TOKENS[:16])
    request = FakeRequest("r1", TOKENS, kv_transfer_params=params)
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (16, True)  # served as unhinted


@pytest.mark.parametrize(("setting", "shared", "verify"), [
    (False, True, False), (True, False, True), ("auto", False, False), ("auto", True, True)])
def test_verified_loads_carry_the_committed_checksums_to_every_rank(
        setting: bool | str, shared: bool, verify: bool) -> None:
    """Risk: verify_loads set (or "auto", the default, in a namespace other uids map too)
    but the load plan carries no checksums (nothing is checked), or checksums that are not
    the ones committed for the leased slots."""
    node = Node(2, extra={"kvcr": {"verify_loads": setting}})
    node.ops.ops.grants = [Grant(shared=shared)] * 2
    node.stock(TOKENS[:16])
    request = FakeRequest("r1", TOKENS)
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (16, True)
    sched.update_state_after_alloc(request, Blocks(list(range(10, 19))), 16)
    (plan,) = sched.build_connector_meta(output()).loads
    if not verify:
        assert plan.checksums_by_rank == ()
        return
    for store, slots, sums in zip(node.stores, plan.slots_by_rank, plan.checksums_by_rank,
                                  strict=True):
        pool = store.pool
        assert list(sums) == [block_checksum(pool.view(s)) for s in slots] and len(sums) == 4


@pytest.mark.parametrize("tp", [1, 2])
def test_a_hinted_fetch_asks_again_until_every_rank_has_the_prefix(tp: int) -> None:
    """Risk: a hinted fetch that only fills TP rank 0 (the other ranks then miss and vLLM
    recomputes), or a scheduler that reports a hit before the fetch ended."""
    source = Runner(KVCRConfig(pool_bytes=256 * BLOCK, namespace_pool_bytes=64 * BLOCK),
                             registry=CollectorRegistry())
    node = Node(tp, sources={PEER: source}, answer_after_polls=2)
    for rank, s in enumerate(node.specs):
        keys = node.keys(TOKENS, rank)
        source.open_namespace(s, BLOCK).store(keys, [pattern_block(k, BLOCK) for k in keys])
    request = FakeRequest("r1", TOKENS, kv_transfer_params=hint(TOKENS, node))
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)  # fetch started
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)  # still running
    assert sched.get_num_new_matched_tokens(request, 0) == (32, True)  # ended: 8 blocks
    assert node.ops.calls["peer_fetch"] == 1  # one fetch for every rank
    for rank, store in enumerate(node.stores):
        keys = node.keys(TOKENS, rank)
        assert store.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    sched.update_state_after_alloc(request, Blocks(list(range(1, 10))), 32)  # (0: vLLM's null)
    (plan,) = sched.build_connector_meta(output()).loads
    assert len(plan.slots_by_rank) == tp and all(len(s) == 8 for s in plan.slots_by_rank)
    counters = node.counters()
    assert counters["peer_fetched_blocks"] == 8 and "failures_peer_fetch" not in counters


@pytest.mark.parametrize("pull", [False, True])
def test_a_short_fetch_is_waited_for_and_loaded_in_the_same_step(pull: bool) -> None:
    """Risk: a hinted (or pulled) fetch that ends within milliseconds still costs the request
    whole engine steps of "ask again" (and starves the fetching thread of the GIL while the
    engine loop spins), where the scheduler could have waited for it."""
    node = Node(sources={PEER: None}, answer_after_polls=3, extra={"fetch_wait_s": 0.05})
    source = stocked_source(node, TOKENS)
    node.peers.sources[PEER] = source
    request = FakeRequest("r1", TOKENS, kv_transfer_params=None if pull else hint(TOKENS, node))
    sched = node.scheduler
    sched.on_new_request(request)
    start = node.clock()
    assert sched.get_num_new_matched_tokens(request, 0) == (32, True)  # one call: no ask again
    assert node.clock() - start < 0.05  # it slept only while the fetch ran
    assert node.ops.calls["peer_fetch"] == 1
    # one lookup (the local prefix before the fetch): the completed fetch answers the hit
    assert node.ops.calls["lookup_all"] == 1
    sched.update_state_after_alloc(request, Blocks(list(range(1, 10))), 32)  # (0: vLLM's null)
    (plan,) = sched.build_connector_meta(output()).loads
    assert len(plan.block_ids) == 8  # the lease found every fetched block
    counters = node.counters()
    assert counters["pulled_blocks" if pull else "peer_fetched_blocks"] == 8
    assert counters["fetch_wait_expired"] == 0


def test_a_long_fetch_is_waited_for_once_then_polled_each_step() -> None:
    """Risk: the scheduler blocks the engine for a slow peer beyond `fetch_wait_s` (every
    running request's next token waits), or waits again at every step."""
    node = Node(sources={PEER: None}, extra={"fetch_wait_s": 0.05})
    request = FakeRequest("r1", TOKENS, kv_transfer_params=hint(TOKENS, node))
    sched = node.scheduler
    sched.on_new_request(request)
    start = node.clock()
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    assert 0.05 <= node.clock() - start < 0.06
    polls = node.ops.calls["peer_poll"]
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    assert node.clock() - start < 0.06 and node.ops.calls["peer_poll"] == polls + 1
    assert node.counters()["fetch_wait_expired"] == 1


def test_a_silent_peer_ends_the_wait_at_the_deadline_and_the_request_recomputes() -> None:
    """Risk: a request parked forever ("ask again" at every step) on a peer that never
    answers."""
    node = Node(sources={PEER: None})
    request = FakeRequest("r1", TOKENS, kv_transfer_params=hint(TOKENS, node))
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    node.clock.advance(2.5)
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    node.clock.advance(1.0)  # past the deadline and the grace second
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert node.counters()["failures_peer_fetch"] == 8


def test_a_hint_naming_a_stranger_is_refused_and_counted() -> None:
    """Risk: a hint makes the engine dial an endpoint nobody configured."""
    node = Node(sources={PEER: None})
    request = FakeRequest("r1", TOKENS,
                          kv_transfer_params=hint(TOKENS, node, "tcp://10.9.9.9:1"))
    node.scheduler.on_new_request(request)
    assert node.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert node.ops.calls["peer_fetch"] == 0
    assert node.counters()["failures_peer_not_allowed"] == 1


def test_saves_follow_the_steps_and_a_resumed_request_starts_over() -> None:
    """Risk: a block saved twice or never, a partial block saved, or a preempted request's
    old block ids used after it resumed with new ones."""
    node = Node(tp=2)
    request = FakeRequest("r1", TOKENS)
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = sched.build_connector_meta(output(new=[("r1", list(range(20, 29)), 0, 10)]))
    (save,) = meta.saves
    assert save.block_ids == (20, 21)  # 10 tokens: two full blocks
    assert [list(k) for k in save.keys_by_rank] == [node.keys(TOKENS[:8], r) for r in (0, 1)]
    meta = sched.build_connector_meta(output(cached=[("r1", [], 10, 23, False)]))
    assert meta.saves[0].block_ids == (22, 23, 24, 25, 26, 27)  # up to 33 tokens: 8 blocks
    meta = sched.build_connector_meta(output(cached=[("r1", list(range(40, 49)), 0, 33, True)]))
    assert meta.saves == []  # resumed: its 8 blocks were planned already
    assert sched.request_finished(request, [])[1] == {"kvcr_loaded_tokens": 0,
                                                       "kvcr_saved_blocks": 8}


def test_a_lost_runner_costs_nothing_but_the_cache() -> None:
    """Risk: a dead Runner fails or stalls requests instead of degrading to recompute."""
    node = Node()
    node.stock(TOKENS)
    node.ops.down = True
    request = FakeRequest("r1", TOKENS)
    node.scheduler.on_new_request(request)
    assert node.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert node.counters()["failures_guard_unavailable"] == 1


def stocked_source(node: Node, tokens: list[int]) -> Runner:
    """Another node's Runner holding every rank's full blocks of `tokens`."""
    source = Runner(KVCRConfig(pool_bytes=256 * BLOCK, namespace_pool_bytes=64 * BLOCK),
                    registry=CollectorRegistry())
    for rank, s in enumerate(node.specs):
        keys = node.keys(tokens, rank)
        source.open_namespace(s, BLOCK).store(keys, [pattern_block(k, BLOCK) for k in keys])
    return source


@pytest.mark.parametrize("tp", [1, 2])
def test_a_miss_pulls_the_run_a_peer_holds_without_any_hint(tp: int) -> None:
    """Risk: without a router's hint a prompt another node holds is recomputed (no pull),
    only rank 0 is pulled, or the scheduler reports a hit before the pull ended."""
    node = Node(tp, sources={PEER: None}, answer_after_polls=2)
    node.stock(TOKENS[:8])  # 2 blocks here; the peer holds all 8
    source = stocked_source(node, TOKENS)
    node.peers.sources[PEER] = source
    request = FakeRequest("r1", TOKENS)
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)  # pull started
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)  # still running
    assert sched.get_num_new_matched_tokens(request, 0) == (32, True)
    assert node.ops.calls["remote_run"] == 1
    assert node.ops.calls["peer_fetch"] == 1  # one fetch for every rank
    for rank, store in enumerate(node.stores):
        keys = node.keys(TOKENS, rank)
        assert store.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    counters = node.counters()
    assert counters["pull_lookups"] == 1 and counters["pulled_blocks"] == 6
    assert counters["pulled_bytes"] == 6 * BLOCK * tp


@pytest.mark.parametrize("case", ["off", "hinted", "short", "nothing_remote"])
def test_pull_on_miss_stays_out_of_the_way(case: str) -> None:
    """Risk: a pull when the operator turned it off, one that overrides the router's hint,
    one for a run too short to be worth a fetch, or a request stalled when no peer holds
    anything."""
    extra = {"pull_on_miss": False} if case == "off" else {}
    node = Node(sources={PEER: None}, extra=extra)
    source = stocked_source(node, TOKENS[:4] if case == "short" else TOKENS)
    if case != "nothing_remote":
        node.peers.sources[PEER] = source
    node.peers.pull_min_blocks = 2  # as `pull_min_blocks` would: one block is too short
    params = hint(TOKENS, node, "tcp://10.0.0.3:7500") if case == "hinted" else None
    request = FakeRequest("r1", TOKENS, kv_transfer_params=params)
    sched = node.scheduler
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert node.ops.calls["remote_run"] == (1 if case in ("short", "nothing_remote") else 0)
    assert node.ops.calls["peer_fetch"] == 0
