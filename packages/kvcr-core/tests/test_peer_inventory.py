"""The inventory feed a router follows: the blocks a Runner stored and evicted, as numbered
batches of kvcr-v1 router hashes over the authenticated peer port. Risks: a router credits a
worker with blocks it no longer has (or the wrong block), or reads another runner's feed
without the secret."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvcr_core.config import KVCRConfig
from kvcr_core.peers import PeerMetrics, PeerSecret, PeerServer
from kvcr_core.runner import Runner
from kvcr_core.testing import pattern_block, random_keys, secret_for
from kvcr_core.types import NamespaceDigest

pytestmark = pytest.mark.unit

SECRET = PeerSecret(secret_for("correct horse battery staple, 2026 edition").encode())
NS = NamespaceDigest(b"peer-test-ns-v1!")
BLOCK = 16384


def test_inventory_events_follow_stores_and_evictions() -> None:
    """A router following a runner sees the blocks it stored and the ones it evicted, in
    numbered batches with kvcr-v1 router hashes; a reader too far behind is told to reset."""
    from kvcr_core.inventory import InventoryLog
    from kvcr_core.keys import router_hash_kvcr_v1
    from kvcr_core.peers.inventory_reader import InventoryReader

    registry = CollectorRegistry()
    runner = Runner(KVCRConfig(pool_bytes=4 * BLOCK), registry=registry)
    store = runner.open_namespace(NS, BLOCK)
    server = PeerServer(runner, SECRET, PeerMetrics(registry))
    keys = random_keys(6, seed=8)
    store.store(keys[:4], [pattern_block(k, BLOCK) for k in keys[:4]])
    reader = InventoryReader(server.endpoint, SECRET)
    reset, batches = reader.poll()
    assert not reset and [b.namespace for b in batches] == [NS]
    assert set(batches[0].stored) == {router_hash_kvcr_v1(k) for k in keys[:4]}
    store.store(keys[4:], [pattern_block(k, BLOCK) for k in keys[4:]])  # evicts two
    reset, batches = reader.poll()
    stored = {h for b in batches for h in b.stored}
    removed = {h for b in batches for h in b.removed}
    assert stored == {router_hash_kvcr_v1(k) for k in keys[4:]} and len(removed) == 2
    assert reader.poll() == (False, [])
    with pytest.raises(ConnectionError, match="auth"):
        wrong = PeerSecret(secret_for("a-different-secret-zzz-0123456789abc").encode())
        InventoryReader(server.endpoint, wrong).poll()
    log = InventoryLog(max_batches=2, max_events=1)
    for k in keys:
        log.stored(NS, [k])
    reset, batches = log.read(0)
    assert reset and len(batches) == 2
    reader.close()
    server.close()


def test_inventory_hashes_are_the_documented_projection_for_any_keys() -> None:
    """Risk: the batch projection at sealing (done in C over the keys end to end) credits a
    router with the wrong block: a short key next to a long one (together a multiple of 16
    bytes) must still give each key its own first 8 bytes."""
    from kvcr_core.inventory import InventoryLog
    from kvcr_core.keys import router_hash_kvcr_v1

    log = InventoryLog(max_events=6)
    sized = random_keys(5, seed=12)
    odd = [b"\x01" * 8, bytes(range(24))]  # 32 bytes together
    log.stored(NS, sized[:3])
    log.removed(NS, sized[3:5])
    log.stored(NS, odd)  # seals: 7 events
    log.stored(NS, sized)  # sized keys only again
    _, batches = log.read(0)
    assert [(b.stored.tolist(), b.removed.tolist()) for b in batches] == [
        ([router_hash_kvcr_v1(k) for k in [*sized[:3], *odd]],
         [router_hash_kvcr_v1(k) for k in sized[3:5]]),
        ([router_hash_kvcr_v1(k) for k in sized], [])]
