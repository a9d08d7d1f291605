"""The router's HTTP front against hostile clients, on 127.0.0.1 with fake workers: request
chat templates (real Jinja through the tiny model's tokenizer), slow, huge or faulty prompts,
guessing what the caches hold, and `kv_transfer_params` smuggled in every shape."""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from kvcr_core.errors import ConfigError
from kvcr_core.hints import parse_hint
from kvcr_core.inventory import InventoryBatch
from kvcr_router.access import CacheDetailsGate
from kvcr_router.config import RouterConfig, WorkerSpec
from kvcr_router.front import Router
from kvcr_router.hashing import HfTokenizer, PromptHasher, PromptTokenizer
from kvcr_router.indexer import Tier
from kvcr_router.testing import FakeInventory, FakeWorker, serving
from kvcr_router.tokenizing import UNHASHED_REASONS

pytestmark = pytest.mark.unit

DIGEST = bytes(range(16))
BLOCK = 4
# 100 million loop turns that print nothing: seconds of Jinja for a 166-byte template.
HOSTILE = ("{% for a in range(500) %}{% for b in range(500) %}{% for c in range(400) %}"
           "{% if c > 999 %}x{% endif %}{% endfor %}{% endfor %}{% endfor %}"
           "{{ messages[0].content }}")
TOKEN = "operator-token-0123456789abcdef"
PROMPT = list(range(4, 4 + 40 * BLOCK))  # 40 full blocks
HASHES = PromptHasher(DIGEST, BLOCK).hashes(PROMPT)


class RecordingTokenizer(HfTokenizer):
    """The tiny model's real tokenizer; says which templates it rendered and when the
    hostile one started and ended."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.templates: list[str | None] = []
        self.hostile_started = threading.Event()
        self.hostile_done = threading.Event()

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> str:
        template = options.get("chat_template")
        self.templates.append(template)
        if template == HOSTILE:
            self.hostile_started.set()
        try:
            return super().render_chat(messages, **options)
        finally:
            if template == HOSTILE:
                self.hostile_done.set()


class SlowTokenizer:
    """Characters as token ids; a text holding "slow" blocks until `release` (at most 30 s),
    one holding "boom" raises; records the length of every text it encodes."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.encoded: list[int] = []

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        self.encoded.append(len(text))
        if "slow" in text:
            self.release.wait(30)
        if "boom" in text:
            raise RuntimeError("tokenizer fault")
        return [ord(c) for c in text]

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


@pytest.fixture(scope="module")
def hf(tiny_model: str) -> HfTokenizer:
    return HfTokenizer(tiny_model)


@contextlib.asynccontextmanager
async def front(workers: list[FakeWorker], tokenizer: PromptTokenizer | None = None,
                environ: dict[str, str] | None = None, readers: dict[str, Any] | None = None,
                **overrides: Any) -> AsyncIterator[tuple[Router, str]]:
    """A router in this process in front of `workers`, hashing with `tokenizer`."""
    readers = readers or {}
    specs = tuple(WorkerSpec(w.name, w.url, peer=f"tcp://127.0.0.1:{7200 + i}"
                             if w.name in readers else None) for i, w in enumerate(workers))
    config = RouterConfig(workers=specs, namespace_digest=DIGEST, block_size=BLOCK,
                          health_interval_s=0.1, inventory_interval_s=0.02, **overrides)
    router = Router(config, PromptHasher(DIGEST, BLOCK, tokenizer), CollectorRegistry(),
                    new_reader=lambda spec: readers[spec.name], environ=environ or {})
    async with serving(router) as url:
        yield router, url


async def unhashed(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """kvcr_router_unhashed_total by reason."""
    text = await (await http.get(url + "/metrics")).text()
    return {reason: sample(text, f'kvcr_router_unhashed_total{{reason="{reason}"}}')
            for reason in UNHASHED_REASONS}


def sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def counts(**reasons: int) -> dict[str, float]:
    return {reason: float(reasons.get(reason, 0)) for reason in UNHASHED_REASONS}


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    async with http.post(url, json=body, headers=headers) as resp:
        raw = await resp.read()
        try:
            return resp.status, dict(resp.headers), json.loads(raw)
        except ValueError:
            return resp.status, dict(resp.headers), raw


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def test_a_request_template_is_forwarded_but_never_rendered_by_default(tiny_model: str) -> None:
    """Risk: a client's chat template (Jinja code, here seconds of nested loops) runs on the
    router's tokenizer threads. By default such a request (chat_template or
    chat_template_kwargs) goes to the worker unchanged, on load alone, and is never rendered;
    an ordinary chat next to it is still hashed with the model's own template."""
    tok = RecordingTokenizer(tiny_model)

    async def test() -> None:
        a = await FakeWorker("a").start()
        hostile = chat("hi", chat_template=HOSTILE)
        kwargs = chat("hi", chat_template_kwargs={"chat_template": HOSTILE})
        async with front([a], tok) as (_, url), aiohttp.ClientSession() as http:
            answers = await asyncio.gather(*(post(http, url + "/v1/chat/completions", body)
                                             for body in (hostile, kwargs, chat("hello"))))
            assert [status for status, _, _ in answers] == [200, 200, 200]
            assert await unhashed(http, url) == counts(request_template=2)
        await a.stop()
        assert HOSTILE not in tok.templates and tok.templates == [None]
        assert sorted(a.bodies, key=str) == sorted([hostile, kwargs, chat("hello")], key=str)

    run(test)


def test_a_trusted_request_template_is_rendered(hf: HfTokenizer) -> None:
    """Risk: --trust-request-chat-template does not restore rendering clients' templates (the
    router would hash a prompt the worker never sees). With it the client's template decides
    the tokens; without it the same body is not hashed at all."""
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    body = chat("hello there", chat_template=template)
    want = len(hf.encode("[user]hello there", add_special_tokens=False))

    async def test() -> None:
        a = await FakeWorker("a").start()
        for trust, tokens, reason in ((True, want, None), (False, 0, "request_template")):
            async with front([a], hf, trust_request_chat_template=trust,
                             expose_cache_details=True) as (_, url), \
                    aiohttp.ClientSession() as http:
                status, _, explained = await post(http, url + "/kvcr/explain/chat", body)
                assert status == 200
                assert (explained["prompt_tokens"], explained["unhashed"]) == (tokens, reason)
        await a.stop()

    run(test)


def test_each_tokenize_thread_encodes_with_its_own_tokenizer_copy(hf: HfTokenizer) -> None:
    """Risk: two tokenize threads encode on one Hugging Face fast tokenizer at once (it
    raises "Already borrowed"). Each thread gets its own copy, which encodes alike."""
    text = "hello there, " * 200
    seen: dict[str, tuple[Any, list[int]]] = {}

    def work(name: str) -> None:  # keeps the copy alive: ids are not reused
        seen[name] = (hf._tok(), hf.encode(text, add_special_tokens=False))

    threads = [threading.Thread(target=work, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len({id(seen["a"][0]), id(seen["b"][0]), id(hf._tok())}) == 3
    assert seen["a"][1] == seen["b"][1] == hf.encode(text, add_special_tokens=False)


def test_a_trusted_hostile_template_delays_no_other_request(tiny_model: str) -> None:
    """Risk: one request's slow render (a trusted client's nested loops, real Jinja) holds up
    unrelated requests. The hostile request itself is routed on load at the deadline, and an
    ordinary request sent meanwhile is hashed and answered, both while the render still
    runs on its thread."""
    tok = RecordingTokenizer(tiny_model)

    async def test() -> None:
        a = await FakeWorker("a").start()
        async with front([a], tok, trust_request_chat_template=True,
                         tokenize_timeout_s=0.5) as (_, url), aiohttp.ClientSession() as http:
            slow = asyncio.create_task(post(http, url + "/v1/chat/completions",
                                            chat("hi", chat_template=HOSTILE)))
            assert await asyncio.to_thread(tok.hostile_started.wait, 30)
            status, _, _ = await post(http, url + "/v1/chat/completions", chat("hello"))
            assert status == 200 and not tok.hostile_done.is_set()
            assert (await slow)[0] == 200 and not tok.hostile_done.is_set()
            assert await unhashed(http, url) == counts(deadline=1)
            assert await asyncio.to_thread(tok.hostile_done.wait, 60)  # free the CPU
        await a.stop()
        assert len(a.bodies) == 2

    run(test)


def test_a_slow_prompt_is_routed_at_the_deadline_and_spares_the_others() -> None:
    """Risk: a request waits for its prompt's tokenization however long it takes, or others
    queue behind it. The slow one is answered while its tokenizer is still blocked; an
    ordinary one sent after it is hashed and answered meanwhile."""
    tok = SlowTokenizer()

    async def test() -> None:
        a = await FakeWorker("a").start()
        async with front([a], tok, tokenize_timeout_s=0.2) as (router, url), \
                aiohttp.ClientSession() as http:
            slow = asyncio.create_task(post(http, url + "/v1/completions", {"prompt": "slow"}))
            await asyncio.sleep(0.05)
            assert (await post(http, url + "/v1/completions", {"prompt": "fast"}))[0] == 200
            status, _, _ = await asyncio.wait_for(slow, 10)
            assert status == 200 and not tok.release.is_set()
            assert await unhashed(http, url) == counts(deadline=1)
            tok.release.set()
            await until(lambda: router.tokenize.pending == 0)
        await a.stop()

    run(test)


def test_a_full_pool_routes_new_requests_at_once() -> None:
    """Risk: work piles up behind a busy tokenizer (each request then waits the whole
    deadline). Past max_pending_tokenize, a request is routed on load at once (`busy`), and
    once the pool drains prompts are hashed again."""
    tok = SlowTokenizer()

    async def test() -> None:
        a = await FakeWorker("a").start()
        async with front([a], tok, tokenize_threads=1, max_pending_tokenize=1,
                         tokenize_timeout_s=0.2, expose_cache_details=True) as (router, url), \
                aiohttp.ClientSession() as http:
            assert (await post(http, url + "/v1/completions", {"prompt": "slow"}))[0] == 200
            assert router.tokenize.pending == 1  # its thread is still blocked
            assert (await post(http, url + "/v1/completions", {"prompt": "fast"}))[0] == 200
            assert await unhashed(http, url) == counts(deadline=1, busy=1)
            tok.release.set()
            await until(lambda: router.tokenize.pending == 0)
            status, _, explained = await post(http, url + "/kvcr/explain/completions",
                                              {"prompt": "fast again"})
            assert (status, explained["unhashed"], explained["prompt_tokens"]) == (200, None, 10)
        await a.stop()
        assert [b["prompt"] for b in a.bodies] == ["slow", "fast"]

    run(test)


def test_huge_faulty_and_unknowable_prompts_route_on_load_and_are_counted() -> None:
    """Risk: the router tokenizes megabytes of text (seconds, memory) or fails a request
    because its tokenizer or template raised. Text, chat and tools over max_prompt_chars are
    never encoded; a fault, images and salted prompts are routed on load; each is counted
    and forwarded."""
    tok = SlowTokenizer()
    big_tool = [{"type": "function", "function": {"name": "f", "description": "d" * 2000}}]
    bodies = [("/v1/completions", {"prompt": "x" * 2000}),
              ("/v1/chat/completions", chat("y" * 2000)),
              ("/v1/chat/completions", chat("short", tools=big_tool)),
              ("/v1/completions", {"prompt": "boom"}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                  {"type": "image_url", "image_url": {"url": "data:,"}}]}]}),
              ("/v1/completions", {"prompt": "salted", "cache_salt": "tenant-1"})]

    async def test() -> None:
        a = await FakeWorker("a").start()
        async with front([a], tok, max_prompt_chars=1000) as (_, url), \
                aiohttp.ClientSession() as http:
            for path, body in bodies:
                assert (await post(http, url + path, body))[0] == 200
            assert await unhashed(http, url) == counts(too_large=3, tokenizer_error=1,
                                                       unsupported=2)
        await a.stop()
        assert tok.encoded == [4]  # only "boom" reached the tokenizer
        assert a.bodies == [body for _, body in bodies]

    run(test)


def test_cache_details_are_hidden_unless_exposed() -> None:
    """Risk: anyone learns which blocks of a guessed prompt are cached (explain, the x-kvcr-*
    headers, the worker's kv_transfer_params). By default explain answers exactly as a path
    that does not exist, for every method, and answers carry none of them; with
    expose_cache_details everyone gets them."""

    async def test() -> None:
        a = await FakeWorker("a").start()
        async with front([a]) as (_, url), aiohttp.ClientSession() as http:
            async with http.post(url + "/kvcr/absent", json={}) as resp:
                absent = (resp.status, await resp.read(), resp.headers["Content-Type"])
            for method in ("POST", "GET", "PUT"):
                async with http.request(method, url + "/kvcr/explain/chat",
                                        json=chat("hi")) as resp:
                    assert (resp.status, await resp.read(),
                            resp.headers["Content-Type"]) == absent
            status, headers, answer = await post(http, url + "/v1/completions",
                                                 {"prompt": PROMPT})
            assert status == 200 and answer == {"worker": "a", "choices": [{"text": "ok"}]}
            assert not {k.lower() for k in headers} & {"x-kvcr-worker", "x-kvcr-hint-blocks"}
        async with front([a], expose_cache_details=True) as (_, url), \
                aiohttp.ClientSession() as http:
            status, headers, answer = await post(http, url + "/v1/completions",
                                                 {"prompt": PROMPT})
            assert (headers["x-kvcr-worker"], headers["x-kvcr-hint-blocks"]) == ("a", "0")
            assert answer["kv_transfer_params"] == {"kvcr_loaded_tokens": 0}
            assert (await post(http, url + "/kvcr/explain/chat", chat("hi")))[0] == 200
        await a.stop()

    run(test)


def test_the_operator_token_unlocks_cache_details_and_stays_with_the_router(
        tmp_path: Path) -> None:
    """Risk: a wrong token unlocks cache details, or the operator's token travels on to the
    workers. The right token (file or environment) gets explain and the headers; a wrong or
    missing one gets neither; no worker ever sees the token header."""
    token_file = tmp_path / "operator-token"
    token_file.write_text(TOKEN + "\n")
    right = {"X-KVCR-Operator-Token": TOKEN}
    wrong = {"X-KVCR-Operator-Token": TOKEN[:-1] + "0"}

    async def test() -> None:
        a = await FakeWorker("a").start()
        for settings in ({"operator_token_file": str(token_file)},
                         {"environ": {"KVCR_ROUTER_OPERATOR_TOKEN": TOKEN}}):
            async with front([a], **settings) as (_, url), aiohttp.ClientSession() as http:
                for headers, shown in ((right, True), (wrong, False), (None, False)):
                    status, got, _ = await post(http, url + "/v1/completions",
                                                {"prompt": [1, 2]}, headers)
                    assert status == 200 and ("x-kvcr-worker" in got) == shown
                    status, _, _ = await post(http, url + "/kvcr/explain/completions",
                                              {"prompt": [1, 2]}, headers)
                    assert status == (200 if shown else 404)
        await a.stop()
        assert len(a.headers) == 6
        assert all("x-kvcr-operator-token" not in h for h in a.headers)

    run(test)


def test_weak_or_unreadable_operator_tokens_stop_the_start(tmp_path: Path) -> None:
    """Risk: a guessable token, or a missing token file, silently guards cache details (or
    silently disables the operator's access). Both are ConfigErrors naming the field."""
    config = RouterConfig(workers=(WorkerSpec("a", "http://h:1"),), namespace_digest=DIGEST,
                          block_size=BLOCK, operator_token_file=str(tmp_path / "absent"))
    with pytest.raises(ConfigError) as err:
        CacheDetailsGate.from_config(config, {})
    assert err.value.field == "operator_token_file"
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ConfigError) as err:
        CacheDetailsGate.from_config(RouterConfig(
            workers=config.workers, namespace_digest=DIGEST, block_size=BLOCK,
            operator_token_file=str(tmp_path / "short")), {})
    assert err.value.field == "operator_token_file"
    plain = RouterConfig(workers=config.workers, namespace_digest=DIGEST, block_size=BLOCK)
    with pytest.raises(ConfigError) as err:
        CacheDetailsGate.from_config(plain, {"KVCR_ROUTER_OPERATOR_TOKEN": "has space " * 4})
    assert err.value.field == "operator_token_env"
    assert CacheDetailsGate.from_config(plain, {}).closed


SMUGGLED: list[tuple[str, str, Any]] = [
    (where, key, value)
    for where in ("", "vllm_xargs")
    for key, value in [("kv_transfer_params", v) for v in (
        {"kv_hint": {"protocol_version": "0.1"}, "do_remote_prefill": True},
        '{"kv_hint": {}}', ["kv_hint"], 7, 0.5, None)] + [
        ("kv_hint", {"protocol_version": "0.1"}), ("kv_hints", ["x"])]]


def test_no_smuggled_transfer_params_reach_a_worker() -> None:
    """Risk: a client steers a worker's KV transfers through kv_transfer_params, kv_hint or
    kv_hints, top-level or inside vllm_xargs (which vLLM merges into extra_args), in any JSON
    type. None of them reaches a worker, whether the router hints it (b, while the holder a
    is busy) or not (a itself); each is counted; the rest of vllm_xargs stays; the only
    kv_transfer_params a worker gets is the router's own hint."""

    async def test() -> None:
        a, b = await FakeWorker("a").start(), await FakeWorker("b").start()
        inventory = FakeInventory([InventoryBatch(1, DIGEST, array.array("Q", HASHES),
                                                  array.array("Q"))])
        async with front([a, b], readers={"a": inventory}) as (router, url), \
                aiohttp.ClientSession() as http:
            await until(lambda: router.indexer.prefix("a", Tier.POOL, HASHES) == 40)
            for busy in (1000, 0):  # a busy: b gets a hint; a idle: a, no hint needed
                router.pool.begin("a", busy)
                for where, key, value in SMUGGLED:
                    body: dict[str, Any] = {"prompt": PROMPT, "vllm_xargs": {"keep": 1}}
                    (body["vllm_xargs"] if where else body)[key] = value
                    assert (await post(http, url + "/v1/completions", body))[0] == 200
                router.pool.end("a", busy)
            text = await (await http.get(url + "/metrics")).text()
        await a.stop()
        await b.stop()
        assert len(a.bodies) == len(b.bodies) == len(SMUGGLED)
        assert a.bodies == [{"prompt": PROMPT, "vllm_xargs": {"keep": 1}}] * len(SMUGGLED)
        for seen in b.bodies:
            assert seen["vllm_xargs"] == {"keep": 1}
            (params,) = [v for k, v in seen.items() if k not in ("prompt", "vllm_xargs")]
            assert list(params) == ["kv_hint"] and seen["kv_transfer_params"] is params
            (fetch,) = parse_hint(params["kv_hint"]).fetches
            assert fetch.source_endpoint == "tcp://127.0.0.1:7200"
        for where, key in {(w, k) for w, k, _ in SMUGGLED}:
            field = f"{where}.{key}" if where else key
            want = 2 * sum(1 for w, k, _ in SMUGGLED if (w, k) == (where, key))
            assert sample(text, f'kvcr_router_client_hints_stripped_total{{field="{field}"}}'
                          ) == want

    run(test)


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)
