"""`Tenancy`: the attach server's namespace policy. Who may attach to which namespace now
(attached clients at most `max_clients`, a tenant's namespaces only from its uids, at most
`uid_max_namespaces` namespaces per uid), the Runner's peer server, each namespace's peer
fetcher and the peer directory (pull on miss: the peers' inventories, followed), and giving
back the memory of a namespace nobody attached to, read or wrote for `namespace_idle_s` (its
READY blocks leave the inventory as removed).

Threading: the attach server's loop thread only (the peer server runs threads of its own).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from kvcr_core.attach.config import ServerConfig
from kvcr_core.attach.metrics import AttachMetrics
from kvcr_core.attach.protocol import CloseReason
from kvcr_core.attach.session import ClientSession
from kvcr_core.keys import NamespaceSpec, router_hash_kvcr_v1
from kvcr_core.logs import printable
from kvcr_core.peers import InventoryReader, PeerClient, PeerMetrics, PeerServer
from kvcr_core.peers.directory import InventorySource, PeerDirectory
from kvcr_core.peers.metrics import DirectoryMetrics
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import BlockKey, NamespaceDigest

log = logging.getLogger("kvcr_core.attach")


class Tenancy:
    """Namespace admission, peer serving and fetching, idle release for one Runner."""

    def __init__(self, config: ServerConfig, runner: Runner, metrics: AttachMetrics,
                 peer_metrics: PeerMetrics) -> None:
        self.config = config
        self.runner = runner
        self.metrics = metrics
        self.peer_metrics = peer_metrics
        self.peer_server: PeerServer | None = None
        self.peer_clients: dict[NamespaceDigest, PeerClient] = {}
        self.directory: PeerDirectory | None = None
        self._last_used: dict[NamespaceDigest, float] = {}

    def start_peers(self) -> None:
        """Starts the peer server and the peer directory, as far as the config asks."""
        peer = self.config.peer
        if peer.peers and peer.pull_on_miss and peer.secret is not None:
            readers: dict[str, Callable[[], InventorySource]] = {
                endpoint: functools.partial(InventoryReader, endpoint, peer.secret,
                                            tls=peer.tls)
                for endpoint in sorted(peer.peers)}
            self.directory = PeerDirectory(readers, DirectoryMetrics(self.peer_metrics.registry),
                                           max_blocks=peer.feed_max_blocks)
        if not peer.listen:
            return
        host, _, port = peer.listen.rpartition(":")
        assert peer.secret is not None
        self.peer_server = PeerServer(self.runner, peer.secret, self.peer_metrics,
                                      host=host.strip("[]"), port=int(port), tls=peer.tls,
                                      nixl=peer.nixl)
        log.info("kvcr serving peers on %s", self.peer_server.endpoint)

    def admit(self, uid: int, spec: NamespaceSpec,
              attached: Sequence[ClientSession]) -> tuple[CloseReason, str] | None:
        """Whether `uid` may attach to `spec`'s namespace now (None) or why not."""
        if len(attached) >= self.config.max_clients:
            return (CloseReason.TOO_MANY_CLIENTS,
                    f"{self.config.max_clients} clients attached already")
        allowed = self.config.tenants.get(spec.tenant)
        if allowed is not None and uid not in allowed:
            return (CloseReason.NOT_ALLOWED, f"uid {uid} may not open namespaces of tenant "
                    f"{printable(spec.tenant)!r} (kvcr-guard --tenant)")
        digest = spec.digest()
        mine = {s.store.digest for s in attached if s.uid == uid and s.store is not None}
        if digest not in mine and len(mine) >= self.config.uid_max_namespaces:
            return (CloseReason.QUOTA, f"uid {uid} holds {len(mine)} namespaces, as many as "
                    "it may (kvcr-guard --uid-max-namespaces)")
        return None

    @property
    def fetches_from_peers(self) -> bool:
        return bool(self.config.peer.peers)

    def peer_client(self, store: NamespaceStore, endpoint: str) -> PeerClient | None:
        """The Runner's fetcher for a namespace, if `endpoint` is one of its peers."""
        peer = self.config.peer
        if endpoint not in peer.peers or peer.secret is None:
            return None
        client = self.peer_clients.get(store.digest)
        if client is None:
            client = self.peer_clients[store.digest] = PeerClient(
                store, peer.secret, self.peer_metrics, tls=peer.tls, nixl=peer.nixl)
        return client

    def remote_run(self, namespace: NamespaceDigest,
                   keys: Sequence[BlockKey]) -> tuple[str, int] | None:
        """The peer holding the longest run of `keys` from the first (pull on miss), if that
        run is worth fetching (`pull_min_blocks`)."""
        if self.directory is None or not keys:
            return None
        return self.directory.run(namespace, [router_hash_kvcr_v1(k) for k in keys],
                                  self.config.peer.pull_min_blocks)

    def used(self, digest: NamespaceDigest, now: float) -> None:
        """A client attached to or left the namespace at `now`."""
        self._last_used[digest] = now

    def release_idle(self, now: float, in_use: set[NamespaceDigest]) -> None:
        """Gives back the memory of namespaces unused for `namespace_idle_s` (`in_use`: those
        with a client attached)."""
        idle_s = self.config.namespace_idle_s
        if idle_s is None:
            return
        for digest in self.runner.namespaces:
            store = self.runner.namespace(digest)
            index = store.index
            if digest in in_use or index.leased_slots or index.filling_blocks:
                self._last_used[digest] = now
                continue
            if now - self._last_used.setdefault(digest, now) < idle_s:
                continue
            fetcher = self.peer_clients.pop(digest, None)
            if fetcher is not None:
                fetcher.close()
            if self.peer_server is not None:
                self.peer_server.forget(store)
            self.runner.release_namespace(digest)
            del self._last_used[digest]
            self.metrics.on_namespace_released()
            log.info("namespace %s unused for %.0f s: its %d bytes are given back",
                     digest.hex(), idle_s, store.pool.region.size_bytes)

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
        if self.peer_server is not None:
            self.peer_server.close()
        for client in self.peer_clients.values():
            client.close()
