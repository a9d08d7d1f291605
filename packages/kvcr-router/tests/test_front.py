"""The router's HTTP front against fake vLLM workers on 127.0.0.1: hints, stripping,
streaming, health, faults, feeds and metrics (hostile clients: test_front_hostile.py; the
real engines: test_router_e2e.py)."""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from kvcr_core.hints import parse_hint
from kvcr_core.inventory import InventoryBatch
from kvcr_core.keys import NamespaceSpec
from kvcr_router.config import RouterConfig, WorkerSpec
from kvcr_router.cost import CostWeights, choose
from kvcr_router.front import Router
from kvcr_router.hashing import PromptHasher
from kvcr_router.hinting import hinted_hashes, strip_client_hints
from kvcr_router.indexer import BlockIndexer, Tier
from kvcr_router.testing import FakeInventory, FakeWorker, serving

pytestmark = pytest.mark.unit

SPEC = NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32", block_size_tokens=32,
                     num_layers=4, num_kv_heads=2, head_dim=64, layout="vllm-0.32.0/cpu/AVX2")
DIGEST = SPEC.digest()
PROMPT = [(i * 7919) % 2000 + 4 for i in range(1300)]  # 40 full blocks of 32
HASHES = PromptHasher(DIGEST, 32).hashes(PROMPT)
BOGUS = {"protocol_version": "0.1", "actions": [{"action_type": "kv.fetch",
         "action_version": "1.0", "payload": {"source_control_endpoint": "tcp://10.9.9.9:9",
                                              "block_hashes": [1, 2, 3]}}]}


def batch(seq: int, stored: list[int], namespace: bytes = DIGEST) -> InventoryBatch:
    return InventoryBatch(seq, namespace, array.array("Q", stored), array.array("Q"))


@contextlib.asynccontextmanager
async def routed(workers: list[FakeWorker | str], readers: dict[str, Any] | None = None,
                 **overrides: Any) -> AsyncIterator[tuple[Router, str]]:
    """A router in this process in front of `workers` (a str is a URL nobody listens on)."""
    readers = readers or {}
    specs = []
    for i, w in enumerate(workers):
        name, url = (f"dead{i}", w) if isinstance(w, str) else (w.name, w.url)
        peer = f"tcp://127.0.0.1:{7100 + i}" if name in readers else None
        specs.append(WorkerSpec(name, url, peer=peer))
    settings = {"health_interval_s": 0.1, "inventory_interval_s": 0.02, **overrides}
    config = RouterConfig(workers=tuple(specs), namespace_digest=DIGEST, block_size=32,
                          **settings)
    router = Router(config, PromptHasher(DIGEST, 32), CollectorRegistry(),
                    new_reader=lambda spec: readers[spec.name])
    async with serving(router) as url:
        yield router, url


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def metric(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(sample)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def test_client_hints_are_stripped_from_every_place_a_worker_reads() -> None:
    """Risk: a client steers a worker's fetches. kv_transfer_params (whole, any type), top-level
    kv_hint/kv_hints and vllm_xargs' copies of all three go; everything else stays."""
    body = {"prompt": "x", "kv_hint": BOGUS, "kv_hints": BOGUS,
            "kv_transfer_params": {"kv_hint": BOGUS, "other": 1},
            "vllm_xargs": {"kv_hint": BOGUS, "kv_hints": BOGUS, "kv_transfer_params": "{}",
                           "keep": 2}}
    found = strip_client_hints(body)
    assert sorted(found) == sorted(["kv_transfer_params", "kv_hint", "kv_hints",
                                    "vllm_xargs.kv_transfer_params", "vllm_xargs.kv_hint",
                                    "vllm_xargs.kv_hints"])
    assert body == {"prompt": "x", "vllm_xargs": {"keep": 2}}
    assert strip_client_hints(body) == []


def test_router_hints_the_worker_lacking_the_prefix_and_drops_the_clients_hint() -> None:
    """A busy holder loses to an idle worker, which gets the router's hint naming the
    holder's peer endpoint and exactly the prompt's hashes; the client's hint and transfer
    params never arrive; decisions, hints, lead and stripping show in /metrics."""

    async def test() -> None:
        a, b = await FakeWorker("a").start(), await FakeWorker("b").start()
        inventory = FakeInventory([batch(1, HASHES)])
        async with routed([a, b], {"a": inventory}, expose_cache_details=True) as (router, url), \
                aiohttp.ClientSession() as http:
            await until(lambda: router.indexer.prefix("a", Tier.POOL, HASHES) == 40)
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "kv_hint": BOGUS,
                    "kv_transfer_params": {"kv_hint": BOGUS, "keep": True}}
            router.pool.begin("a", 100)  # a is busy: 100 blocks in flight
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert (await resp.json())["worker"] == "b"
                assert resp.headers["x-kvcr-worker"] == "b"
                assert resp.headers["x-kvcr-hint-blocks"] == "40"
            router.pool.end("a", 100)
            (seen,) = b.bodies
            assert "kv_hint" not in seen and list(seen["kv_transfer_params"]) == ["kv_hint"]
            hint = parse_hint(seen["kv_transfer_params"]["kv_hint"])
            (fetch,) = hint.fetches
            assert fetch.source_endpoint == "tcp://127.0.0.1:7100"
            assert fetch.block_hashes == frozenset(HASHES)
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.headers["x-kvcr-worker"] == "a"  # idle holder: no hint needed
            assert "kv_transfer_params" not in a.bodies[0]
            text = await (await http.get(url + "/metrics")).text()
        await a.stop()
        await b.stop()
        assert metric(text, 'kvcr_router_hints_total{outcome="emitted"}') == 1
        assert metric(text, 'kvcr_router_hints_total{outcome="none"}') == 1
        assert metric(text, "kvcr_router_hint_lead_blocks_sum") == 40
        assert metric(text, 'kvcr_router_decisions_total{worker="b"}') == 1
        assert metric(text, 'kvcr_router_client_hints_stripped_total{field="kv_hint"}') == 2
        assert metric(text, 'kvcr_router_client_hints_stripped_total'
                            '{field="kv_transfer_params"}') == 2
        assert metric(text, "kvcr_router_decision_seconds_count") == 2
        assert metric(text, 'kvcr_router_requests_total{outcome="ok",route="completions"}') == 2
        assert metric(text, 'kvcr_router_feed_blocks_total{event="stored",feed="inventory",'
                            'worker="a"}') == 40

    run(test)


def test_streaming_relays_each_chunk_as_it_comes() -> None:
    """SSE chunks reach the client before the worker finishes (no buffering), bytes intact,
    for completions and chat alike."""

    async def test() -> None:
        a = await FakeWorker("a").start()
        async with routed([a]) as (_, url), aiohttp.ClientSession() as http:
            for path, body in (("/v1/completions", {"prompt": [1, 2], "stream": True}),
                               ("/v1/chat/completions", {"messages": [], "stream": True})):
                a.gate = asyncio.Event()
                async with http.post(url + path, json=body) as resp:
                    assert resp.headers["Content-Type"] == "text/event-stream"
                    first = await resp.content.readuntil(b"\n\n")
                    assert first == b'data: {"worker": "a", "i": 0}\n\n'
                    a.gate.set()  # only now may the worker send the rest
                    rest = await resp.content.read()
                assert rest.endswith(b"data: [DONE]\n\n") and rest.count(b"data:") == 3
        await a.stop()

    run(test)


def test_unhealthy_and_unreachable_workers_are_routed_around() -> None:
    """A failing health check takes a worker out; a refused connection re-routes the same
    request to another worker and marks the first down; with none left: 503, no hang."""

    async def test() -> None:
        a, b = await FakeWorker("a").start(), await FakeWorker("b").start()
        z = await FakeWorker("z").start()
        async with routed(["http://127.0.0.1:9", z], health_interval_s=60) as (router, url), \
                aiohttp.ClientSession() as http:
            assert router.pool.routable() == ["z"]
            router.pool.set_health("dead0", True)  # it looked alive a moment ago: first pick
            async with http.post(url + "/v1/completions", json={"prompt": [1]}) as resp:
                assert (await resp.json())["worker"] == "z"
            assert router.pool.routable() == ["z"]
            text = await (await http.get(url + "/metrics")).text()
        assert metric(text, 'kvcr_router_upstream_failures_total{reason="connect",'
                            'worker="dead0"}') == 1
        a.health_status = 503
        async with routed([a, b]) as (router, url), aiohttp.ClientSession() as http:
            assert router.pool.routable() == ["b"]
            a.health_status = 200
            await until(lambda: router.pool.workers["a"].healthy)
            b.health_status = 500
            await until(lambda: not router.pool.workers["b"].healthy)
            async with http.post(url + "/v1/completions", json={"prompt": [1]}) as resp:
                assert (await resp.json())["worker"] == "a"
            a.health_status = 500
            await until(lambda: not router.pool.routable())
            async with http.post(url + "/v1/completions", json={"prompt": [1]}) as resp:
                assert resp.status == 503
            async with http.get(url + "/health") as resp:
                assert resp.status == 503
            async with http.post(url + "/v1/completions", data=b"[1,") as resp:
                assert resp.status == 400
            text = await (await http.get(url + "/metrics")).text()
        for worker in (a, b, z):
            await worker.stop()
        assert metric(text, 'kvcr_router_requests_total{outcome="no_worker",'
                            'route="completions"}') == 1
        assert metric(text, 'kvcr_router_worker_healthy{worker="b"}') == 0

    run(test)


def test_inventory_loss_drops_credit_then_resyncs() -> None:
    """A runner that stops answering loses its pool credit (never stale over-credit); once
    it answers again a fresh reader rebuilds the view. Other namespaces' batches advance the
    sequence without counting as loss."""

    async def test() -> None:
        a = await FakeWorker("a").start()
        inventory = FakeInventory([batch(1, HASHES[:10]), batch(2, [1, 2], b"\x01" * 16),
                                   batch(3, HASHES[10:20])])
        async with routed([a], {"a": inventory}) as (router, _):
            await until(lambda: router.indexer.prefix("a", Tier.POOL, HASHES) == 20)
            assert router.indexer.clears == 0
            inventory.failing = True
            await until(lambda: router.indexer.prefix("a", Tier.POOL, HASHES) == 0)
            assert not router.inventory["a"].up
            inventory.batches = [batch(1, HASHES[:5])]
            inventory.failing = False
            await until(lambda: router.indexer.prefix("a", Tier.POOL, HASHES) == 5)
            assert router.inventory["a"].up
        await a.stop()

    run(test)


def test_weights_reach_the_cost_model() -> None:
    """A min_fetch_blocks above the lead suppresses the hint (counted as below_crossover)."""

    async def test() -> None:
        a, b = await FakeWorker("a").start(), await FakeWorker("b").start()
        async with routed([a, b], {"a": FakeInventory([batch(1, HASHES)])},
                          weights=CostWeights(min_fetch_blocks=41),
                          expose_cache_details=True) as (router, url), \
                aiohttp.ClientSession() as http:
            await until(lambda: router.indexer.prefix("a", Tier.POOL, HASHES) == 40)
            router.pool.begin("a", 100)
            async with http.post(url + "/v1/completions", json={"prompt": PROMPT}) as resp:
                assert resp.headers["x-kvcr-worker"] == "b"
                assert resp.headers["x-kvcr-hint-blocks"] == "0"
            text = await (await http.get(url + "/metrics")).text()
        await a.stop()
        await b.stop()
        assert "kv_transfer_params" not in b.bodies[0]
        assert metric(text, 'kvcr_router_hints_total{outcome="below_crossover"}') == 1

    run(test)


def test_worker_receives_the_body_as_json() -> None:
    """Fields the router does not own pass through unchanged (model, sampling, extras)."""

    async def test() -> None:
        a = await FakeWorker("a").start()
        body = {"model": "m", "prompt": "text", "temperature": 0, "ignore_eos": True,
                "vllm_xargs": {"x": 1}, "n": 2}
        async with routed([a]) as (_, url), aiohttp.ClientSession() as http, \
                http.post(url + "/v1/completions", data=json.dumps(body)) as resp:
            assert resp.status == 200
        await a.stop()
        assert a.bodies == [body]

    run(test)


def test_a_dropped_connection_is_retried_once_without_marking_the_worker_down() -> None:
    """A worker closing the connection before answering (keep-alive race) gets the request
    again on a fresh connection and stays healthy; twice in a row, the request is decided
    again, and the hint made for the first worker does not travel to the next one."""

    async def test() -> None:
        a, c = await FakeWorker("a").start(), await FakeWorker("c").start()
        async with routed([a, c], {"c": FakeInventory([batch(1, HASHES)])},
                          health_interval_s=60) as (router, url), \
                aiohttp.ClientSession() as http:
            await until(lambda: router.indexer.prefix("c", Tier.POOL, HASHES) == 40)
            router.pool.begin("c", 15)  # c (holder) costs 25, a (can fetch from c) 20
            body = {"prompt": PROMPT, "kv_transfer_params": {"keep": 1}}
            a.drop_next = 1
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert (await resp.json())["worker"] == "a"
            a.drop_next = 2
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert (await resp.json())["worker"] == "c"
            assert router.pool.routable() == ["a", "c"]
        await a.stop()
        await c.stop()
        (hint,) = [parse_hint(x["kv_transfer_params"]["kv_hint"]) for x in a.bodies]
        assert hint.fetches[0].source_endpoint == "tcp://127.0.0.1:7101"
        assert c.bodies == [{"prompt": PROMPT}]  # no hint: c holds the prefix itself

    run(test)


def test_hint_widens_back_to_the_destinations_pool_prefix() -> None:
    """The connector extends its *pool* prefix: when the destination holds more in its
    engine cache than in its pool, the hint starts where its pool ends (if the source holds
    that stretch), so the fetched run joins the pool prefix."""
    idx = BlockIndexer()
    idx.apply("b", Tier.DEVICE, 1, 1, HASHES[:5], [])
    idx.apply("b", Tier.POOL, 1, 1, HASHES[:2], [])
    idx.apply("a", Tier.POOL, 1, 1, HASHES[:30], [])
    decision = choose(idx, HASHES, ["b"], {}, CostWeights())
    assert decision.hint_source == "a" and decision.hint_range == (5, 30)
    assert hinted_hashes(idx, decision, HASHES) == HASHES[2:30]
