"""Request bodies at the router's front: slow, over-limit and large bodies against a real
`kvcr-router serve` process (raw sockets and aiohttp clients, a fake worker in this process),
and the JSON codec that keeps large bodies off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from kvcr_core.errors import ConfigError
from kvcr_core.testing.ports import free_port
from kvcr_router import bodies
from kvcr_router.bodies import INLINE_BYTES, BodyRefused, JsonCodec
from kvcr_router.cli import build_parser, config_from_args
from kvcr_router.config import RouterConfig, WorkerSpec
from kvcr_router.front import Router
from kvcr_router.hashing import PromptHasher
from kvcr_router.testing import FakeWorker, serving

DIGEST = "ab" * 16
MAX_BODY = 200_000
HEAD = ("POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        "{extra}\r\n")


@contextlib.asynccontextmanager
async def router_process(worker: FakeWorker, *flags: str) -> AsyncIterator[tuple[int, str]]:
    """`kvcr-router serve` in its own process in front of `worker`; yields (port, base URL)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcr_router", "serve", "--listen", f"127.0.0.1:{port}",
         "--worker", f"a={worker.url}", "--namespace-digest", DIGEST, "--block-size", "4",
         "--max-body-bytes", str(MAX_BODY), "--log-level", "WARNING", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(300):
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/health") as resp:
                        if resp.status == 200:
                            break
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                await asyncio.sleep(0.1)
        yield port, url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def refused(url: str) -> dict[str, float]:
    """kvcr_router_bodies_refused_total by reason."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    prefix = "kvcr_router_bodies_refused_total{reason=\""
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


async def raw_exchange(port: int, head: str, body: bytes = b"") -> tuple[bytes, bytes]:
    """Sends `head` and `body`, then reads until the router closes: (status line, the rest)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head.encode() + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)  # b"" only once the router closed
    writer.close()
    status, _, rest = answer.partition(b"\r\n")
    return status, rest


async def small_request(url: str) -> int:
    async with aiohttp.ClientSession() as http, http.post(
            url + "/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 2}) as resp:
        await resp.read()
        return resp.status


@pytest.mark.integration
def test_a_slow_body_gets_408_at_the_deadline_and_its_connection_closes() -> None:
    """Risk: a client that sends a body byte by byte (or never finishes it) holds a router
    connection open forever; others keep being served meanwhile, and the refusal is counted."""

    async def test() -> None:
        worker = await FakeWorker("a").start()
        async with router_process(worker, "--body-timeout-s", "1") as (port, url):
            slow = [asyncio.create_task(raw_exchange(
                port, HEAD.format(extra="Content-Length: 1000\r\n"), b'{"prompt": [1,'))
                for _ in range(3)]
            assert await small_request(url) == 200
            for status, rest in await asyncio.gather(*slow):
                assert status == b"HTTP/1.1 408 Request Timeout"
                assert b"--body-timeout-s" in rest  # says which setting ran out
            assert (await refused(url))["deadline"] == 3
            assert await small_request(url) == 200
        await worker.stop()
        assert worker.bodies == [{"prompt": [1, 2, 3, 4, 5], "max_tokens": 2}] * 2

    asyncio.run(test())


@pytest.mark.integration
def test_an_over_limit_body_gets_413_before_it_is_read() -> None:
    """Risk: the router buffers a body past --max-body-bytes (a declared length it could refuse
    at once, or a chunked body with no length) before refusing it, or forwards it."""

    async def test() -> None:
        worker = await FakeWorker("a").start()
        async with router_process(worker, "--body-timeout-s", "30") as (port, url):
            # Only the head is sent: the answer cannot wait for a body that never comes.
            status, rest = await raw_exchange(
                port, HEAD.format(extra=f"Content-Length: {MAX_BODY + 1}\r\n"))
            assert status == b"HTTP/1.1 413 Request Entity Too Large"
            assert b"--max-body-bytes" in rest
            # Chunked: refused once the bytes received pass the limit, the rest never sent.
            chunk = b"x" * (MAX_BODY // 2)
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3))
            status, _ = await raw_exchange(
                port, HEAD.format(extra="Transfer-Encoding: chunked\r\n"), chunks)
            assert status == b"HTTP/1.1 413 Request Entity Too Large"
            assert (await refused(url))["too_large"] == 2
            assert await small_request(url) == 200
        await worker.stop()
        assert len(worker.bodies) == 1

    asyncio.run(test())


@pytest.mark.integration
def test_a_large_body_is_forwarded_intact_and_bad_json_is_refused() -> None:
    """Risk: a body decoded and encoded on the JSON threads (above INLINE_BYTES) reaches the
    worker changed, or a large malformed body is forwarded instead of answered 400."""

    async def test() -> None:
        worker = await FakeWorker("a").start()
        body = {"prompt": list(range(15_000)), "max_tokens": 3, "stop": ["\n", "é"],
                "logit_bias": {"17": -1.5}, "nested": [[{"a": list(range(5000))}], None, True]}
        assert len(json.dumps(body)) > INLINE_BYTES
        async with router_process(worker) as (_, url):
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                bad = b"{\"prompt\": [" + b"1, " * 30_000 + b"]"
                async with http.post(url + "/v1/completions", data=bad,
                                     headers={"Content-Type": "application/json"}) as resp:
                    assert resp.status == 400
            assert (await refused(url))["bad_json"] == 1
        await worker.stop()
        assert worker.bodies == [body]

    asyncio.run(test())


@pytest.mark.unit
def test_a_large_body_is_decoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a large body's JSON is decoded on the event loop, so every other request waits
    for it (three clients posting 30 MB pushed a normal request from 8 ms to 4.6 s)."""
    release = threading.Event()
    decode = bodies._decode

    def held(raw: bytes) -> object:
        release.wait(30)
        return decode(raw)

    monkeypatch.setattr(bodies, "_decode", held)

    async def test() -> None:
        worker = await FakeWorker("a").start()
        config = RouterConfig(workers=(WorkerSpec("a", worker.url),),
                              namespace_digest=bytes(16), block_size=4)
        router = Router(config, PromptHasher(bytes(16), 4), CollectorRegistry())
        async with serving(router) as url, aiohttp.ClientSession() as http:
            large = asyncio.create_task(http.post(
                url + "/v1/completions", json={"prompt": list(range(20_000))}))
            while router.json.pending == 0:
                await asyncio.sleep(0.01)
            assert await small_request(url) == 200  # while the large one is being decoded
            assert not large.done()
            release.set()
            assert (await large).status == 200
        await worker.stop()
        assert [len(b["prompt"]) for b in worker.bodies] == [5, 20_000]

    asyncio.run(test())


@pytest.mark.unit
def test_large_bodies_past_the_pending_bound_are_refused_at_once() -> None:
    """Risk: large bodies queue without bound for the JSON threads (memory and latency grow
    with the flood) instead of being answered 503 at once."""

    async def test() -> None:
        codec = JsonCodec(threads=1, max_pending=1)
        raw = json.dumps({"prompt": list(range(40_000))}).encode()
        first = asyncio.create_task(codec.loads(raw))
        await asyncio.sleep(0)
        with pytest.raises(BodyRefused) as refusal:
            await codec.loads(raw)
        assert (refusal.value.reason, refusal.value.status) == ("busy", 503)
        assert await first == {"prompt": list(range(40_000))}
        assert await codec.loads(b"{}") == {}  # small bodies never wait for the threads
        codec.close()

    asyncio.run(test())


def _random_json(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(6 if depth < 4 else 3)
    if kind == 0:
        return rng.choice([None, True, False, rng.randrange(-10**12, 10**12), rng.random()])
    if kind in (1, 2):
        return "".join(rng.choice("ab\"\\\n é😀") for _ in range(rng.randrange(6)))
    if kind == 3:
        return [rng.randrange(100) for _ in range(rng.choice([0, 3, 4095, 4096, 9000]))]
    if kind == 4:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {str(rng.randrange(50)): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


@pytest.mark.unit
def test_the_sliced_encoder_writes_what_json_dumps_means() -> None:
    """Risk: encoding a large body in slices changes a value (separators at slice edges,
    nested containers, escapes) so the worker sees another request than the client sent."""
    rng = random.Random(5)
    for _ in range(300):
        value = {"v": _random_json(rng, 0), "w": [_random_json(rng, 1) for _ in range(3)]}
        encoded = bodies._encode(value)
        assert json.loads(encoded) == value
        assert bodies._decode(encoded) == value


@pytest.mark.unit
def test_the_body_deadline_and_json_threads_are_validated_and_have_flags() -> None:
    """Risk: a zero, negative or non-finite body deadline (no slow-body defence) or a thread
    count out of range is accepted, or the settings cannot be given on the command line."""
    base = {"workers": ["a=http://127.0.0.1:9"], "namespace_digest": DIGEST, "block_size": 4}
    for field, value in (("body_timeout_s", 0), ("body_timeout_s", float("inf")),
                         ("body_timeout_s", "10"), ("json_threads", 0), ("json_threads", 65)):
        with pytest.raises(ConfigError, match=field):
            RouterConfig.from_mapping({**base, field: value})
    assert RouterConfig.from_mapping(base).body_timeout_s == 10.0
    args = build_parser().parse_args(
        ["serve", "--worker", "a=http://127.0.0.1:9", "--namespace-digest", DIGEST,
         "--block-size", "4", "--body-timeout-s", "2.5", "--json-threads", "3"])
    config = config_from_args(args)
    assert (config.body_timeout_s, config.json_threads) == (2.5, 3)
