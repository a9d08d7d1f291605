"""kvcr-router end to end: `kvcr-router serve` (a real process) in front of two real vLLM CPU
engines with kvcr-vllm in embedded mode, serving each other as peers. One module-scoped
fleet (engines start in ~30-60 s on 2 cores)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvcr_bench.vllm_servers import CPU_ENV, Process
from kvcr_core.testing import secret_for
from kvcr_core.testing.ports import free_port
from kvcr_router.hashing import HfTokenizer, PromptHasher

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[3]
SECRET = secret_for("router-e2e-peer-secret-0123456789abcdef")
WORDS = ["def", "class", "return", "import", "lambda", "yield", "async", "await", "value",
         "index", "buffer", "socket", "thread", "namespace", "router", "worker", "block"]
SYSTEM = " ".join(WORDS[(i * 7 + i // 5) % len(WORDS)] + str(i % 97) for i in range(420))


def chat(question: str, history: list[dict[str, str]] | None = None, **extra: Any) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, *(history or []),
                {"role": "user", "content": question}]
    return {"model": "model", "messages": messages, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True, **extra}


class Engine(Process):
    """A vLLM OpenAI server with kvcr (embedded runner serving peers) and vLLM KV events."""

    def __init__(self, model: str, workdir: Path, name: str, peer_port: int, events_port: int,
                 peers: list[str]) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kv = {"kv_connector": "KVCRConnector", "kv_role": "kv_both",
              "kv_connector_module_path": "kvcr_vllm.connector",
              "kv_connector_extra_config": {"peer_listen": f"127.0.0.1:{peer_port}",
                                            "peers": peers, "fetch_deadline_s": 20,
                                            "pool_bytes": "256MiB"}}
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{events_port}", "topic": "kv"}
        super().__init__([
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--max-model-len", "4096", "--block-size", "32", "--enforce-eager",
            "--max-num-seqs", "4", "--served-model-name", "model",
            "--kv-transfer-config", json.dumps(kv), "--kv-events-config", json.dumps(events)],
            workdir / f"{name}.log",
            {**CPU_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "KVCR_PEER_SECRET": SECRET})

    def metric(self, name: str, **labels: str) -> float:
        return metric(httpx.get(f"{self.url}/metrics", timeout=10).text, name, **labels)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a sample over the label sets that include `labels` (0 if absent)."""
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def wait_ready(proc: Process, url: str, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.alive(), proc.tail()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready: {proc.tail()}")


@pytest.fixture(scope="module")
def fleet(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model = tiny_model
    workdir = tmp_path_factory.mktemp("router-e2e")
    ports = {name: (free_port(), free_port()) for name in "ab"}
    peer = {name: f"tcp://127.0.0.1:{p}" for name, (p, _) in ports.items()}
    engines = {name: Engine(model, workdir, name, *ports[name], [peer["b" if name == "a" else "a"]])
               for name in "ab"}
    # The namespace the connector derives from vLLM's config (docs/router.md).
    import torch
    import vllm

    namespace = {"model_id": model, "dtype": "float32", "kv_dtype": "float32",
                 "block_size_tokens": 32, "num_layers": 4, "num_kv_heads": 2, "head_dim": 64,
                 "layout": f"vllm-{vllm.__version__}/cpu/{torch.backends.cpu.get_cpu_capability()}"}
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    router = None
    try:
        for engine in engines.values():
            wait_ready(engine, engine.url)
        workers = [f"{n}={e.url},peer={peer[n]},kv_events=tcp://127.0.0.1:{ports[n][1]}"
                   for n, e in engines.items()]
        router = Process([str(Path(sys.executable).parent / "kvcr-router"), "serve",
                          "--listen", f"127.0.0.1:{router_port}",
                          *[arg for w in workers for arg in ("--worker", w)],
                          "--namespace", json.dumps(namespace), "--tokenizer", model,
                          "--health-interval-s", "0.5", "--inventory-interval-s", "0.1",
                          "--expose-cache-details"],  # the tests read explain and headers
                         workdir / "router.log", {"KVCR_PEER_SECRET": SECRET})
        wait_ready(router, router_url, 60)
        yield {"router": router_url, "engines": engines, "peer": peer, "model": model,
               "router_proc": router}
    finally:
        for proc in (router, *engines.values()):
            if proc is not None:
                proc.stop()


def explain(url: str, body: dict) -> dict:
    return httpx.post(f"{url}/kvcr/explain/chat", json=body, timeout=30).json()


def test_shared_prefix_goes_to_the_idle_worker_which_fetches_it_from_its_peer(fleet) -> None:
    """Turn 1 lands on a; with a busy, the follow-up (same prefix) goes to b with the router's
    hint naming a: b gets external hits fetched from a (counters), its answer equals a's,
    the router's chat tokens equal vLLM's, and the client's own hint reaches no worker."""
    url, a, b = fleet["router"], fleet["engines"]["a"], fleet["engines"]["b"]
    with httpx.Client(timeout=300) as http:
        first = http.post(f"{url}/v1/chat/completions", json=chat("What is a router?"))
        assert first.status_code == 200, first.text
        assert first.headers["x-kvcr-worker"] == "a"  # a tie on an empty index: the first
        turn1 = first.json()
        prompt_ids = turn1["prompt_token_ids"]
        tokenizer = HfTokenizer(fleet["model"])
        assert PromptHasher(b"\0" * 16, 32, tokenizer).tokens(
            "chat", chat("What is a router?")) == prompt_ids
        held_blocks = len(prompt_ids) // 32
        assert held_blocks >= 20
        answer = turn1["choices"][0]["message"]["content"]
        history = [{"role": "user", "content": "What is a router?"},
                   {"role": "assistant", "content": answer}]
        follow_up = chat("And a worker?", history)
        deadline = time.monotonic() + 30
        while True:  # a's engine cache (KV events) and pool (inventory) reach the router
            cand = {c["worker"]: c for c in explain(url, follow_up)["candidates"]}
            if min(cand["a"]["device"], cand["a"]["local"]) >= held_blocks - 1:
                break
            assert time.monotonic() < deadline, cand
            time.sleep(0.2)
        assert cand["b"]["source"] == "a" and cand["b"]["fetch"] >= held_blocks - 1
        hints_before = sum(e.metric("vllm:kvcr_hints_total") for e in (a, b))
        hits_before = b.metric("vllm:external_prefix_cache_hits_total")
        busy = {"model": "model", "prompt": list(range(10, 74)), "max_tokens": 1500,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with http.stream("POST", f"{url}/v1/completions", json=busy) as held:
            assert held.headers["x-kvcr-worker"] == "a"
            # Keep the iterator: a dropped one closes the stream at once (httpx), and the
            # router could notice that before it decides the follow-up (a no longer busy).
            lines = held.iter_lines()
            next(lines)  # a is decoding it now: 49 blocks in flight
            bogus = {"protocol_version": "0.1", "actions": [{
                "action_type": "kv.fetch", "action_version": "1.0",
                "payload": {"source_control_endpoint": "tcp://127.0.0.1:9",
                            "block_hashes": [1, 2, 3]}}]}
            second = http.post(f"{url}/v1/chat/completions", json={
                **follow_up, "kv_hint": bogus, "kv_transfer_params": {"kv_hint": bogus}})
        assert second.status_code == 200, second.text
        assert second.headers["x-kvcr-worker"] == "b"
        assert int(second.headers["x-kvcr-hint-blocks"]) >= held_blocks - 1
        turn2 = second.json()
        assert turn2["kv_transfer_params"]["kvcr_loaded_tokens"] >= (held_blocks - 1) * 32
        assert b.metric("vllm:kvcr_peer_fetched_blocks_total") >= held_blocks - 1
        assert b.metric("vllm:external_prefix_cache_hits_total") - hits_before >= (
            held_blocks - 1) * 32
        # The reference: a (which computed the prefix itself) answers the same follow-up.
        reference = http.post(f"{a.url}/v1/chat/completions", json=follow_up).json()
        assert turn2["choices"][0]["message"]["content"] == reference["choices"][0][
            "message"]["content"]
        assert turn2["prompt_token_ids"] == reference["prompt_token_ids"]
        # Only the router's hint reached a worker: one accepted hint, no stranger refused.
        assert sum(e.metric("vllm:kvcr_hints_total") for e in (a, b)) - hints_before == 1
        assert b.metric("vllm:kvcr_hints_total", outcome="accepted") >= 1
        for engine in (a, b):
            assert engine.metric("vllm:kvcr_failures_total", reason="peer_not_allowed") == 0
        text = http.get(f"{url}/metrics").text
    assert metric(text, "kvcr_router_hints_total", outcome="emitted") == 1
    assert metric(text, "kvcr_router_client_hints_stripped_total", field="kv_hint") == 1
    assert metric(text, "kvcr_router_decisions_total", worker="b") == 1
    assert metric(text, "kvcr_router_hint_lead_blocks_count") == 1


def test_client_hint_never_reaches_a_worker_even_without_a_router_hint(fleet) -> None:
    """A malformed client hint in every field a worker reads would be counted by the worker
    (kvcr_hints_total{outcome=bad_hashes}) if it arrived; it does not. Transfer params
    smuggled through vllm_xargs (a mapping there would make vLLM answer 400) are gone too."""
    url, engines = fleet["router"], fleet["engines"].values()
    bad = {"protocol_version": "0.1", "actions": [{
        "action_type": "kv.fetch", "action_version": "1.0",
        "payload": {"source_control_endpoint": "tcp://127.0.0.1:9", "block_hashes": ["x"]}}]}
    before = [e.metric("vllm:kvcr_hints_total") for e in engines]
    body = {"model": "model", "prompt": "a fresh prompt, in no cache", "max_tokens": 4,
            "temperature": 0, "kv_hint": bad, "kv_hints": bad,
            "kv_transfer_params": {"kv_hint": bad},
            "vllm_xargs": {"kv_transfer_params": {"kv_hint": bad}, "kv_hint": "x"}}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvcr-hint-blocks"] == "0"
    assert [e.metric("vllm:kvcr_hints_total") for e in engines] == before
    assert all(e.metric("vllm:kvcr_hints_total", outcome="bad_hashes") == 0 for e in engines)
