"""The NIXL transport's own rules: chosen only when both sides have it, never with TLS, never
trusted beyond what the source registered; the seam loads nixl only when asked. (The peer
contract tests run over NIXL too, in test_peers.py; fetches of many READs, their checks,
cancels and deadlines, and the source's progress polling are in test_peers_nixl_reads.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
from functools import partial

import pytest

from kvcr_core import testing
from kvcr_core.memory import HostRegion, RegionKind
from kvcr_core.peers import (
    FetchStatus,
    NixlTransport,
    PeerClient,
    PeerSecret,
    PeerServer,
    TransportKind,
)
from kvcr_core.peers.nixl_engine import (
    NixlEngine,
    NixlRequestRefused,
    nixl_installed,
)
from kvcr_core.testing import FakePeerSource, pattern_block, peer_node, random_keys, secret_for
from kvcr_core.types import NamespaceDigest

pytestmark = pytest.mark.integration

if not nixl_installed():
    pytest.skip("nixl is not installed (pip install 'kvcr-core[nixl]')", allow_module_level=True)

SECRET = PeerSecret(secret_for("correct horse battery staple, 2026 edition").encode())
NS = NamespaceDigest(b"peer-test-ns-v1!")
BLOCK = 16384

node = partial(peer_node, NS, BLOCK)
stocked_source = partial(testing.stocked_source, NS, BLOCK, SECRET)


@pytest.fixture(scope="module", autouse=True)
def engine() -> NixlEngine:
    shared = NixlEngine.shared()
    assert shared.wait_ready(120), f"nixl is installed but did not start: {shared.failure}"
    return shared


@pytest.mark.parametrize("client_nixl,server_nixl", [(True, False), (False, True), (True, True)])
def test_nixl_is_chosen_only_when_both_sides_have_it(client_nixl, server_nixl) -> None:
    """Either side without NIXL (an older kvcr, or turned off) means TCP; both: NIXL."""
    _, server, keys, metrics = stocked_source(4, 21, nixl=server_nixl)
    _, dest, dmetrics = node()
    peer = PeerClient(dest, SECRET, dmetrics, nixl=client_nixl)
    result = peer.fetch(server.endpoint, keys, deadline_s=10)
    both = client_nixl and server_nixl
    assert result.statuses == (FetchStatus.OK,) * 4
    assert result.transport is (TransportKind.NIXL if both else TransportKind.TCP)
    assert dest.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    assert metrics.connections == {"tcp": 0 if both else 1, "nixl": 1 if both else 0}
    peer.close()
    server.close()


def test_a_pooled_tcp_connection_moves_to_nixl_once_both_sides_have_it() -> None:
    """A connection made while NIXL was not running on one side (e.g. still starting) is not
    kept forever: once both have it, the next fetch connects again over NIXL; a peer that
    answered TCP is asked again only after a while."""
    runner, store, metrics = node()
    keys = random_keys(4, seed=25)
    store.store(keys, [pattern_block(k, BLOCK) for k in keys])
    server = PeerServer(runner, SECRET, metrics, nixl=True)
    _, dest, dmetrics = node()
    reads = NixlTransport()
    peer = PeerClient(dest, SECRET, dmetrics, transport=reads)
    reads.offer_later(server.endpoint, 0.3)  # as if NIXL were starting
    assert peer.fetch(server.endpoint, keys[:2], deadline_s=10).transport is TransportKind.TCP
    time.sleep(0.3)
    assert peer.fetch(server.endpoint, keys[2:], deadline_s=10).transport is TransportKind.NIXL
    assert metrics.connections == {"tcp": 1, "nixl": 1}
    tcp_only = PeerServer(runner, SECRET, metrics, nixl=False)
    with dest.lock:
        dest.index.discard(keys)
    assert peer.fetch(tcp_only.endpoint, keys[:2], deadline_s=10).transport is TransportKind.TCP
    assert peer.fetch(tcp_only.endpoint, keys[2:], deadline_s=10).transport is TransportKind.TCP
    assert metrics.connections == {"tcp": 2, "nixl": 1}  # the TCP answer was remembered
    peer.close()
    tcp_only.close()
    server.close()


def test_a_source_naming_unregistered_memory_gets_nothing_published() -> None:
    """A source that points a NIXL read outside the memory it registered is refused by NIXL
    before anything moves: the blocks fail as a protocol error and none becomes READY."""
    source = FakePeerSource(SECRET, BLOCK, "outside", NixlTransport())
    _, store, metrics = node()
    keys = random_keys(3, seed=22)
    client = PeerClient(store, SECRET, metrics, nixl=True)
    result = client.fetch(source.endpoint, keys, deadline_s=5)
    assert set(result.statuses) == {FetchStatus.PROTOCOL} and "refused" in result.detail
    assert store.lookup(keys) == 0 and store.index.filling_blocks == 0
    source.close()


def test_pools_are_registered_once_and_released_with_their_last_user(engine) -> None:
    """Servers and clients of one process share the agent: a pool registered by both is
    registered once, and deregistered when the last of them closes."""
    runner, store, metrics = node()
    region = (store.pool.region.address, store.pool.region.size_bytes)

    def users() -> int:  # counted from what unclosed peers of earlier tests may have left
        return int(engine._regions.get(region, (0,))[0]) - leftover

    leftover = 0
    leftover = users()
    keys = random_keys(2, seed=23)
    store.store(keys, [pattern_block(k, BLOCK) for k in keys])
    server = PeerServer(runner, SECRET, metrics, nixl=True)
    local = PeerClient(store, SECRET, metrics, nixl=True)  # this pool is also a fetch target
    _, dest, dmetrics = node()
    remote = PeerClient(dest, SECRET, dmetrics, nixl=True)
    assert remote.fetch(server.endpoint, keys, deadline_s=10).transport is TransportKind.NIXL
    assert users() == 1
    assert local.preferred is not None  # registers the same pool as a fetch target:
    assert local.preferred.usable(server.endpoint, store)
    assert users() == 2
    server.close()
    assert users() == 1
    local.close()
    assert users() == 0
    remote.close()


def test_prepared_slot_lists_go_with_their_region(engine) -> None:
    """Risk: a READ names a local slot through descriptors prepared for memory that was since
    deregistered (stale), or a slot beyond the pool, and writes where it should not."""
    source_runner, server, keys, _ = stocked_source(4, 27, nixl=True)
    _, store, metrics = node(blocks=61)  # a size no other test registers (nor leaves behind)
    pool = store.pool
    listed = (pool.region.address, pool.stride_bytes, pool.slot_bytes, pool.capacity_slots)
    for _ in range(2):  # the second client registers and prepares the same pool afresh
        client = PeerClient(store, SECRET, metrics, nixl=True)
        assert client.fetch(server.endpoint, keys, deadline_s=10).transport is TransportKind.NIXL
        assert listed in engine._slot_lists
        client.close()
        assert listed not in engine._slot_lists
        store.clear()
    region = HostRegion.create(4 * BLOCK, RegionKind.ANONYMOUS)
    engine.register(region.address, region.size_bytes)
    try:
        slots = engine.slot_list(region.address, BLOCK, BLOCK, 4)
        assert engine.slot_list(region.address, BLOCK, BLOCK, 4) is slots  # made once
        source = source_runner.namespace(NS)
        first = source.index.slot_of(keys[0])
        assert first is not None
        remote = [source.pool.region.address + source.pool.offset(first)]
        with pytest.raises(NixlRequestRefused):  # remote memory nobody registered
            engine.prepare_reads(engine.name, slots, [region.address + 64 * BLOCK], BLOCK)
        reads = engine.prepare_reads(engine.name, slots, remote, BLOCK)
        try:
            with pytest.raises(NixlRequestRefused):
                reads.make([4], 0)  # a slot beyond the list
            with pytest.raises(NixlRequestRefused):
                reads.make([0, 1], 0)  # more addresses than were prepared
            read = reads.make([3], 0)
            read.start(time.monotonic() + 10)
            read.wait(time.monotonic() + 10)
            read.release()
        finally:
            reads.release()
        assert bytes(region.view[3 * BLOCK:4 * BLOCK]) == pattern_block(keys[0], BLOCK)
    finally:
        engine.deregister(region.address, region.size_bytes)
        server.close()
        source_runner.close()


def test_nixl_loads_only_when_a_peer_asks_for_it() -> None:
    """Importing the peers package, and TCP-only peers, never import nixl (or torch)."""
    code = (
        "import sys\n"
        "from prometheus_client import CollectorRegistry\n"
        "from kvcr_core.config import KVCRConfig\n"
        "from kvcr_core.peers import PeerClient, PeerMetrics, PeerSecret, PeerServer\n"
        "from kvcr_core.runner import Runner\n"
        "r = Runner(KVCRConfig(pool_bytes=1 << 20))\n"
        "s = r.open_namespace(b'x' * 16, 4096)\n"
        "m = PeerMetrics(CollectorRegistry())\n"
        "key = PeerSecret(b'Wy3qxzrb7ksZiotwJHHHOxUjToVj4p2d4HTLdoDir4Y=')\n"
        "server = PeerServer(r, key, m, nixl=False)\n"
        "client = PeerClient(s, key, m, nixl=False)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in "
        "('nixl', 'nixl_cu12', 'nixl_cu13', 'torch')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_a_runner_without_nixl_peers_still_serves_its_own_nixl_clients() -> None:
    """A TCP-only server (nixl=False) in a process whose clients use NIXL elsewhere does not
    register its pool: only what a NIXL connection needs is ever exposed."""
    runner, store, metrics = node()
    region = (store.pool.region.address, store.pool.region.size_bytes)
    regions = NixlEngine.shared()._regions
    before = regions.get(region, (0,))[0]  # unclosed peers of earlier tests may have left some
    server = PeerServer(runner, SECRET, metrics, nixl=False)
    _, dest, dmetrics = node()
    keys = random_keys(1, seed=24)
    store.store(keys, [pattern_block(k, BLOCK) for k in keys])
    result = PeerClient(dest, SECRET, dmetrics, nixl=True).fetch(server.endpoint, keys,
                                                           deadline_s=10)
    assert result.transport is TransportKind.TCP
    assert regions.get(region, (0,))[0] == before
    server.close()
