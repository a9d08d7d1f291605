"""Test doubles for the router, shipped with it: `FakeWorker`, a vLLM-like OpenAI server on
127.0.0.1 that records the bodies and headers that reach it, `FakeInventory`, an
`InventorySource` that hands out the batches a test queues (or fails while `failing`), and
`serving(router)`, the router's app on 127.0.0.1 for the duration of a `with` (its URL).

It answers `/v1/completions` and `/v1/chat/completions` with `{"worker": name, ...}` (or an
SSE stream of three chunks when the body asks for `stream`), and like vLLM with kvcr it adds
`kv_transfer_params` (`reply_params`) to whole JSON answers. Knobs: `health_status`, `gate`
(a stream pauses after its first chunk until set), `drop_next` (close this many connections
without answering). Threading: the event loop of the test that starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from kvcr_core.peers import InventoryBatch

if TYPE_CHECKING:
    from kvcr_router.front import Router


@contextlib.asynccontextmanager
async def serving(router: Router) -> AsyncIterator[str]:
    """Serves `router` on a free 127.0.0.1 port until the block ends; yields its base URL."""
    server = TestServer(router.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


class FakeWorker:
    """A vLLM-like OpenAI server that records what reached it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.health_status = 200
        self.gate: asyncio.Event | None = None  # streaming pauses after the first chunk
        self.drop_next = 0  # close this many connections without answering
        self.reply_params: dict[str, Any] = {"kvcr_loaded_tokens": 0}
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> FakeWorker:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.drop_next:
            self.drop_next -= 1
            assert request.transport is not None
            request.transport.close()  # as a server closing an idle keep-alive connection
            return web.Response()
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if not body.get("stream"):
            return web.json_response({"worker": self.name, "choices": [{"text": "ok"}],
                                      "kv_transfer_params": self.reply_params})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f'data: {{"worker": "{self.name}", "i": {i}}}\n\n'.encode())
            if i == 0 and self.gate is not None:
                await self.gate.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class FakeInventory:
    """An `InventorySource`: hands out queued batches, or fails while `failing`."""

    def __init__(self, batches: list[InventoryBatch], epoch: int = 7) -> None:
        self.epoch: int | None = epoch
        self.batches = batches
        self.failing = False
        self.polls = 0

    def poll(self) -> tuple[bool, list[InventoryBatch]]:
        self.polls += 1
        if self.failing:
            raise ConnectionRefusedError("runner down")
        out, self.batches = self.batches, []
        return False, out

    def close(self) -> None:
        pass
