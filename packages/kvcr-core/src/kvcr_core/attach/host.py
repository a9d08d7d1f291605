"""`RunnerHost`: what every client of one Runner shares. It owns the `Runner`, admission, the
peer half (`RunnerPeers`), the attach metrics, owner ids, the clients attached now (over the
socket or in-process) and giving back the memory of a namespace nobody attached to, read or
wrote for `namespace_idle_s` (its READY blocks leave the inventory as removed).

`attach` admits a client, opens its namespaces and hands back its `RunnerService`; `detach`
reclaims what it held. The attach server calls them for its connections; an engine's own
embedded Runner calls `attach` for its in-process client.

Threading: thread-safe (one lock over the table of clients and the owner ids); the attach
server's loop and, in embedded mode, the engine's threads call it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from kvcr_core.attach.admission import Admission, AttachRefused
from kvcr_core.attach.config import ServerConfig
from kvcr_core.attach.metrics import AttachMetrics
from kvcr_core.attach.peering import PeerAccess, RunnerPeers
from kvcr_core.attach.protocol import CloseReason
from kvcr_core.attach.service import RunnerService
from kvcr_core.attach.status import status_report
from kvcr_core.errors import CapacityError, ConfigError
from kvcr_core.keys import NamespaceSpec
from kvcr_core.peers import PeerMetrics
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import NamespaceDigest, OwnerId

log = logging.getLogger("kvcr_core.attach")


@dataclasses.dataclass(frozen=True)
class _Client:
    service: RunnerService
    uid: int
    identity: str


class RunnerHost:
    def __init__(self, config: ServerConfig, registry: CollectorRegistry, *,
                 peers: PeerAccess | None = None) -> None:
        """`peers`: the peer half to use instead of the one the config describes (tests)."""
        self.config = config
        self.registry = registry
        self.runner = Runner(config.runner, registry=registry)
        self.metrics = AttachMetrics(registry)
        self.peers = RunnerPeers(config.peer, self.runner, PeerMetrics(registry))
        self._access: PeerAccess = peers if peers is not None else self.peers
        self.admission = Admission(config)
        self.started_s = time.monotonic()
        self._lock = threading.Lock()
        self._clients: dict[OwnerId, _Client] = {}
        self._next_owner = 1
        self._last_used: dict[NamespaceDigest, float] = {}

    def new_owner(self) -> OwnerId:
        with self._lock:
            owner = OwnerId(self._next_owner)
            self._next_owner += 1
            return owner

    def attach(self, owner: OwnerId, uid: int, specs: Sequence[NamespaceSpec],
               block_bytes: int, identity: str) -> RunnerService:
        """Admits `uid` to `specs` (opened in order) and returns its client's service, or
        raises AttachRefused."""
        with self._lock:
            self.admission.check(uid, specs, [
                (c.uid, [s.digest for s in c.service.stores]) for c in self._clients.values()])
            stores = [self._open(spec, block_bytes) for spec in specs]
            service = RunnerService(self.runner, stores, owner, self._access,
                                    self.config.limits, on_close=self.detach)
            self._clients[owner] = _Client(service, uid, identity[:128])
            now = time.monotonic()
            for store in stores:
                self._last_used[store.digest] = now
        self.metrics.on_attach()
        return service

    def _open(self, spec: NamespaceSpec, block_bytes: int) -> NamespaceStore:
        try:
            return self.runner.open_namespace(spec, block_bytes, prefault=self.config.prefault,
                                              back_ahead=self.config.back_ahead_bytes)
        except (ConfigError, ValueError) as exc:
            raise AttachRefused(CloseReason.BAD_NAMESPACE, str(exc)) from None
        except CapacityError as exc:
            raise AttachRefused(CloseReason.CAPACITY, str(exc)) from None

    def detach(self, service: RunnerService) -> tuple[int, int]:
        """The client is gone: its writes aborted, its reads released (READY blocks stay);
        returns (blocks aborted, leases released)."""
        with self._lock:
            if self._clients.pop(service.owner, None) is None:
                return 0, 0
            now = time.monotonic()
            for store in service.stores:
                self._last_used[store.digest] = now
        aborted, released = service.reclaim()
        self.metrics.on_reclaim(aborted, released)
        return aborted, released

    @property
    def attached_clients(self) -> int:
        return len(self._clients)

    def status(self, socket_path: str) -> str:
        with self._lock:
            attached = [([store.digest for store in c.service.stores], c.identity)
                        for c in self._clients.values()]
        return status_report(self.runner, socket_path=socket_path, started_s=self.started_s,
                             attached=attached, peer_endpoint=self.peers.endpoint)

    def release_idle(self, now: float) -> None:
        """Gives back the memory of namespaces unused for `namespace_idle_s`."""
        idle_s = self.config.namespace_idle_s
        if idle_s is None:
            return
        with self._lock:
            in_use = {s.digest for c in self._clients.values() for s in c.service.stores}
            for digest in self.runner.namespaces:
                store = self.runner.namespace(digest)
                index = store.index
                if digest in in_use or index.leased_slots or index.filling_blocks:
                    self._last_used[digest] = now
                    continue
                if now - self._last_used.setdefault(digest, now) < idle_s:
                    continue
                self.peers.forget(store)
                self.runner.release_namespace(digest)
                del self._last_used[digest]
                self.metrics.on_namespace_released()
                log.info("namespace %s unused for %.0f s: its %d bytes are given back",
                         digest.hex(), idle_s, store.pool.region.size_bytes)

    def start(self) -> None:
        self.peers.start()

    def close(self) -> None:
        self.peers.close()
        self.runner.close()
