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
import functools
import logging
import threading
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from kvcr_core.attach.admission import Admission, AttachRefused, Scope
from kvcr_core.attach.config import ServerConfig
from kvcr_core.attach.metrics import AttachMetrics
from kvcr_core.attach.peering import PeerAccess, RunnerPeers
from kvcr_core.attach.protocol import CloseReason
from kvcr_core.attach.service import Grant, RunnerService
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
        self._scope_of: dict[NamespaceDigest, Scope] = {}
        self._members: dict[tuple[int, NamespaceDigest], tuple[OwnerId, ...]] = {}

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
            opened = self.admission.check(uid, specs, [
                (c.uid, [s.digest for s in c.service.stores]) for c in self._clients.values()])
            stores, grants = [], []
            for spec in opened:
                scope = self.admission.scope(uid, spec.tenant)
                store = self._open(spec, block_bytes, scope)
                stores.append(store)
                grants.append(Grant(
                    may_clear=uid == self.admission.runner_uid or not scope.shared,
                    siblings=functools.partial(self._siblings, uid, store.digest)
                    if scope.shared else None,
                    shared=scope.shared and len(scope.uids) > 1))
            service = RunnerService(self.runner, stores, owner, self._access,
                                    self.config.limits, grants=grants, poster=f"uid:{uid}",
                                    on_close=self.detach)
            self._clients[owner] = _Client(service, uid, identity[:128])
            now = time.monotonic()
            for store in stores:
                self._last_used[store.digest] = now
                self._members[uid, store.digest] = (*self._members.get((uid, store.digest), ()),
                                                    owner)
        self.metrics.on_attach()
        return service

    def _siblings(self, uid: int, digest: NamespaceDigest) -> tuple[OwnerId, ...]:
        return self._members.get((uid, digest), ())

    def _open(self, spec: NamespaceSpec, block_bytes: int, scope: Scope) -> NamespaceStore:
        """Opens (or finds) a namespace of `scope`, within its byte quota; namespaces idle
        and unattached (their uids gone) give their memory back first when the pool is
        full."""
        digest = spec.digest()
        if digest in self.runner.namespaces:
            return self._opened(spec, block_bytes, None, scope)
        cfg = self.config.runner
        used = sum(self.runner.namespace(d).pool.region.size_bytes
                   for d, s in self._scope_of.items() if s.name == scope.name
                   and d in self.runner.namespaces)
        room = min(cfg.namespace_pool_bytes or cfg.pool_bytes, scope.max_bytes - used)
        if room < block_bytes:
            raise AttachRefused(CloseReason.QUOTA,
                                f"{scope.name}'s namespaces take {used} of the {scope.max_bytes} "
                                "pool bytes it may use (kvcr-guard --uid-max-bytes / "
                                "--tenant-max-bytes, or --namespace-pool-bytes)")
        self._make_room(room)
        return self._opened(spec, block_bytes, room, scope)

    def _opened(self, spec: NamespaceSpec, block_bytes: int, room: int | None,
                scope: Scope) -> NamespaceStore:
        try:
            store = self.runner.open_namespace(spec, block_bytes, pool_bytes=room,
                                               prefault=self.config.prefault,
                                               back_ahead=self.config.back_ahead_bytes)
        except (ConfigError, ValueError) as exc:
            raise AttachRefused(CloseReason.BAD_NAMESPACE, str(exc)) from None
        except CapacityError as exc:
            raise AttachRefused(CloseReason.CAPACITY, str(exc)) from None
        self._scope_of.setdefault(store.digest, scope)
        return store

    def _make_room(self, room: int) -> None:
        """Releases idle namespaces no client is attached to (least recently used first)
        until `room` bytes are left in the pool, or none is idle."""
        runner = self.runner
        left = runner.config.pool_bytes - sum(runner.namespace(d).pool.region.size_bytes
                                              for d in runner.namespaces)
        in_use = {s.digest for c in self._clients.values() for s in c.service.stores}
        idle = sorted((self._last_used.get(d, 0.0), d) for d in runner.namespaces
                      if d not in in_use and not runner.namespace(d).index.leased_slots
                      and not runner.namespace(d).index.filling_blocks)
        for _, digest in idle:
            if left >= room:
                return
            left += runner.namespace(digest).pool.region.size_bytes
            self._release(digest, "its clients are gone and the pool is full")

    def detach(self, service: RunnerService) -> tuple[int, int]:
        """The client is gone: its writes aborted, its reads released (READY blocks stay);
        returns (blocks aborted, leases released)."""
        with self._lock:
            client = self._clients.pop(service.owner, None)
            if client is None:
                return 0, 0
            now = time.monotonic()
            for store in service.stores:
                self._last_used[store.digest] = now
                key = (client.uid, store.digest)
                members = tuple(o for o in self._members.get(key, ()) if o != service.owner)
                if members:
                    self._members[key] = members
                else:
                    self._members.pop(key, None)
        aborted, released = service.reclaim()
        self.metrics.on_reclaim(aborted, released)
        return aborted, released

    @property
    def attached_clients(self) -> int:
        return len(self._clients)

    def status(self, socket_path: str, uid: int | None = None) -> str:
        """The status report; for `uid` (a probe's) other than the Runner's own, only the
        namespaces it may open and the clients attached to them."""
        with self._lock:
            visible = None if uid is None or uid == self.admission.runner_uid else {
                d for d, scope in self._scope_of.items() if uid in scope.uids}
            attached = [([store.digest for store in c.service.stores], c.identity)
                        for c in self._clients.values()
                        if visible is None or c.uid == uid
                        or any(s.digest in visible for s in c.service.stores)]
        return status_report(self.runner, socket_path=socket_path, started_s=self.started_s,
                             attached=attached, peer_endpoint=self.peers.endpoint,
                             shown=visible)

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
                self._release(digest, f"unused for {idle_s:.0f} s")

    def _release(self, digest: NamespaceDigest, why: str) -> None:
        """Gives back an unused namespace's memory (the caller holds the lock)."""
        store = self.runner.namespace(digest)
        self.peers.forget(store)
        self.runner.release_namespace(digest)
        self._last_used.pop(digest, None)
        self._scope_of.pop(digest, None)
        self.metrics.on_namespace_released()
        log.info("namespace %s %s: its %d bytes are given back", digest.hex(), why,
                 store.pool.region.size_bytes)

    def start(self) -> None:
        self.peers.start()

    def close(self) -> None:
        self.peers.close()
        self.runner.close()
