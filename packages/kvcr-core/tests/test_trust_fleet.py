"""Trust boundary, fleet: nodes authenticate with their own keys, every block carries its
origin's signature through re-serving nodes, a node cannot pass bytes off as another's,
routers only read inventories, and revoking a node drops its blocks everywhere. Peer servers
and clients talk over real TCP sockets (in-process nodes, and real kvcr-guard daemons for
revocation); integration layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcr_core.peers import FetchStatus, InventoryReader, PeerClient, PeerServer
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.connection import PeerRefused
from kvcr_core.peers.origins import OriginRegistry
from kvcr_core.testing import pattern_block, peer_node, random_keys
from kvcr_core.testing.fleet import TestFleet, forge_origin
from kvcr_core.types import NamespaceDigest

pytest.importorskip("cryptography", reason="fleet identities need the cryptography package")
pytestmark = pytest.mark.integration

BLOCK = 8192
NS = NamespaceDigest(b"fleet-test-ns-16")
NAMES = ("node-a", "node-v", "node-t", "node-x")


@pytest.fixture
def fleet(tmp_path: Path) -> TestFleet:
    return TestFleet(tmp_path, (*NAMES, "router-r"))


@pytest.fixture
def nodes(fleet: TestFleet) -> Iterator[dict[str, tuple]]:
    """node -> (runner, store, server, client, registry), all fleet credentials."""
    out = {}
    for name in NAMES:
        cred = fleet.credential(name)
        runner, store, metrics = peer_node(NS, BLOCK)
        origins = OriginRegistry(cred)
        server = PeerServer(runner, cred, metrics, origins=origins)
        client = PeerClient(store, cred, metrics, origins=origins)
        out[name] = (runner, store, server, client, origins)
    yield out
    for runner, _, server, client, _ in out.values():
        client.close()
        server.close()
        runner.close()


def test_blocks_keep_their_origin_through_a_node_that_re_serves_them(nodes) -> None:
    """Risk: a node that fetched blocks serves them on as its own (or unattributed), so an
    origin's revocation or mistake cannot be traced; or honest re-serving breaks."""
    _, store_a, server_a, _, _ = nodes["node-a"]
    keys = random_keys(6, seed=1)
    store_a.store(keys, [pattern_block(k, BLOCK) for k in keys])
    _, _, server_v, client_v, origins_v = nodes["node-v"]
    assert client_v.fetch(server_a.endpoint, keys, 5).statuses == (FetchStatus.OK,) * 6
    assert {origins_v.book(NS).get(k).origin for k in keys} == {"node-a"}
    _, store_t, _, client_t, origins_t = nodes["node-t"]
    assert client_t.fetch(server_v.endpoint, keys, 5).statuses == (FetchStatus.OK,) * 6
    assert {origins_t.book(NS).get(k).origin for k in keys} == {"node-a"}
    assert store_t.load(keys) == [pattern_block(k, BLOCK) for k in keys]


def test_a_node_cannot_pass_its_bytes_off_as_another_nodes(nodes) -> None:
    """Risk: a compromised node serves bytes of its own making tagged as an honest node's,
    and every receiver trusts them as that node's (one shared secret made this trivial)."""
    _, store_x, server_x, _, origins_x = nodes["node-x"]
    keys = random_keys(4, seed=2)
    store_x.store(keys, [bytes([0xEE]) * BLOCK for _ in keys])  # poison under real keys
    forge_origin(origins_x, "node-a")
    _, store_v, _, client_v, _ = nodes["node-v"]
    result = client_v.fetch(server_x.endpoint, keys, 5)
    assert result.statuses == (FetchStatus.UNTRUSTED,) * 4
    assert store_v.lookup(keys) == 0


def test_a_re_serving_node_cannot_change_the_bytes_it_passes_on(nodes) -> None:
    """Risk: the node in the middle alters blocks it fetched (and their checksums) and the
    third node accepts them under the origin's name."""
    _, store_a, server_a, _, _ = nodes["node-a"]
    keys = random_keys(4, seed=3)
    store_a.store(keys, [pattern_block(k, BLOCK) for k in keys])
    _, store_v, server_v, client_v, origins_v = nodes["node-v"]
    assert client_v.fetch(server_a.endpoint, keys, 5).statuses == (FetchStatus.OK,) * 4
    with store_v.lock:
        store_v.index.discard(keys)
    store_v.store(keys, [bytes([0xAB]) * BLOCK for _ in keys])  # new bytes, new checksums
    book = origins_v.book(NS)
    stale = {k: book.get(k) for k in keys}
    original = origins_v.frame_for

    def launder(namespace: bytes):  # a compromised V: A's manifests with its own bytes
        def frame(seq: int, found) -> bytes:
            manifests = list({id(m): m for m in stale.values()}.values())
            return pp.encode(pp.Origins(seq, manifests, [0] * len(found)))
        return frame

    origins_v.frame_for = launder  # type: ignore[method-assign]
    _, store_t, _, client_t, _ = nodes["node-t"]
    assert client_t.fetch(server_v.endpoint, keys, 5).statuses == (FetchStatus.UNTRUSTED,) * 4
    assert store_t.lookup(keys) == 0
    origins_v.frame_for = original  # type: ignore[method-assign]
    # served honestly (on a new connection), the rewritten blocks are V's own, and say so
    spare, _, metrics = peer_node(NS, BLOCK)
    fresh = PeerClient(store_t, client_t.secret, metrics, origins=nodes["node-t"][4])
    assert fresh.fetch(server_v.endpoint, keys, 5).statuses == (FetchStatus.OK,) * 4
    assert {nodes["node-t"][4].book(NS).get(k).origin for k in keys} == {"node-v"}
    fresh.close()
    spare.close()


def test_a_router_key_reads_inventories_and_nothing_else(fleet: TestFleet, nodes) -> None:
    """Risk: every router holds the fleet's one secret, so a compromised router can fetch
    any pool's KV or post hints; a router credential now only reads inventories."""
    _, store_a, server_a, _, _ = nodes["node-a"]
    keys = random_keys(2, seed=4)
    store_a.store(keys, [pattern_block(k, BLOCK) for k in keys])
    router = fleet.credential("router-r")
    reader = InventoryReader(server_a.endpoint, router)
    _, batches = reader.poll()
    assert sum(len(b.stored) for b in batches) == 2
    with pytest.raises((PeerRefused, ConnectionError)):
        reader.post_hint("{}")
    reader.close()
    runner, store, metrics = peer_node(NS, BLOCK)
    thief = PeerClient(store, router, metrics)
    assert thief.fetch(server_a.endpoint, keys, 5).statuses == (FetchStatus.REFUSED,) * 2
    thief.close()
    runner.close()


def _guard(harness, fleet: TestFleet, where: Path, name: str, *flags: str):
    where.mkdir()
    g = harness.Guard(str(where), "--peer-listen", "127.0.0.1:0", "--peer-node-key",
                      fleet.key_file(name), "--peer-fleet", fleet.file, *flags).start()
    kvcr = os.path.join(os.path.dirname(sys.executable), "kvcr")
    status = subprocess.run([kvcr, "status", "--socket", g.socket, "--json"],
                            capture_output=True, text=True, check=True)
    return g, json.loads(status.stdout)["peer_endpoint"]


def _fetched(engine, endpoint: str, keys: list[bytes]) -> list[list[FetchStatus]]:
    """The statuses of one peer fetch the engine asks its Runner for, once it ends."""
    ticket = engine.peer_fetch(endpoint, [keys], deadline_s=5)
    deadline = time.monotonic() + 15
    while not (outcome := engine.peer_poll(ticket)).done:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return outcome.statuses


def test_revoking_a_node_drops_its_blocks_everywhere_and_stops_fetching_from_it(
        fleet: TestFleet, short_tmp: str, harness) -> None:
    """Risk: a node found serving bad KV stays trusted: its blocks keep being loaded by
    every runner that fetched them, and runners keep fetching from it."""
    from kvcr_core.attach import AttachClient
    sys.path.insert(0, os.path.dirname(__file__))
    from attach_worker import BLOCK as GBLOCK
    from attach_worker import SPEC, keys_for

    root = Path(short_tmp)
    x, x_endpoint = _guard(harness, fleet, root / "x", "node-x")
    harness.run_worker(x, "store", 7, 6)
    v, _ = _guard(harness, fleet, root / "v", "node-v", "--peer", x_endpoint)
    engine = AttachClient(v.socket, SPEC, GBLOCK, identity="victim-engine")
    keys = keys_for(7, 6)
    assert _fetched(engine, x_endpoint, keys) == [[FetchStatus.OK] * 6]
    assert engine.lookup(keys) == 6
    fleet.write(revoked=("node-x",))
    deadline = time.monotonic() + 10
    while engine.lookup(keys):  # the daemon re-reads the fleet file within a few seconds
        assert time.monotonic() < deadline, "blocks of a revoked node are still served"
        time.sleep(0.1)
    assert "revoked" in v.logs()
    assert _fetched(engine, x_endpoint, keys) == [[FetchStatus.REFUSED] * 6]
    engine.close()
    for g in (x, v):
        assert g.stop() == 0
