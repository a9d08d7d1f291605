"""kvcr's pool in vLLM's KV event stream (kvcr_vllm.pool_events) without an engine: the
scheduler side announces saved blocks once every rank's worker reported them committed (saves
report back like loads), with the hashes, parent and tokens vLLM itself computed (a real vLLM
Request), removes those the Runner's inventory log says it evicted, stays bounded and
survives a lost Runner. On the real RunnerService over an in-process Runner; tests/dynamo
checks that Dynamo's router credits them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the events are vLLM's types")

from prometheus_client import CollectorRegistry
from vllm import SamplingParams
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from kvcr_core.config import KVCRConfig
from kvcr_core.keys import NamespaceSpec, block_keys
from kvcr_core.runner import Runner
from kvcr_core.testing import ManualClock, ObservedRunner, in_process, pattern_block
from kvcr_vllm import pool_events
from kvcr_vllm.metadata import WorkerReport
from kvcr_vllm.scheduler import KVCRConnectorScheduler
from kvcr_vllm.settings import ConnectorSettings
from kvcr_vllm.stats import StatsRecorder

pytestmark = pytest.mark.unit

BLOCK_TOKENS = 4
BLOCK = 4096
TOKENS = list(range(100, 133))  # 8 full blocks and one partial


def spec(rank: int, tp: int) -> NamespaceSpec:
    return NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32",
                         block_size_tokens=BLOCK_TOKENS, num_layers=2, num_kv_heads=2,
                         head_dim=64, layout="test/v1", tp_size=tp, tp_rank=rank)


class Node:
    """A scheduler over `tp` ranks of one in-process Runner, publishing pool events."""

    def __init__(self, tp: int = 1) -> None:
        runner = Runner(KVCRConfig(pool_bytes=256 * BLOCK, namespace_pool_bytes=64 * BLOCK),
                        registry=CollectorRegistry())
        self.specs = [spec(r, tp) for r in range(tp)]
        self.ops = ObservedRunner(in_process(runner, self.specs, BLOCK))
        self.stores = self.ops.ops.stores
        self.clock = ManualClock()
        self.stats = StatsRecorder()
        settings = ConnectorSettings.from_extra_config(
            {"mode": "guarded", "socket": "/run/kvcr/unused.sock"}, "e")
        self.scheduler = KVCRConnectorScheduler(settings, self.specs, BLOCK, self.stats, "e",
                                                runner=self.ops, publish_events=True,
                                                clock=self.clock)

    def keys(self, rank: int, tokens: list[int] = TOKENS) -> list[bytes]:
        return list(block_keys(self.specs[rank].digest(), tokens, BLOCK_TOKENS))

    def commit(self, ranks: range | None = None, tokens: list[int] = TOKENS,
               *, report: bool = True) -> None:
        """What the workers do after the forward pass: the planned blocks become READY, and
        each worker reports the keys it committed with the step's output."""
        saved: list[bytes] = []
        for rank in ranks if ranks is not None else range(len(self.stores)):
            keys = self.keys(rank, tokens)
            self.stores[rank].store(keys, [pattern_block(k, BLOCK) for k in keys])
            saved += keys
        if report:
            self.scheduler.update_connector_output(SimpleNamespace(
                finished_recving=None, kv_connector_worker_meta=WorkerReport(
                    saved_keys=frozenset(saved))))

    def save(self, request: Request) -> None:
        """The request arrives and its prompt is computed (all full blocks planned)."""
        sched = self.scheduler
        blocks = request.num_tokens // BLOCK_TOKENS + 1
        sched.on_new_request(request)
        sched.get_num_new_matched_tokens(request, 0)
        sched.build_connector_meta(SimpleNamespace(
            num_scheduled_tokens={request.request_id: request.num_tokens},
            scheduled_new_reqs=[SimpleNamespace(req_id=request.request_id,
                                                block_ids=(list(range(blocks)),),
                                                num_computed_tokens=0)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                  resumed_req_ids=set(),
                                                  num_computed_tokens=[])))


def request(request_id: str = "r1", tokens: list[int] = TOKENS) -> Request:
    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    return Request(request_id, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=kv_cache_utils.get_request_block_hasher(BLOCK_TOKENS, fn))


def published(req: Request) -> list[Any]:
    return [kv_cache_utils.maybe_convert_block_hash(h) for h in req.block_hashes]


def test_saved_blocks_are_announced_once_ready_with_vllms_hashes_and_tokens() -> None:
    """Risk: Dynamo's router never credits kvcr's pool (nothing published), credits blocks
    kvcr does not hold yet (announced before the workers committed them), or cannot match
    them (hashes, parent or tokens other than vLLM's own)."""
    node = Node(tp=2)
    req = request()
    node.save(req)
    assert node.scheduler.take_events() == []  # planned, not committed yet
    node.commit(range(1))
    assert node.scheduler.take_events() == []  # rank 1 did not report them yet
    node.commit(range(1, 2))
    (stored,) = node.scheduler.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == published(req) and stored.parent_block_hash is None
    assert stored.token_ids == TOKENS[:32] and stored.block_size == BLOCK_TOKENS
    assert stored.medium == "CPU_PINNED" and stored.lora_id is None
    assert node.scheduler.take_events() == []  # once
    node.save(request("r2"))  # the same prompt again: nothing new to announce
    node.commit()
    assert node.scheduler.take_events() == []


def test_evicted_blocks_are_announced_removed_and_never_all_cleared() -> None:
    """Risk: the router keeps crediting blocks kvcr evicted (requests sent to a worker that
    must recompute), or kvcr clears vLLM's own tier with AllBlocksCleared."""
    node = Node()
    req = request()
    node.save(req)
    node.commit()
    node.scheduler.take_events()
    node.stores[0].clear()
    assert node.scheduler.take_events() == []  # the log is read every SWEEP_S
    node.clock.advance(pool_events.SWEEP_S)
    (removed,) = node.scheduler.take_events()
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU_PINNED"
    assert sorted(map(str, removed.block_hashes)) == sorted(map(str, published(req)))
    node.clock.advance(pool_events.SWEEP_S)
    assert node.scheduler.take_events() == []
    assert not any(isinstance(e, AllBlocksCleared) for e in node.scheduler.take_events())


def test_the_announced_table_is_bounded_and_reset_announces_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: an unbounded table of announced blocks (memory grows with traffic), or a router
    that dropped this worker's tiers on vLLM's AllBlocksCleared never hears of kvcr's blocks
    again."""
    node = Node()
    assert node.scheduler.events is not None
    node.scheduler.events.max_blocks = 5
    req = request()
    node.save(req)
    node.commit()
    events = node.scheduler.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [h for e in removed for h in e.block_hashes] == published(req)[:3]  # the oldest
    assert [h for e in stored for h in e.block_hashes] == published(req)
    node.scheduler.events.announce_again()
    again = node.scheduler.take_events()
    assert [h for e in again for h in e.block_hashes] == published(req)[3:]
    assert again[0].parent_block_hash == published(req)[2]
    node.scheduler.events.max_blocks = 64
    node.save(request("r2", list(range(500, 500 + 4 * 40))))
    node.commit(tokens=list(range(500, 500 + 4 * 40)))
    node.scheduler.take_events()
    monkeypatch.setattr(pool_events, "AGAIN_BLOCKS", 16)
    node.scheduler.events.announce_again()
    sizes = [sum(len(e.block_hashes) for e in node.scheduler.take_events()) for _ in range(4)]
    assert sizes == [16, 16, 13, 0]  # 45 blocks held, in bounded slices


def test_pending_blocks_never_committed_are_dropped_and_a_lost_runner_costs_no_step() -> None:
    """Risk: saves kvcr refused pile up as pending forever, or a dead Runner breaks the
    engine's step through take_events."""
    node = Node()
    node.save(request())
    node.clock.advance(pool_events.SETTLE_S + 1)
    assert node.scheduler.take_events() == []
    node.commit()
    assert node.scheduler.take_events() == []  # dropped: only later saves are announced
    node.ops.down = True
    node.save(request("r3", TOKENS[:8] + [1] * 8))  # its lookup fails: counted once
    node.clock.advance(pool_events.SWEEP_S)
    assert node.scheduler.take_events() == []  # and so does reading the Runner's log
    assert node.stats.take().reduce()["failures_guard_unavailable"] == 2  # type: ignore[union-attr]
    node.ops.down = False
    node.commit(tokens=TOKENS[:8] + [1] * 8)
    assert len(node.scheduler.take_events()) == 1  # the pending run survived the outage


def test_a_suspect_report_or_a_restarted_runner_takes_back_every_announcement() -> None:
    """Risk: a router keeps crediting blocks a worker reported saved on a connection that
    was lost since (its commits may have published nothing), or blocks of a Runner that
    restarted empty: requests routed there recompute."""
    node = Node()
    req = request()
    node.save(req)
    node.commit()
    (stored,) = node.scheduler.take_events()
    node.scheduler.update_connector_output(SimpleNamespace(
        finished_recving=None, kv_connector_worker_meta=WorkerReport(suspect=True)))
    (removed,) = node.scheduler.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == stored.block_hashes
    node.save(request("r2", list(range(300, 316))))
    node.commit(tokens=list(range(300, 316)))
    assert len(node.scheduler.take_events()) == 1
    events = node.scheduler.events
    assert events is not None and events._cursor is not None
    events._cursor = (events._cursor[0] + 1, events._cursor[1])  # as after a restart
    node.clock.advance(pool_events.SWEEP_S)
    (gone,) = node.scheduler.take_events()
    assert isinstance(gone, BlockRemoved) and len(gone.block_hashes) == 4


def test_a_block_reported_saved_but_evicted_before_the_report_is_never_announced() -> None:
    """Risk: a block evicted between its commit and the worker's report is announced anyway
    and credited for good (its removal was read before it was announced)."""
    node = Node()
    node.scheduler.take_events()  # the scheduler follows the log from here on
    req = request()
    node.save(req)
    node.commit(report=False)
    node.stores[0].clear()  # evicted before the report arrives
    node.clock.advance(pool_events.SWEEP_S)
    assert node.scheduler.take_events() == []  # the removal drops the pending blocks
    node.scheduler.update_connector_output(SimpleNamespace(
        finished_recving=None,
        kv_connector_worker_meta=WorkerReport(saved_keys=frozenset(node.keys(0)))))
    assert node.scheduler.take_events() == []
