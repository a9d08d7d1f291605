"""The peer half of a Runner host: serving its blocks to peers, fetching from them, and pull on
miss. `PeerAccess` is what a `RunnerService` needs of it; `RunnerPeers` is the real one (a
`PeerServer` when `peer.listen` is set, a `PeerClient` per namespace fetched into, a
`PeerDirectory` following the peers' inventories when pull on miss is on);
kvcr_core.testing's `LoopbackPeers` stands in for it in unit tests.

A fetch may only go to a configured peer: `fetcher` answers None for any other endpoint, so
neither a hint nor a client can make the Runner dial anything else.

Threading: thread-safe (one lock over the fetchers; the server, clients and directory run
threads of their own). The attach server's loop and, in embedded mode, the engine's threads
call it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from kvcr_core.attach.settings import PeerConfig
from kvcr_core.keys import router_hash_kvcr_v1
from kvcr_core.peers import FetchResult, InventoryReader, PeerClient, PeerMetrics, PeerServer
from kvcr_core.peers.directory import InventorySource, PeerDirectory
from kvcr_core.peers.fleet import FleetCredential
from kvcr_core.peers.metrics import DirectoryMetrics
from kvcr_core.peers.origins import OriginRegistry
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import BlockKey, NamespaceDigest

log = logging.getLogger("kvcr_core.attach")


class FetchTask(Protocol):
    """A fetch in flight (`kvcr_core.peers.FetchHandle`)."""

    def poll(self) -> FetchResult | None: ...

    def cancel(self) -> None: ...


class Fetcher(Protocol):
    """Fetches into one namespace (`kvcr_core.peers.PeerClient`)."""

    def fetch_async(self, endpoint: str, keys: Sequence[BlockKey],
                    deadline_s: float) -> FetchTask: ...


class PeerAccess(Protocol):
    @property
    def fetches_from_peers(self) -> bool:
        """Whether any peer is configured."""
        ...

    def fetcher(self, store: NamespaceStore, endpoint: str) -> Fetcher | None:
        """What fetches into `store` from `endpoint`, if it is a configured peer."""
        ...

    def remote_run(self, namespace: NamespaceDigest,
                   keys: Sequence[BlockKey]) -> tuple[str, int] | None:
        """The peer holding the longest run of `keys` from the first, if worth fetching."""
        ...


class RunnerPeers:
    """A Runner's peers as its `PeerConfig` says (see the module docstring)."""

    def __init__(self, config: PeerConfig, runner: Runner, metrics: PeerMetrics) -> None:
        self.config = config
        self.runner = runner
        self.metrics = metrics
        self.server: PeerServer | None = None
        self.directory: PeerDirectory | None = None
        self._fetchers: dict[NamespaceDigest, PeerClient] = {}
        self._lock = threading.Lock()
        credential = config.secret
        self.origins = OriginRegistry(credential) if isinstance(
            credential, FleetCredential) else None

    def tick(self) -> None:
        """Re-reads the fleet file if it changed: blocks whose origin it revoked are dropped
        from every namespace (and the revoked node's connections end at their next use)."""
        if self.origins is None:
            return
        revoked = self.origins.credential.refresh()
        if revoked:
            dropped = self.origins.revoked(revoked, self.runner)
            log.warning("kvcr fleet: %s revoked; %d blocks of theirs dropped",
                        ", ".join(sorted(revoked)), dropped)
    def start(self) -> None:
        """Starts the peer server and the peer directory, as far as the config asks."""
        peer = self.config
        if peer.peers and peer.pull_on_miss and peer.secret is not None:
            readers: dict[str, Callable[[], InventorySource]] = {
                endpoint: functools.partial(InventoryReader, endpoint, peer.secret,
                                            tls=peer.tls)
                for endpoint in sorted(peer.peers)}
            self.directory = PeerDirectory(readers, DirectoryMetrics(self.metrics.registry),
                                           max_blocks=peer.feed_max_blocks)
        if not peer.listen:
            return
        host, _, port = peer.listen.rpartition(":")
        assert peer.secret is not None
        self.server = PeerServer(self.runner, peer.secret, self.metrics, host=host.strip("[]"),
                                 port=int(port), tls=peer.tls, nixl=peer.nixl,
                                 origins=self.origins)
        log.info("kvcr serving peers on %s", self.server.endpoint)

    @property
    def endpoint(self) -> str | None:
        """Where this Runner serves peers (None: it serves none)."""
        return None if self.server is None else self.server.endpoint

    @property
    def fetches_from_peers(self) -> bool:
        return bool(self.config.peers)

    @property
    def fetchers(self) -> tuple[PeerClient, ...]:
        """The fetchers started so far (one per namespace fetched into)."""
        with self._lock:
            return tuple(self._fetchers.values())

    def fetcher(self, store: NamespaceStore, endpoint: str) -> PeerClient | None:
        peer = self.config
        if endpoint not in peer.peers or peer.secret is None:
            return None
        with self._lock:
            client = self._fetchers.get(store.digest)
            if client is None:
                client = self._fetchers[store.digest] = PeerClient(
                    store, peer.secret, self.metrics, tls=peer.tls, nixl=peer.nixl,
                    origins=self.origins)
            return client

    def remote_run(self, namespace: NamespaceDigest,
                   keys: Sequence[BlockKey]) -> tuple[str, int] | None:
        if self.directory is None or not keys:
            return None
        return self.directory.run(namespace, [router_hash_kvcr_v1(k) for k in keys],
                                  self.config.pull_min_blocks)

    def forget(self, store: NamespaceStore) -> None:
        """`store`'s namespace is going away: its fetcher stops, its pool is no longer
        exposed to peers."""
        with self._lock:
            fetcher = self._fetchers.pop(store.digest, None)
        if fetcher is not None:
            fetcher.close()
        if self.server is not None:
            self.server.forget(store)

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
        if self.server is not None:
            self.server.close()
        with self._lock:
            fetchers, self._fetchers = list(self._fetchers.values()), {}
        for client in fetchers:
            client.close()
