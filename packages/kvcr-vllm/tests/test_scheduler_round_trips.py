"""How many round trips to kvcr-guard a hinted load costs the scheduler, at TP=1 and TP=2:
the same (one lookup, lease and fetch ticket covers every rank's namespace). The scheduler
talks to a real attach server over a real Unix socket (in this process, on a thread), whose
peer is another in-process Runner (kvcr_core.testing's loopback peers)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the scheduler side ships vLLM's metadata and stats types")

from prometheus_client import CollectorRegistry

from kvcr_core.attach import AttachClient, AttachServer, RunnerHost, ServerConfig
from kvcr_core.config import KVCRConfig
from kvcr_core.keys import NamespaceSpec, block_keys, router_hash_kvcr_v1
from kvcr_core.runner import Runner
from kvcr_core.testing import LoopbackPeers, pattern_block
from kvcr_vllm.metadata import WorkerReport
from kvcr_vllm.scheduler import KVCRConnectorScheduler
from kvcr_vllm.settings import ConnectorSettings
from kvcr_vllm.stats import StatsRecorder

pytestmark = pytest.mark.unit

BLOCK_TOKENS = 4
BLOCK = 4096
PEER = "tcp://10.0.0.2:7500"
TOKENS = list(range(100, 133))  # 8 full blocks and one partial


def spec(rank: int, tp: int) -> NamespaceSpec:
    return NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32",
                         block_size_tokens=BLOCK_TOKENS, num_layers=2, num_kv_heads=2,
                         head_dim=64, layout="test/v1", tp_size=tp, tp_rank=rank)


class Request(SimpleNamespace):
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@pytest.fixture
def guard_with_peer() -> Iterator[tuple[str, Runner]]:
    """An attach server on a socket of its own, whose only peer (PEER) is `source`."""
    source = Runner(KVCRConfig(pool_bytes=64 * BLOCK, namespace_pool_bytes=16 * BLOCK),
                    registry=CollectorRegistry())
    path = f"\0kvcr-round-trips-{os.getpid()}-{threading.get_ident()}"
    config = ServerConfig(socket_path=path, runner=KVCRConfig(pool_bytes=256 * BLOCK,
                                                              namespace_pool_bytes=64 * BLOCK))
    registry = CollectorRegistry()
    server = AttachServer(config, registry=registry, host=RunnerHost(
        config, registry, peers=LoopbackPeers({PEER: source})))
    server.listen()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield path, source
    server.request_shutdown()
    thread.join(timeout=10)
    source.close()


def hinted_load(path: str, source: Runner, tp: int) -> tuple[int, int]:
    """One hinted request, fetched from the peer and loaded; (round trips, tokens loaded)."""
    specs = [spec(r, tp) for r in range(tp)]
    keys = [list(block_keys(s.digest(), TOKENS, BLOCK_TOKENS)) for s in specs]
    for s, rank_keys in zip(specs, keys, strict=True):
        source.open_namespace(s, BLOCK).store(rank_keys, [pattern_block(k, BLOCK)
                                                         for k in rank_keys])
    client = AttachClient(path, specs, BLOCK, identity=f"scheduler-tp{tp}")
    client.attach()
    settings = ConnectorSettings.from_extra_config(
        {"mode": "guarded", "socket": path, "peers": [PEER], "fetch_deadline_s": 5,
         "fetch_wait_s": 1}, "e")
    scheduler = KVCRConnectorScheduler(settings, specs, BLOCK, StatsRecorder(), "e",
                                       runner=client)
    hint = {"protocol_version": "0.1", "message_id": "m", "actions": [{
        "action_type": "kv.fetch", "action_version": "1.0", "payload": {
            "source_control_endpoint": PEER,
            "block_hashes": [router_hash_kvcr_v1(k) for k in keys[0]]}}]}
    request = Request(request_id="r1", all_token_ids=TOKENS,
                      kv_transfer_params={"kv_hint": json.dumps(hint)})
    scheduler.on_new_request(request)
    answer: tuple[Any, bool] = (None, False)
    while answer[0] is None:
        answer = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(
        request, SimpleNamespace(get_block_ids=lambda: (list(range(9)),)), answer[0])
    scheduler.update_connector_output(SimpleNamespace(
        finished_recving=None, kv_connector_worker_meta=WorkerReport(frozenset({"r1"}))))
    client.flush()  # the releases reached the Runner (not a round trip of the load)
    trips = client.connection.round_trips - 1
    client.close()
    return trips, answer[0]


def test_a_hinted_load_costs_the_same_round_trips_at_tp1_and_tp2(
        guard_with_peer: tuple[str, Runner]) -> None:
    """Risk: the scheduler asks kvcr-guard once per TP rank for every lookup, lease and fetch
    poll, so a hinted load's latency grows with the TP size."""
    path, source = guard_with_peer
    one = hinted_load(path, source, 1)
    two = hinted_load(path, source, 2)
    assert one[1] == two[1] == 32  # every block fetched and offered, on every rank
    # a lookup of the local prefix, the fetch ticket, its answer, the lease
    assert one[0] == two[0] == 4
