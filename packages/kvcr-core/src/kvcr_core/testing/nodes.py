"""Nodes for peer tests: a Runner with one namespace open, its pool a given number of blocks
(plus a little headroom), and peer metrics in the runner's own registry; and such a node
stocked with pattern blocks and served to peers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvcr_core.config import KVCRConfig
from kvcr_core.peers import PeerMetrics, PeerSecret, PeerServer
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.testing.blocks import pattern_block, random_keys
from kvcr_core.types import BlockKey, NamespaceDigest


def peer_node(namespace: NamespaceDigest, block_bytes: int,
              blocks: int = 64) -> tuple[Runner, NamespaceStore, PeerMetrics]:
    """A fresh runner whose pool holds `blocks` blocks of `block_bytes` and 8 more, with
    `namespace` open in it, and peer metrics registered where the runner's are."""
    registry = CollectorRegistry()
    runner = Runner(KVCRConfig(pool_bytes=(blocks + 8) * block_bytes), registry=registry)
    return runner, runner.open_namespace(namespace, block_bytes), PeerMetrics(registry)


def stocked_source(namespace: NamespaceDigest, block_bytes: int, secret: PeerSecret,
                   count: int, seed: int, *,
                   nixl: bool) -> tuple[Runner, PeerServer, list[BlockKey], PeerMetrics]:
    """A node holding `count` pattern blocks (`pattern_block` of `random_keys(count, seed)`),
    served to peers by a PeerServer (over NIXL as well if `nixl`)."""
    runner, store, metrics = peer_node(namespace, block_bytes)
    keys = random_keys(count, seed=seed)
    store.store(keys, [pattern_block(k, block_bytes) for k in keys])
    return runner, PeerServer(runner, secret, metrics, nixl=nixl), keys, metrics
