"""The attach protocol's host side as engines use it: one validation of peer settings for every
source, and an embedded Runner that fetches hinted blocks from its peers by ticket (real Unix
socket, real peer server over TCP) and stops its fetchers before its pool goes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from kvcr_core.attach import (
    AttachClient,
    EmbeddedRunner,
    EngineSettings,
    HintedFetcher,
    Mode,
    PeerConfig,
    ServerConfig,
    Skipped,
    hinted_run,
)
from kvcr_core.config import KVCRConfig
from kvcr_core.errors import ConfigError
from kvcr_core.keys import NamespaceSpec, block_keys
from kvcr_core.peers import PeerMetrics, PeerSecret, PeerServer
from kvcr_core.runner import Runner
from kvcr_core.testing import pattern_block, random_keys, resident_kib, secret_for

pytestmark = pytest.mark.unit

SECRET = secret_for("attach-test-secret-0123456789abcdef")
BLOCK = 8192
SPEC = NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32", block_size_tokens=4,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/v1")


@pytest.mark.parametrize("extra,field", [
    ({"peers": ["http://x:1"]}, "cfg.peers"),
    ({"peers": "tcp://x:1"}, "cfg.peers"),
    ({"peer_listen": "7500"}, "cfg.peer_listen"),
    ({"fetch_deadline_s": 0}, "cfg.fetch_deadline_s"),
    ({"peer_nixl": "yes"}, "cfg.peer_nixl"),
    ({"peer_tls": {"cert": "c"}}, "cfg.peer_tls"),
    ({"mode": "guarded", "socket": "/run/g.sock", "peer_listen": "0.0.0.0:1"},
     "cfg.peer_listen"),
])
def test_bad_peer_settings_name_the_field_whatever_the_source(
        extra: dict, field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a typo'd peer setting passes in one adapter and fails in another (three parsers
    used to disagree); one validation names the engine's own field."""
    monkeypatch.setenv("TEST_ATTACH_PEER_SECRET", SECRET)
    with pytest.raises(ConfigError) as err:
        EngineSettings.fields_from({"peer_secret_env": "TEST_ATTACH_PEER_SECRET", **extra},
                                   field="cfg", default_socket="\0x")
    assert err.value.field == field


def test_peer_settings_are_normalised_and_a_serving_runner_needs_the_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Runner that serves or fetches without a secret is refused at start; an engine in
    guarded mode (the daemon dials) needs none."""
    peer = PeerConfig(peers=frozenset({"tcp://10.0.0.1:7500", "tcp://[::1]:7501"}))
    with pytest.raises(ConfigError, match="secret"):
        ServerConfig(socket_path="\0kvcr-test", peer=peer)
    guarded = EngineSettings.fields_from({"mode": "guarded", "socket": "/run/g.sock",
                                          "peers": ["tcp://10.0.0.1:7500"]},
                                         field="cfg", default_socket="\0x")
    assert guarded["mode"] is Mode.GUARDED and guarded["peer"].secret is None
    assert guarded["peer"].peers == frozenset({"tcp://10.0.0.1:7500"})
    monkeypatch.setenv("TEST_ATTACH_PEER_SECRET", SECRET)
    embedded = EngineSettings.fields_from({"peers": ["tcp://10.0.0.1:7500"],
                                           "peer_secret_env": "TEST_ATTACH_PEER_SECRET"},
                                          field="cfg", default_socket="\0x")
    assert embedded["peer"].secret is not None and embedded["socket"] == "\0x"


def test_a_served_runner_refuses_anonymous_memory_at_start() -> None:
    """Risk: `memory_backing: anonymous` is accepted by kvcr-guard or an embedded runner, which
    then fails every engine's attach (an anonymous pool has no descriptor to hand out) with
    an internal error instead of one clear error at start."""
    with pytest.raises(ConfigError, match="memfd") as err:
        ServerConfig(socket_path="\0kvcr-test", runner=KVCRConfig(memory_backing="anonymous"))
    assert err.value.field == "memory_backing"
    assert ServerConfig(socket_path="\0kvcr-test").runner.memory_backing.value == "memfd"


@pytest.fixture
def source() -> Iterator[tuple[PeerServer, list[bytes]]]:
    """Another node: a Runner holding 8 blocks of SPEC, serving peers on loopback TCP."""
    registry = CollectorRegistry()
    node = Runner(KVCRConfig(pool_bytes=32 * BLOCK), registry=registry)
    keys = list(block_keys(SPEC.digest(), list(range(32)), 4))
    node.open_namespace(SPEC, BLOCK).store(keys, [pattern_block(k, BLOCK) for k in keys])
    server = PeerServer(node, PeerSecret(SECRET.encode()), PeerMetrics(registry))
    yield server, keys
    server.close()
    node.close()


def test_an_embedded_runner_fetches_hinted_blocks_by_ticket_and_stops_its_fetchers(
        source: tuple[PeerServer, list[bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: embedded mode drops its peers (hinted fetches then never happen), or engine
    shutdown leaves the Runner's fetch threads writing into a pool being unmapped."""
    server, keys = source
    monkeypatch.setenv("TEST_ATTACH_PEER_SECRET", SECRET)
    fields = EngineSettings.fields_from(
        {"peers": [server.endpoint], "peer_secret_env": "TEST_ATTACH_PEER_SECRET",
         "pool_bytes": 32 * BLOCK}, field="cfg",
        default_socket=f"\0kvcr-attach-test-{os.getpid()}")
    settings = EngineSettings(**fields)
    embedded = EmbeddedRunner(settings)
    client = AttachClient(embedded.socket_path, SPEC, BLOCK, identity="test")
    try:
        fetcher = HintedFetcher(client, settings.peer.peers, 5.0)
        fetch = fetcher.start([keys], hinted_run(0, [server.endpoint] * 8))
        assert not isinstance(fetch, Skipped)
        summary = fetch.wait()
        assert summary.fetched == 8 and client.lookup(keys) == 8
        assert client.load(keys) == [pattern_block(k, BLOCK) for k in keys]
        peer_clients = list(embedded.server.host.peers.fetchers)
        assert len(peer_clients) == 1
    finally:
        client.close()
        embedded.stop()
    with pytest.raises(RuntimeError):  # its fetch threads are gone with the Runner
        peer_clients[0].fetch_async(server.endpoint, keys[:1], 1.0)


def test_an_engine_attaches_at_start_up_through_a_slow_namespace_open() -> None:
    """Risk: the first request pays the attach (a `--prefault` Runner backs a whole namespace
    pool before its Welcome, seconds for a large pool, longer than an operation's timeout, so
    that request recomputed and counted a fault). At start-up an engine waits for the
    Welcome as long as it needs; a Runner not there yet is no error."""
    import threading
    import time

    from kvcr_core.attach import AttachServer

    socket_path = f"\0kvcr-start-attach-{os.getpid()}"
    early = AttachClient(socket_path, SPEC, BLOCK, identity="early")
    assert early.try_attach(30.0) is False  # nobody there yet
    client = AttachClient(socket_path, SPEC, BLOCK, identity="test", timeout_s=0.02)
    pool = 1 << 30
    server = AttachServer(ServerConfig(socket_path=socket_path, prefault=True,
                                       runner=KVCRConfig(pool_bytes=pool,
                                                         namespace_pool_bytes=pool)))
    server.listen()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        assert client.try_attach(30.0) is True
        # the open outlasted an op timeout
        assert time.monotonic() - start > client.connection.timeout_s
        assert client.connection.timeout_s == 0.02  # operations keep their own timeout
        keys = list(block_keys(SPEC.digest(), list(range(8)), 4))
        assert client.lookup(keys) == 0 and client.attach_count == 1  # no second handshake
        assert early.lookup(keys) == 0  # a failed start-up attempt: the first use attaches
    finally:
        early.close()
        client.close()
        server.request_shutdown()
        thread.join(timeout=10)


def _rss_shmem_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    raise AssertionError("no RssShmem in /proc/self/status")


@pytest.mark.parametrize("backing", ["none", "prefault", "back_ahead"])
def test_an_embedded_runner_backs_its_pool_at_attach_when_asked(backing: str) -> None:
    """Risk: `prefault` or `back_ahead` is accepted but the embedded pool is still faulted
    in by the first saves and peer fetches (first-touch faults on the hot path), or an
    embedded Runner backs pages nobody asked for (back-ahead: more than its margin plus what
    was reserved)."""
    import time

    pool, mib = 64 << 20, 1 << 20
    prefault = backing == "prefault"
    extra = {"pool_bytes": pool, "prefault": prefault,
             **({"back_ahead": "8MiB"} if backing == "back_ahead" else {})}
    fields = EngineSettings.fields_from(
        extra, field="cfg", default_socket=f"\0kvcr-prefault-test-{os.getpid()}-{backing}")
    embedded = EmbeddedRunner(EngineSettings(**fields),
                              runner=KVCRConfig(pool_bytes=pool, namespace_pool_bytes=pool))
    client = AttachClient(embedded.socket_path, SPEC, BLOCK, identity="prefault")
    try:
        before = _rss_shmem_kib()
        client.attach()
        backed = _rss_shmem_kib() - before
        region_kib = client.pool().region.size_bytes // 1024
        if prefault:
            assert backed >= region_kib  # every page, before the Welcome
        elif backing == "none":
            assert backed < region_kib // 8
        else:
            region = client.pool().region
            deadline = time.monotonic() + 10
            while resident_kib(region.address, pool) < 8 * 1024 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            assert resident_kib(region.address, pool) == 8 * 1024  # the margin only
            reservation = client.reserve(random_keys(20 * mib // BLOCK, seed=5))
            top = max(s for s in reservation.slots if s is not None) + 1
            top_kib = top * client.pool().stride_bytes // 1024
            assert resident_kib(region.address, pool) >= top_kib  # before the reply
    finally:
        client.close()
        embedded.stop()


def test_an_event_about_a_closed_connection_never_reaches_its_descriptors_next_owner() -> None:
    """Risk: one select batch holds a client's pidfd event after that client's connection
    closed and a new client's connection took its descriptor number; an event keyed by the
    number would disconnect the new client ("client process exited") for nothing. The loop
    is driven from this thread, so the stale event is handed over exactly."""
    import selectors
    import threading

    from kvcr_core.attach import AttachServer

    # (not "kvcr-...": `kvcr status --embedded` in a parallel test would probe it unserved)
    server = AttachServer(ServerConfig(socket_path=f"\0kvcrtest-stale-{os.getpid()}",
                                       runner=KVCRConfig(pool_bytes=1 << 22,
                                                         namespace_pool_bytes=1 << 22)))
    server.listen()

    def attached(client: AttachClient) -> None:
        done = threading.Thread(target=client.try_attach, args=(10.0,), daemon=True)
        done.start()
        while done.is_alive():
            server._turn()
        assert client.attached

    try:
        first = AttachClient(server.config.socket_path, SPEC, BLOCK, identity="first")
        attached(first)
        (old,) = (c for c in server._conns.values() if c.session.identity == "first")
        assert old.pidfd is not None
        stale = server._sel.get_key(old.pidfd)  # its pidfd's event, as select returns it
        first.close()
        while server._conns.get(old.fd) is old:
            server._turn()  # EOF: closed
        second = AttachClient(server.config.socket_path, SPEC, BLOCK, identity="second")
        attached(second)
        new = server._conns[old.fd]  # the descriptor number was reused
        assert new.session.identity == "second"
        server._dispatch(stale, selectors.EVENT_READ)
        assert server._conns.get(new.fd) is new  # still connected
        second.close()
    finally:
        server.request_shutdown()
        server._shutdown()
