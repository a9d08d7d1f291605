"""SplitProxy: one base URL for vLLM's benchmark client in front of several OpenAI servers.

`vllm bench serve` targets one base URL. The proxy relays every request, byte for byte and
streamed (SSE chunks as they arrive, so the client's TTFT is the server's plus one local
hop), to the server that `route(request_id)` names (the client sends `x-request-id:
<prefix><index in its dataset>`). Requests without an id (the client's /metrics or
/v1/models calls) go to the first server.

Threading: an aiohttp server on its own event loop in one daemon thread, started by
`__enter__` on a free 127.0.0.1 port and stopped by `__exit__`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import TracebackType

import aiohttp
from aiohttp import web

from kvcr_core.testing.ports import free_port

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


class SplitProxy:
    def __init__(self, upstreams: list[str], route: Callable[[str], int]) -> None:
        self.upstreams = upstreams
        self.route = route
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="split-proxy")
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def __enter__(self) -> SplitProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    async def _start(self) -> None:
        # A new connection per request: a kept-alive one that the server closed while idle
        # (uvicorn after 5 s) fails the next request relayed on it.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=600))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _pick(self, request: web.Request) -> int:
        request_id = request.headers.get("x-request-id")
        return self.route(request_id) % len(self.upstreams) if request_id else 0

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        server = self._pick(request)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        async with self._session.request(
                request.method, self.upstreams[server] + request.path_qs, headers=headers,
                data=await request.read()) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
