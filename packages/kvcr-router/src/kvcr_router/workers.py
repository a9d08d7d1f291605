"""`WorkerPool`: the router's view of its workers: health, load, and which may take a request.

- Health: `GET {url}/health` every `health_interval_s`, each bounded by `health_timeout_s`;
  200 is healthy. A worker that fails a check, or refuses a forwarded connection, is left out
  of routing until a check passes again (its kvcr pool may still be a fetch source: that is
  the inventory feed's call, not this one's).
- Load: what this router has in flight at each worker (`active_requests`, and
  `decode_blocks` = blocks of prompt plus requested output), fed to the cost model.
Threading: the event loop thread only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import aiohttp

from kvcr_router.config import WorkerSpec
from kvcr_router.cost import WorkerLoad
from kvcr_router.metrics import RouterMetrics

log = logging.getLogger("kvcr_router")


@dataclasses.dataclass
class WorkerState:
    spec: WorkerSpec
    healthy: bool = False
    active_requests: int = 0
    decode_blocks: int = 0


class WorkerPool:
    def __init__(self, specs: tuple[WorkerSpec, ...], metrics: RouterMetrics,
                 health_timeout_s: float) -> None:
        self.workers = {spec.name: WorkerState(spec) for spec in specs}
        self.metrics = metrics
        self.health_timeout_s = health_timeout_s
        self.on_down: list[Callable[[str], None]] = []  # e.g. forget the engine's cache view

    def routable(self, exclude: frozenset[str] = frozenset()) -> list[str]:
        return [n for n, w in self.workers.items() if w.healthy and n not in exclude]

    def loads(self) -> dict[str, WorkerLoad]:
        return {n: WorkerLoad(w.decode_blocks, w.active_requests)
                for n, w in self.workers.items()}

    def begin(self, name: str, blocks: int) -> None:
        state = self.workers[name]
        state.active_requests += 1
        state.decode_blocks += blocks
        self.metrics.active.labels(name).set(state.active_requests)

    def end(self, name: str, blocks: int) -> None:
        state = self.workers[name]
        state.active_requests -= 1
        state.decode_blocks -= blocks
        self.metrics.active.labels(name).set(state.active_requests)

    def set_health(self, name: str, healthy: bool, why: str = "") -> None:
        state = self.workers[name]
        if state.healthy != healthy:
            if healthy:
                log.info("worker %s is healthy", name)
            else:
                log.warning("worker %s is unhealthy (%s): routing around it", name, why)
                for callback in self.on_down:
                    callback(name)
        state.healthy = healthy
        self.metrics.healthy.labels(name).set(1 if healthy else 0)

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._check(session, n) for n in self.workers))

    async def _check(self, session: aiohttp.ClientSession, name: str) -> None:
        url = self.workers[name].spec.url + "/health"
        try:
            timeout = aiohttp.ClientTimeout(total=self.health_timeout_s)
            async with session.get(url, timeout=timeout) as resp:
                await resp.read()
                ok, why = resp.status == 200, f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        self.set_health(name, ok, why)

    async def run_health(self, session: aiohttp.ClientSession, interval_s: float) -> None:
        """Checks every `interval_s` (the caller ran the first round before serving)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check_all(session)
