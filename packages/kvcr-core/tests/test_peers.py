"""Peer transfers: authenticated, checksummed, deadline-bounded, and exact across processes
and network namespaces. The contract tests run over every transport: TCP, NIXL (skipped when
nixl is not installed: pip install 'kvcr-core[nixl]') and the in-process loopback transport
of kvcr_core.testing (its tests across processes skip: it is in-process by design)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvcr_core.config import KVCRConfig
from kvcr_core.peers import (
    FetchStatus,
    NixlTransport,
    PeerClient,
    PeerMetrics,
    PeerSecret,
    PeerServer,
    PeerTLS,
    PeerTransport,
    ReadTransport,
    TransportKind,
)
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.nixl_engine import NixlEngine, nixl_installed
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.testing import (
    FakePeerSource,
    LoopbackTransport,
    network_namespaces,
    pattern_block,
    peer_node,
    random_keys,
    secret_for,
)
from kvcr_core.types import NamespaceDigest

pytestmark = pytest.mark.integration

SECRET = PeerSecret(secret_for("correct horse battery staple, 2026 edition").encode())
NS = NamespaceDigest(b"peer-test-ns-v1!")
BLOCK = 16384
NODE = str(Path(__file__).with_name("peer_node.py"))
NODE_SECRET = secret_for("two-process-test-secret-0123456789")
NO_NIXL = "nixl is not installed (pip install 'kvcr-core[nixl]')"


class Wire:
    """One transport under test: its kind, and the servers, clients and fake sources that use
    it (one transport object per test, shared by both ends: the loopback needs that)."""

    def __init__(self, kind: TransportKind) -> None:
        self.kind = kind
        self.transport: PeerTransport | None = None
        if kind is TransportKind.NIXL:
            engine = NixlEngine.shared()
            assert engine.wait_ready(120), f"nixl is installed but did not start: {engine.failure}"
            self.transport = NixlTransport(engine)
        elif kind is TransportKind.LOOPBACK:
            self.transport = LoopbackTransport()

    @property
    def value(self) -> str:
        return self.kind.value

    def server(self, runner: Runner, metrics: PeerMetrics,
               secret: PeerSecret = SECRET) -> PeerServer:
        return PeerServer(runner, secret, metrics,
                          transports=[self.transport] if self.transport else [])

    def client(self, store: NamespaceStore, metrics: PeerMetrics, secret: PeerSecret = SECRET,
               **kwargs: object) -> PeerClient:
        return PeerClient(store, secret, metrics, transport=self.transport,
                          **kwargs)  # type: ignore[arg-type]

    def fake(self, behaviour: str) -> FakePeerSource:
        reads = self.transport if isinstance(self.transport, ReadTransport) else None
        return FakePeerSource(SECRET, BLOCK, behaviour, reads)

    def across_processes(self) -> None:
        if self.kind is TransportKind.LOOPBACK:
            pytest.skip("the loopback transport is in-process only")


@pytest.fixture(params=["tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_installed(), reason=NO_NIXL)), "loopback"])
def transport(request: pytest.FixtureRequest) -> Wire:
    """The transport a contract test runs over."""
    return Wire(TransportKind(request.param))


node = partial(peer_node, NS, BLOCK)


@pytest.fixture
def source(transport: Wire) -> Iterator[tuple[PeerServer, list[bytes]]]:
    runner, store, metrics = node()
    keys = random_keys(40, seed=1)
    store.store(keys, [pattern_block(k, BLOCK) for k in keys])
    server = transport.server(runner, metrics)
    yield server, keys
    server.close()
    runner.close()


def client(store: NamespaceStore, metrics: PeerMetrics, transport: Wire,
           **kwargs: object) -> PeerClient:
    return transport.client(store, metrics, **kwargs)


def test_fetch_is_byte_exact_and_reports_per_key(source, transport) -> None:
    """Held keys arrive exactly and become READY; absent ones are MISSING; local ones PRESENT."""
    server, keys = source
    _, store, metrics = node()
    store.store(keys[:2], [pattern_block(k, BLOCK) for k in keys[:2]])
    wanted = [*keys[:10], *random_keys(2, seed=77)]
    peer = client(store, metrics, transport)
    result = peer.fetch(server.endpoint, wanted, deadline_s=10)
    assert result.transport is transport.kind
    assert result.statuses[:2] == (FetchStatus.PRESENT,) * 2
    assert result.statuses[2:10] == (FetchStatus.OK,) * 8
    assert result.statuses[10:] == (FetchStatus.MISSING,) * 2
    assert result.ready_prefix() == 10 and result.received_bytes == 8 * BLOCK
    assert store.load(keys[:10]) == [pattern_block(k, BLOCK) for k in keys[:10]]
    assert store.lookup(wanted) == 10 and store.index.filling_blocks == 0
    assert metrics.fetched["ok"] == 8 and metrics.fetched["missing"] == 2
    again = peer.fetch(server.endpoint, keys[10:20], deadline_s=10)  # a pooled connection
    assert again.statuses == (FetchStatus.OK,) * 10 and again.transport is transport.kind
    assert server.metrics.connections[transport.value] == 1
    peer.close()


def test_keys_stored_or_out_of_room_while_asked_are_skipped_in_step(
        source, transport, monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: the Fetch goes out before slots are reserved (so the peer looks keys up while we
    reserve); a key stored here in between, or one the pool has no room for, is overwritten,
    published twice, or leaves the connection out of step with the peer's stream."""
    server, keys = source
    _, store, metrics = node(blocks=4)
    room = store.index.capacity_slots  # 12
    mine = bytes([7]) * BLOCK
    reserve = store.reserve

    def stored_meanwhile(asked: Sequence[bytes], *args: object) -> object:
        if len(asked) == room:  # the fetch's (store() below reserves too)
            store.store([asked[1]], [mine])  # another fetch or the engine got there first
        return reserve(asked, *args)  # type: ignore[arg-type]

    peer = client(store, metrics, transport)
    with monkeypatch.context() as patch:
        patch.setattr(store, "reserve", stored_meanwhile)
        result = peer.fetch(server.endpoint, keys[:room], deadline_s=10)
    assert result.transport is transport.kind
    assert result.statuses[1] is FetchStatus.PRESENT and store.load([keys[1]]) == [mine]
    fetched = [0, *range(2, room)]
    assert [result.statuses[i] for i in fetched] == [FetchStatus.OK] * len(fetched)
    assert store.load([keys[i] for i in fetched]) == [pattern_block(keys[i], BLOCK)
                                                       for i in fetched]
    assert result.received_bytes == len(fetched) * BLOCK and store.index.filling_blocks == 0

    store.clear()
    held = random_keys(room, seed=78)
    store.store(held, [mine] * room)
    lease = store.acquire(held)  # every slot in use: no room for what the peer holds
    full = peer.fetch(server.endpoint, keys[20:23], deadline_s=10)
    assert full.statuses == (FetchStatus.CAPACITY,) * 3 and full.received_bytes == 0
    store.release(lease.op)
    again = peer.fetch(server.endpoint, keys[20:24], deadline_s=10)  # the same connection
    assert again.statuses == (FetchStatus.OK,) * 4
    assert store.load(keys[20:24]) == [pattern_block(k, BLOCK) for k in keys[20:24]]
    assert server.metrics.connections[transport.value] == 1
    peer.close()


@pytest.mark.parametrize("client_secret,server_secret", [
    (secret_for("the wrong secret").encode(), SECRET),
    (SECRET, secret_for("a server that does not know it").encode()),
])
def test_wrong_secret_is_refused_both_ways(client_secret, server_secret, transport) -> None:
    """A peer without the shared secret gets nothing and serves nothing."""
    c_secret = client_secret if isinstance(client_secret, PeerSecret) else PeerSecret(client_secret)
    s_secret = server_secret if isinstance(server_secret, PeerSecret) else PeerSecret(server_secret)
    runner, store, metrics = node()
    keys = random_keys(3, seed=2)
    store.store(keys, [pattern_block(k, BLOCK) for k in keys])
    server = transport.server(runner, metrics, s_secret)
    _, dest, dmetrics = node()
    result = transport.client(dest, dmetrics, c_secret).fetch(server.endpoint, keys,
                                                               deadline_s=5)
    assert set(result.statuses) == {FetchStatus.REFUSED} and "auth" in result.detail
    assert dest.lookup(keys) == 0 and dest.index.free_slots == dest.index.capacity_slots
    server.close()


def test_other_namespace_is_refused(source, transport) -> None:
    """A destination of another namespace (model, layout, TP rank...) is refused."""
    server, keys = source
    registry = CollectorRegistry()
    runner = Runner(KVCRConfig(pool_bytes=64 * BLOCK), registry=registry)
    other = runner.open_namespace(NamespaceDigest(b"another-namespc!"), BLOCK)
    result = client(other, PeerMetrics(registry), transport).fetch(server.endpoint, keys,
                                                                    deadline_s=5)
    assert set(result.statuses) == {FetchStatus.REFUSED} and "namespace" in result.detail
    assert server.metrics.refused["namespace"] == 1


@pytest.fixture
def fake(transport: Wire) -> Iterator[Callable[[str], FakePeerSource]]:
    made: list[FakePeerSource] = []

    def make(behaviour: str) -> FakePeerSource:
        made.append(transport.fake(behaviour))
        return made[-1]

    yield make
    for one in made:
        one.close()


def test_wrong_bytes_fail_the_checksum_and_are_never_published(fake, transport) -> None:
    """A block whose bytes do not match its checksum is dropped and counted; others land."""
    source = fake("wrong_bytes")
    _, store, metrics = node()
    keys = random_keys(3, seed=3)
    result = client(store, metrics, transport).fetch(source.endpoint, keys, deadline_s=10)
    assert result.statuses == (FetchStatus.OK, FetchStatus.CHECKSUM, FetchStatus.OK)
    assert result.transport is transport.kind
    assert store.contains(keys) == [True, False, True]
    assert metrics.fetched["checksum"] == 1 and store.index.filling_blocks == 0


def test_silent_peer_costs_at_most_the_deadline(fake, transport) -> None:
    """A peer that stops mid-transfer: the fetch ends by its deadline, half blocks dropped."""
    source = fake("stall")
    _, store, metrics = node()
    keys = random_keys(4, seed=4)
    start = time.monotonic()
    result = client(store, metrics, transport).fetch(source.endpoint, keys, deadline_s=1.0)
    assert time.monotonic() - start < 2.0
    # TCP: the first block came whole before the silence; NIXL: nothing was offered yet
    arrived = 1 if transport.kind is TransportKind.TCP else 0
    assert result.statuses == (FetchStatus.OK,) * arrived + (FetchStatus.TIMEOUT,) * (4 - arrived)
    assert store.contains(keys) == [True] * arrived + [False] * (4 - arrived)
    assert store.index.filling_blocks == 0


def test_peer_killed_mid_transfer_fails_the_rest(fake, transport) -> None:
    """A peer that dies mid-fetch: per-key failures, nothing half-written becomes READY."""
    source = fake("die")
    _, store, metrics = node()
    keys = random_keys(3, seed=5)
    result = client(store, metrics, transport).fetch(source.endpoint, keys, deadline_s=5)
    arrived = 1 if transport.kind is TransportKind.TCP else 0
    assert result.statuses == ((FetchStatus.OK,) * arrived
                               + (FetchStatus.UNREACHABLE,) * (3 - arrived))
    assert store.contains(keys) == [True] * arrived + [False] * (3 - arrived)
    assert store.index.filling_blocks == 0


def test_async_fetch_cancel_and_bounded_concurrency(fake, transport) -> None:
    """fetch_async returns a handle; cancel ends it; past the bound it refuses at once."""
    source = fake("stall")
    _, store, metrics = node()
    peer = client(store, metrics, transport, max_concurrent=1)
    keys = random_keys(4, seed=6)
    handle = peer.fetch_async(source.endpoint, keys, deadline_s=3)
    assert handle.poll() is None
    refused = peer.fetch_async(source.endpoint, random_keys(2, seed=7), deadline_s=3)
    assert refused.poll() is not None
    assert set(refused.result().statuses) == {FetchStatus.CAPACITY}
    handle.cancel()
    source.release.set()
    result = handle.result(timeout=5)
    assert FetchStatus.CANCELLED in result.statuses
    assert set(result.statuses) <= {FetchStatus.OK, FetchStatus.CANCELLED}
    assert store.index.filling_blocks == 0
    peer.close()


def test_unreachable_peer_fails_fast(transport) -> None:
    """Nobody listening: UNREACHABLE at once, reservations returned."""
    _, store, metrics = node()
    port = socket.create_server(("127.0.0.1", 0))
    dead = f"tcp://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    result = client(store, metrics, transport).fetch(dead, random_keys(2), deadline_s=5)
    assert set(result.statuses) == {FetchStatus.UNREACHABLE}
    assert store.index.free_slots == store.index.capacity_slots


def run_node(*args: str, prefix: list[str] | None = None,
             env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([*(prefix or []), sys.executable, NODE, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def test_two_processes_transfer_1000_blocks_exactly(transport) -> None:
    """Across real processes over loopback: 1,000 blocks, every byte checked, over the
    transport both sides have."""
    transport.across_processes()
    server = run_node("serve", NODE_SECRET, "127.0.0.1", "1000", str(BLOCK), transport.value)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line, server.stderr.read() if server.stderr else ""
        endpoint = json.loads(line)["endpoint"]
        out = subprocess.run([sys.executable, NODE, "fetch", NODE_SECRET, endpoint, "1000",
                              str(BLOCK), transport.value], capture_output=True, text=True,
                             timeout=180, check=True)
        report = json.loads(out.stdout)
        assert report == {**report, "fetched": 1000, "ready": 1000, "corrupt": 0,
                          "transports": [transport.value]}
    finally:
        server.kill()
        server.wait()


@pytest.fixture
def netns_pair(transport: Wire) -> Iterator[tuple[str, str, str]]:
    """Two network namespaces joined by a veth pair, made and removed here: names and subnet
    per transport, since parallel test workers may run both at once."""
    transport.across_processes()
    tag, subnet = {TransportKind.TCP: ("pt", 7), TransportKind.NIXL: ("pn", 8)}[transport.kind]
    with network_namespaces(tag, subnet) as pair:
        if pair is None:
            pytest.skip("network namespaces need root and iproute2")
        yield pair


@pytest.mark.slow
def test_two_network_namespaces_transfer_1000_blocks_exactly(netns_pair, transport) -> None:
    """Two runners on two hosts (network namespaces): 1,000 blocks arrive byte-exactly (NIXL
    forced onto the veth with UCX_TLS=tcp, as between hosts)."""
    a, b, address = netns_pair
    ucx = transport.kind is TransportKind.NIXL
    server = run_node("serve", NODE_SECRET, address, "1000", str(BLOCK), transport.value,
                      prefix=["ip", "netns", "exec", a],
                      env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "kvcrpnva"} if ucx else None)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line, server.stderr.read() if server.stderr else ""
        endpoint = json.loads(line)["endpoint"]
        assert endpoint.startswith(f"tcp://{address}:")
        out = subprocess.run(["ip", "netns", "exec", b, sys.executable, NODE, "fetch", NODE_SECRET,
                              endpoint, "1000", str(BLOCK), transport.value],
                             capture_output=True, text=True, timeout=180, check=True,
                             env={**os.environ, **({"UCX_TLS": "tcp",
                                                    "UCX_NET_DEVICES": "kvcrpnvb"} if ucx
                                                   else {})})
        report = json.loads(out.stdout)
        assert report["fetched"] == 1000 and report["ready"] == 1000 and report["corrupt"] == 0
        assert report["transports"] == [transport.value]
    finally:
        server.kill()
        server.wait()


def make_tls(directory: Path) -> PeerTLS:
    """A throwaway CA and a node certificate for 127.0.0.1 (openssl CLI)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                       timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj",
        "/CN=kvcr-test-ca")
    run("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "node.pem", "-days", "1", "-extfile", "san.ext")
    return PeerTLS(str(directory / "node.pem"), str(directory / "node.key"),
                   str(directory / "ca.pem"))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_peers_transfer_and_plain_clients_are_turned_away(tmp_path: Path) -> None:
    """With TLS on, blocks travel encrypted and mutually authenticated; a client without TLS
    gets nothing."""
    tls = make_tls(tmp_path)
    runner, store, metrics = node()
    keys = random_keys(5, seed=9)
    store.store(keys, [pattern_block(k, BLOCK) for k in keys])
    server = PeerServer(runner, SECRET, metrics, tls=tls, nixl=True)
    _, dest, dmetrics = node()
    result = PeerClient(dest, SECRET, dmetrics, tls=tls, nixl=True).fetch(server.endpoint, keys,
                                                                          10)
    assert result.statuses == (FetchStatus.OK,) * 5
    assert result.transport is TransportKind.TCP  # NIXL would carry the bytes outside TLS
    assert dest.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    _, plain, pmetrics = node()
    bad = PeerClient(plain, SECRET, pmetrics, nixl=False).fetch(server.endpoint, keys,
                                                                 deadline_s=3)
    assert FetchStatus.OK not in bad.statuses and plain.lookup(keys) == 0
    server.close()


def test_checksums_are_fixed_at_commit_and_follow_slot_rewrites() -> None:
    """A block's checksum is the one its writer fixed at commit: bytes changed in the pool
    after it do not change it (a peer then catches them), a slot written again under another
    key, or the same key, gets its new commit's checksum, and nothing is hashed at serve."""
    _, store, _ = node(blocks=1)
    capacity = store.index.capacity_slots
    keys = random_keys(capacity + 1, seed=10)
    store.store(keys[:capacity], [pattern_block(k, BLOCK) for k in keys[:capacity]])
    sums = store.checksums
    slot = store.index.slot_of(keys[0])
    assert slot is not None
    good = pp.checksum(pattern_block(keys[0], BLOCK))
    store.pool.view(slot)[:8] = b"scribble"  # after the commit, behind the index's back
    assert sums.of(slot) == sums.known([slot])[0] == good and sums.computed == 0
    with store.lock:
        store.index.discard([keys[0]])
    store.store([keys[capacity]], [pattern_block(keys[capacity], BLOCK)])  # same slot, new key
    assert store.index.slot_of(keys[capacity]) == slot
    assert sums.of(slot) == pp.checksum(pattern_block(keys[capacity], BLOCK))
    with store.lock:
        store.index.discard([keys[capacity]])
    res = store.reserve([keys[capacity]])  # same key, same slot, other bytes, writer's sum
    assert res.slots == (slot,)
    with pytest.raises(ValueError, match="checksums"):
        store.commit(res.op, checksums=[1, 2])  # one per reserved block, or nothing changes
    store.pool.view(slot)[:] = bytes(BLOCK)
    assert store.commit(res.op, checksums=[pp.checksum(bytes(BLOCK))]) == 1
    assert sums.of(slot) == pp.checksum(bytes(BLOCK)) and sums.computed == 0
    others = [store.index.slot_of(k) for k in keys[1:capacity]]
    assert None not in others
    assert sums.known([slot, *others]) == [sums.of(s) for s in [slot, *others]]


def test_a_source_serves_warm_blocks_without_hashing_them_again(transport) -> None:
    """A source serves the checksums its blocks' writers fixed at commit: no fetch, first or
    later, nor one after the blocks were stored again, hashes anything at the source."""
    runner, store, metrics = node()
    keys = random_keys(6, seed=11)
    store.store(keys, [pattern_block(k, BLOCK) for k in keys])
    server = transport.server(runner, metrics)
    _, dest, dmetrics = node()
    peer = client(dest, dmetrics, transport)
    for _ in range(2):
        assert peer.fetch(server.endpoint, keys, deadline_s=10).fetched == 6
        with dest.lock:
            dest.index.discard(keys)
    assert store.checksums.computed == 0  # served as their writer fixed them
    deadline = time.monotonic() + 5
    while store.index.leased_slots and time.monotonic() < deadline:  # the server releases
        time.sleep(0.01)                                                # after its last send
    with store.lock:
        assert store.index.discard(keys) == 6
    store.store(keys, [pattern_block(k, BLOCK) for k in keys])
    assert peer.fetch(server.endpoint, keys, deadline_s=10).fetched == 6
    assert store.checksums.computed == 0
    peer.close()
    server.close()
