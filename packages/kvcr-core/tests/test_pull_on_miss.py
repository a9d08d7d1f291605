"""Pull on miss between real Runners: two embedded runners serve peers on loopback and follow
each other's inventory (no router, no hint); what one stores, the other finds and fetches.
The engines' side of it (vLLM, SGLang) is tested in their packages."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest

from kvcr_core.attach import (
    AttachClient,
    EmbeddedRunner,
    EngineSettings,
    HintedFetcher,
    HintedRun,
    Skipped,
)
from kvcr_core.keys import NamespaceSpec, block_keys, router_hash_kvcr_v1
from kvcr_core.peers import FetchStatus
from kvcr_core.testing import pattern_block, secret_for
from kvcr_core.testing.ports import free_port

pytestmark = pytest.mark.unit

SECRET = secret_for("pull-on-miss-test-secret-0123456789abcdef")
BLOCK = 8192
SPEC = NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32", block_size_tokens=4,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/pull")


def runner(name: str, port: int, peer_port: int, **extra: object) -> EmbeddedRunner:
    fields = EngineSettings.fields_from(
        {"peer_listen": f"127.0.0.1:{port}", "peers": [f"tcp://127.0.0.1:{peer_port}"],
         "peer_secret_env": "TEST_PULL_SECRET", "pool_bytes": 256 * BLOCK, **extra},
        field="cfg", default_socket=f"\0kvcr-pull-{name}-{os.getpid()}")
    return EmbeddedRunner(EngineSettings(**fields))


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[EmbeddedRunner, EmbeddedRunner]]:
    monkeypatch.setenv("TEST_PULL_SECRET", SECRET)
    port_a, port_b = free_port(), free_port()
    a = runner("a", port_a, port_b)
    b = runner("b", port_b, port_a)
    yield a, b
    a.stop()
    b.stop()


def eventually(check: Callable[[], object], timeout_s: float = 10.0) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := check()):
            return value
        time.sleep(0.02)
    raise AssertionError("not within the time")


def test_a_runner_finds_and_fetches_what_its_peer_stored_without_any_hint(
        pair: tuple[EmbeddedRunner, EmbeddedRunner]) -> None:
    """Risk: without a router, blocks never cross nodes (the follower does not learn the
    peer's blocks, names the wrong peer, or the fetch lands the wrong bytes)."""
    a, b = pair
    writer = AttachClient(a.socket_path, SPEC, BLOCK, identity="engine-a")
    reader = AttachClient(b.socket_path, SPEC, BLOCK, identity="engine-b")
    keys = list(block_keys(SPEC.digest(), list(range(48)), 4))
    assert writer.store(keys[:10], [pattern_block(k, BLOCK) for k in keys[:10]]) == 10
    assert reader.lookup(keys) == 0
    found = eventually(lambda: reader.remote_run(keys))
    assert found == (a.peer_endpoint, 10)
    fetcher = HintedFetcher(reader, frozenset({a.peer_endpoint}), 5.0)
    fetch = fetcher.start([keys], HintedRun(a.peer_endpoint, 0, 10))
    assert not isinstance(fetch, Skipped)
    assert fetch.wait().fetched == 10
    assert reader.load(keys) == [pattern_block(k, BLOCK) for k in keys[:10]]
    assert eventually(lambda: writer.remote_run(keys)) == (b.peer_endpoint, 10)  # both ways
    writer.close()
    reader.close()


def test_a_block_gone_at_the_source_is_a_miss_and_a_lost_peer_is_forgotten(
        pair: tuple[EmbeddedRunner, EmbeddedRunner]) -> None:
    """Risk: a block evicted at the source between its inventory and the fetch fails the
    request (it must only be a miss), or a dead peer keeps being named (every request then
    waits for a fetch that cannot succeed)."""
    a, b = pair
    writer = AttachClient(a.socket_path, SPEC, BLOCK, identity="engine-a")
    reader = AttachClient(b.socket_path, SPEC, BLOCK, identity="engine-b")
    keys = list(block_keys(SPEC.digest(), list(range(400, 432)), 4))
    writer.store(keys, [pattern_block(k, BLOCK) for k in keys])
    endpoint, n = eventually(lambda: reader.remote_run(keys))  # type: ignore[misc]
    assert writer.clear() == 8  # gone at the source after the directory named it
    fetch = HintedFetcher(reader, frozenset({endpoint}), 5.0).start(
        [keys], HintedRun(endpoint, 0, n))
    assert not isinstance(fetch, Skipped)
    summary = fetch.wait()
    assert summary.fetched == 0 and set(summary.statuses[0]) == {FetchStatus.MISSING}
    assert reader.lookup(keys) == 0
    writer.store(keys, [pattern_block(k, BLOCK) for k in keys])
    eventually(lambda: reader.remote_run(keys))
    writer.close()
    a.stop()
    eventually(lambda: reader.remote_run(keys) is None)  # forgotten once its feed failed
    reader.close()


def test_short_runs_are_not_offered_and_pull_on_miss_can_be_turned_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a fetch costlier than recomputing its few blocks is made anyway; or a Runner
    told not to pull still follows its peers."""
    monkeypatch.setenv("TEST_PULL_SECRET", SECRET)
    port_a, port_b, port_c = free_port(), free_port(), free_port()
    a = runner("a2", port_a, port_b)
    b = runner("b2", port_b, port_a, pull_min_blocks=4)
    c = runner("c2", port_c, port_a, pull_on_miss=False)
    writer = AttachClient(a.socket_path, SPEC, BLOCK, identity="engine-a")
    keys = list(block_keys(SPEC.digest(), list(range(800, 820)), 4))
    try:
        writer.store(keys[:3], [pattern_block(k, BLOCK) for k in keys[:3]])
        hashes = [router_hash_kvcr_v1(k) for k in keys]
        followed = b.server.host.peers.directory
        assert followed is not None  # b follows a: wait until it saw the 3 blocks
        assert eventually(lambda: followed.run(SPEC.digest(), hashes, 1)) == (a.peer_endpoint, 3)
        for embedded in (b, c):
            client = AttachClient(embedded.socket_path, SPEC, BLOCK)
            assert client.remote_run(keys) is None
            client.close()
        writer.store(keys[3:5], [pattern_block(k, BLOCK) for k in keys[3:5]])
        client = AttachClient(b.socket_path, SPEC, BLOCK)
        assert eventually(lambda: client.remote_run(keys)) == (a.peer_endpoint, 5)
        client.close()
        assert c.server.host.peers.directory is None
    finally:
        writer.close()
        for embedded in (a, b, c):
            embedded.stop()
