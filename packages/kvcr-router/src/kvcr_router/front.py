"""The router's HTTP front: OpenAI-compatible `/v1/completions` and `/v1/chat/completions`
(streaming too) proxied to the chosen worker, plus `/v1/models`, `/health` and `/metrics`.

Per request: read the body within `max_body_bytes` and `body_timeout_s` and decode it, large
ones on the JSON threads (bodies.py; refusals are 413/408/400/503, counted by reason), strip
client-supplied KV hints and transfer params (hinting.py), hash the
prompt in the bounded tokenizing pool (tokenizing.py: a deadline, a bound on pending work,
clients' own chat templates only if trusted; otherwise the request is routed on load alone,
counted by reason), choose a worker among the healthy ones with the cost model (cost.py)
over the block index that the feeds keep current (feeds.py), attach the router's hint when
the chosen source's lead passes the crossover, and relay the worker's response byte for
byte (SSE chunks as they come). Cache details, i.e. the `x-kvcr-worker` and
`x-kvcr-hint-blocks` response headers, the `kv_transfer_params` of a worker's whole JSON
answer (the connector's loaded tokens) and `POST /kvcr/explain/{completions|chat}` (the
decision for a body, without forwarding it), are given only to requests the gate allows
(access.py); to the others explain answers 404, as if absent.

Faults degrade, never hang: a worker that refuses the connection is marked down and the
request is re-decided among the others (before any byte went to the client); connects are
bounded by `connect_timeout_s` and silences by `read_timeout_s`; no healthy worker is a 503.
Threading: one asyncio event loop owns the index, the pool and the metrics; tokenizing, large
bodies' JSON and inventory reads run on their own threads and hand results back to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvcr_core.peers import InventoryReader, InventorySource, PeerCredential
from kvcr_router.access import CacheDetailsGate
from kvcr_router.bodies import BodyRefused, JsonCodec, read_body
from kvcr_router.config import RouterConfig, WorkerSpec
from kvcr_router.cost import Decision, choose
from kvcr_router.feeds import InventoryFeed, KvEventsFeed, VllmEventTranslator
from kvcr_router.hashing import PromptHasher, PromptKind
from kvcr_router.hinting import (
    attach_hint,
    build_envelope,
    hinted_hashes,
    strip_client_hints,
    strip_response_params,
)
from kvcr_router.indexer import BlockIndexer
from kvcr_router.metrics import RouterMetrics
from kvcr_router.tokenizing import TokenizePool
from kvcr_router.workers import WorkerPool

log = logging.getLogger("kvcr_router")
# An allow-list: nothing else reaches a worker (not the operator token, not cookies).
FORWARDED_HEADERS = ("authorization", "accept", "x-request-id", "traceparent")
MAX_OUTPUT_TOKENS = 1 << 20


class _Unreachable(Exception):
    """The worker did not take the request: decide again. `down`: the connection was refused
    or timed out (the worker is marked unhealthy); otherwise the server closed the connection
    before answering, as a server does with an idle keep-alive connection (retried once)."""

    def __init__(self, down: bool) -> None:
        super().__init__()
        self.down = down


class Router:
    def __init__(self, config: RouterConfig, hasher: PromptHasher, registry: CollectorRegistry,
                 *, secret: PeerCredential | None = None,
                 new_reader: Callable[[WorkerSpec], InventorySource] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.hasher = hasher
        self.registry = registry
        self.access = CacheDetailsGate.from_config(config, environ)
        self.metrics = RouterMetrics(registry, [w.name for w in config.workers])
        self.indexer = BlockIndexer(config.max_blocks_per_source)
        self.pool = WorkerPool(config.workers, self.metrics, config.health_timeout_s)
        self.rng = random.Random(0)
        if new_reader is None and secret is not None:
            new_reader = self._reader_factory(secret)
        peers = [w for w in config.workers if w.peer is not None]
        if peers and new_reader is None:
            raise ValueError("workers with a peer endpoint need the peer secret")
        self._feed_executor = ThreadPoolExecutor(max(1, len(peers)), "kvcr-router-feed")
        self.tokenize = TokenizePool(
            hasher, threads=config.tokenize_threads, timeout_s=config.tokenize_timeout_s,
            max_pending=config.tokenize_pending_bound,
            max_prompt_chars=config.max_prompt_chars,
            trust_request_chat_template=config.trust_request_chat_template)
        self.json = JsonCodec(threads=config.json_threads, max_pending=4 * config.json_threads)
        self.inventory = {w.name: InventoryFeed(
            w.name, config.namespace_digest, _bind(new_reader, w), self.indexer, self.metrics,
            self._feed_executor, config.inventory_interval_s) for w in peers if new_reader}
        self.kv_events = {w.name: KvEventsFeed(
            w.name, w.kv_events, VllmEventTranslator(config.namespace_digest, config.block_size,
                                                     config.max_blocks_per_source),
            self.indexer, self.metrics) for w in config.workers if w.kv_events is not None}
        self.pool.on_down.append(self._forget_engine)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def _reader_factory(self, secret: PeerCredential
                        ) -> Callable[[WorkerSpec], InventorySource]:
        timeout_s = self.config.inventory_timeout_s

        def new(spec: WorkerSpec) -> InventorySource:
            assert spec.peer is not None
            return InventoryReader(spec.peer, secret, timeout_s)

        return new

    def _forget_engine(self, name: str) -> None:
        if name in self.kv_events:
            self.kv_events[name].lost()

    # -- lifecycle ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        # Any method: without access, every method answers 404 as for an unknown path.
        app.router.add_route("*", "/kvcr/explain/{route:completions|chat}", self._explain)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.cleanup_ctx.append(self._lifetime)
        return app

    async def _lifetime(self, app: web.Application) -> AsyncIterator[None]:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        await self.pool.check_all(self._session)  # serve the first request with known health
        self._tasks = [asyncio.create_task(self.pool.run_health(
            self._session, self.config.health_interval_s))]
        self._tasks += [asyncio.create_task(f.run()) for f in self.inventory.values()]
        self._tasks += [asyncio.create_task(f.run()) for f in self.kv_events.values()]
        yield
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._session.close()
        self._feed_executor.shutdown(wait=False, cancel_futures=True)
        self.tokenize.close()
        self.json.close()

    # -- routes ------------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "completions", "/v1/completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "chat", "/v1/chat/completions")

    async def _models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        for name in self.pool.routable():
            url = self.pool.workers[name].spec.url + "/v1/models"
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
                async with self._session.get(url, timeout=timeout,
                                             headers=_forward_headers(request)) as resp:
                    return web.Response(status=resp.status, body=await resp.read(),
                                        content_type="application/json")
        return _error(503, "no healthy worker")

    async def _health(self, request: web.Request) -> web.Response:
        workers = {n: {"healthy": w.healthy, "active_requests": w.active_requests,
                       "inventory": self.inventory[n].up if n in self.inventory else None}
                   for n, w in self.pool.workers.items()}
        body = {"workers": workers, "namespace": self.config.namespace_digest.hex(),
                "block_size": self.config.block_size}
        return web.json_response(body, status=200 if self.pool.routable() else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _explain(self, request: web.Request) -> web.Response:
        if not self.access.allows(request.headers):
            raise web.HTTPNotFound()  # the same answer as a path that does not exist
        if request.method != "POST":
            raise web.HTTPMethodNotAllowed(request.method, ["POST"])
        route: PromptKind = "chat" if request.match_info["route"] == "chat" else "completions"
        taken = await self._body(request)
        if isinstance(taken, web.Response):
            return taken
        body, _ = taken
        strip_client_hints(body)
        hashed = await self.tokenize.hash(route, body)
        names = self.pool.routable()
        if not names:
            return _error(503, "no healthy worker")
        decision = choose(self.indexer, hashed.hashes, names, self.pool.loads(),
                          self.config.weights, self.rng)
        return web.json_response({
            "worker": decision.worker, "hint_source": decision.hint_source,
            "hint_range": list(decision.hint_range), "prompt_tokens": hashed.tokens,
            "prompt_blocks": len(hashed.hashes), "unhashed": hashed.unhashed,
            "candidates": [dataclasses.asdict(c) for c in decision.candidates]})

    # -- proxy -------------------------------------------------------------------------------

    async def _proxy(self, request: web.Request, route: PromptKind,
                     path: str) -> web.StreamResponse:
        taken = await self._body(request)
        if isinstance(taken, web.Response):
            self.metrics.requests.labels(route, "bad_request").inc()
            return taken
        body, size = taken
        for field in strip_client_hints(body):
            self.metrics.stripped.labels(field).inc()
        started = time.perf_counter()
        hashed = await self.tokenize.hash(route, body)
        if hashed.unhashed is not None:
            self.metrics.unhashed.labels(hashed.unhashed).inc()
        hashes = hashed.hashes
        blocks = -(-(hashed.tokens + _max_tokens(body)) // self.config.block_size)
        details = self.access.allows(request.headers)
        request_id = f"kvcr-{uuid.uuid4().hex[:20]}"
        tried: set[str] = set()
        dropped: set[str] = set()
        while True:
            names = self.pool.routable(frozenset(tried))
            if not names:
                self.metrics.requests.labels(route, "no_worker").inc()
                return _error(503, "no healthy worker could take the request")
            decision = choose(self.indexer, hashes, names, self.pool.loads(),
                              self.config.weights, self.rng)
            if not tried and not dropped:  # the first decision only
                self.metrics.decision_seconds.observe(time.perf_counter() - started)
            out = dict(body)
            hint_blocks = self._hint(decision, hashes, request_id, out)
            self.metrics.decisions.labels(decision.worker).inc()
            shown = {"x-kvcr-worker": decision.worker,
                     "x-kvcr-hint-blocks": str(hint_blocks)} if details else {}
            payload = await self.json.dumps(out, size)
            try:
                return await self._forward(request, route, path, decision.worker, payload,
                                           blocks, shown)
            except _Unreachable as exc:
                if exc.down or decision.worker in dropped:
                    tried.add(decision.worker)
                dropped.add(decision.worker)

    async def _body(self, request: web.Request) -> tuple[dict[str, Any], int] | web.Response:
        """The body as a JSON object and its size in bytes, or the answer that refuses it
        (counted by reason; the connection closes where the rest was never read)."""
        try:
            raw = await read_body(request, self.config.max_body_bytes,
                                  self.config.body_timeout_s)
            body = await self.json.loads(raw)
            if not isinstance(body, dict):
                raise BodyRefused("bad_json", "the body must be a JSON object")
            return body, len(raw)
        except BodyRefused as exc:
            self.metrics.bodies_refused.labels(exc.reason).inc()
            if not exc.close:
                return _error(exc.status, str(exc))
            log.debug("refused a request body from %s: %s", request.remote, exc)
            resp = _error(exc.status, str(exc))
            resp.force_close()
            await resp.prepare(request)
            await resp.write_eof()
            request.protocol.force_close()  # flushes the answer, then drops the unread rest
            return resp

    def _hint(self, decision: Decision, hashes: list[int], request_id: str,
              body: dict[str, Any]) -> int:
        """Attaches the router's hint to `body` if the decision names a source; counts why
        not otherwise. Returns the number of hinted blocks."""
        pick = next(c for c in decision.candidates if c.worker == decision.worker)
        if not hashes:
            outcome = "unhashed"
        elif decision.hint_source is None:
            outcome = "below_crossover" if pick.fetch > 0 else "none"
        elif (endpoint := self.pool.workers[decision.hint_source].spec.peer) is None:
            outcome = "no_endpoint"
        else:
            named = hinted_hashes(self.indexer, decision, hashes)
            attach_hint(body, build_envelope(request_id, endpoint, named))
            self.metrics.hints.labels("emitted").inc()
            self.metrics.hint_lead.observe(pick.fetch)
            return len(named)
        self.metrics.hints.labels(outcome).inc()
        return 0

    async def _forward(self, request: web.Request, route: PromptKind, path: str, name: str,
                       payload: bytes, blocks: int,
                       shown: dict[str, str]) -> web.StreamResponse:
        assert self._session is not None
        spec = self.pool.workers[name].spec
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s,
                                        sock_read=self.config.read_timeout_s)
        headers = {**_forward_headers(request), "Content-Type": "application/json"}
        self.pool.begin(name, blocks)
        try:
            try:
                upstream = await self._session.post(spec.url + path, data=payload,
                                                    headers=headers, timeout=timeout)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                reason = "timeout" if isinstance(exc, asyncio.TimeoutError) else "connect"
                self.metrics.upstream_failures.labels(name, reason).inc()
                self.pool.set_health(name, False, f"{type(exc).__name__}: {exc}")
                raise _Unreachable(down=True) from exc
            except aiohttp.ServerDisconnectedError as exc:
                self.metrics.upstream_failures.labels(name, "broken").inc()
                raise _Unreachable(down=False) from exc
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.metrics.upstream_failures.labels(name, "timeout").inc()
                self.metrics.requests.labels(route, "upstream_error").inc()
                return _error(504, f"worker {name} did not answer: {type(exc).__name__}")
            async with upstream:
                return await self._relay(request, route, name, upstream, shown)
        finally:
            self.pool.end(name, blocks)

    async def _relay(self, request: web.Request, route: PromptKind, name: str,
                     upstream: aiohttp.ClientResponse,
                     shown: dict[str, str]) -> web.StreamResponse:
        """Relays the worker's answer; `shown`: the cache-detail headers this client may see
        (none: a whole JSON answer loses its `kv_transfer_params`, what the worker loaded)."""
        content_type = upstream.headers.get("Content-Type", "application/json")
        resp = web.StreamResponse(status=upstream.status,
                                  headers={"Content-Type": content_type, **shown})
        try:
            if not shown and content_type.startswith("application/json"):
                answer = strip_response_params(await upstream.read())
                await resp.prepare(request)
                await resp.write(answer)
            else:
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                aiohttp.SocketTimeoutError, asyncio.TimeoutError) as exc:
            self.metrics.upstream_failures.labels(name, "broken").inc()
            self.metrics.requests.labels(route, "upstream_error").inc()
            log.warning("worker %s broke off a response: %s", name, type(exc).__name__)
            if request.transport is not None:
                request.transport.close()  # the client sees a truncated response, not success
            return resp
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self.metrics.requests.labels(route, "client_gone").inc()
            return resp
        await resp.write_eof()
        self.metrics.requests.labels(route, "ok" if upstream.status < 500
                                     else "upstream_error").inc()
        return resp


def _bind(new_reader: Callable[[WorkerSpec], InventorySource] | None,
          spec: WorkerSpec) -> Callable[[], InventorySource]:
    assert new_reader is not None
    return lambda: new_reader(spec)


def _forward_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}


def _max_tokens(body: Mapping[str, Any]) -> int:
    value = body.get("max_tokens", body.get("max_completion_tokens"))
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return min(value, MAX_OUTPUT_TOKENS)
    return 0


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "kvcr_router_error",
                                        "code": status}}, status=status)
