"""A kvcr-guard serves its pool to authenticated peers, and keeps serving while the engine
that filled it is dead (the daemon owns the memory; there is nothing to promote)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
from prometheus_client import CollectorRegistry

from kvcr_core.config import KVCRConfig
from kvcr_core.keys import NamespaceSpec, sequence_keys
from kvcr_core.peers import FetchStatus, PeerClient, PeerMetrics, PeerSecret
from kvcr_core.runner import Runner
from kvcr_core.testing import pattern_block, secret_for

pytestmark = pytest.mark.integration

BLOCK = 16384
SPEC = NamespaceSpec(model_id="tiny", dtype="float32", kv_dtype="float32", block_size_tokens=16,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/guard")
SECRET = secret_for("guard-peer-secret-for-tests-0123").encode()


def test_peers_fetch_from_a_guard_whose_engine_was_killed(short_tmp, harness) -> None:
    """Engine stores through the guard, is SIGKILLed; a peer node then fetches every block
    from the guard's peer endpoint byte-exactly."""
    secret_file = os.path.join(short_tmp, "peer.secret")
    with open(secret_file, "wb") as f:
        f.write(SECRET)
    guard = harness.Guard(short_tmp, "--peer-listen", "127.0.0.1:0", "--peer-secret-file",
                          secret_file).start()
    engine = harness.start_worker(guard, "store-hang", 21, 12)
    assert engine.stdout is not None
    assert json.loads(engine.stdout.readline()) == {"stored": 12}
    engine.send_signal(signal.SIGKILL)
    engine.wait(timeout=10)
    kvcr = os.path.join(os.path.dirname(sys.executable), "kvcr")
    status = json.loads(subprocess.run([kvcr, "status", "--socket", guard.socket, "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    endpoint = status["peer_endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:")
    registry = CollectorRegistry()
    with Runner(KVCRConfig(pool_bytes=64 * BLOCK), registry=registry) as node:
        store = node.open_namespace(SPEC, BLOCK)
        keys = sequence_keys(SPEC, [21 * 100_000 + t for t in range(16 * 12)])
        client = PeerClient(store, PeerSecret(SECRET), PeerMetrics(registry))
        result = client.fetch(endpoint, keys, deadline_s=10)
        assert result.statuses == (FetchStatus.OK,) * 12
        assert store.load(keys) == [pattern_block(k, BLOCK) for k in keys]
        client.close()
    assert guard.settled_metric("kvcr_peer_served_blocks_total", 12) == 12
    assert guard.stop() == 0
    guard.log.close()


def test_peer_listen_without_a_secret_is_a_clear_error(short_tmp) -> None:
    """Serving peers without the shared secret refuses to start, naming the fix."""
    env = {k: v for k, v in os.environ.items() if k != "KVCR_PEER_SECRET"}
    out = subprocess.run([sys.executable, "-m", "kvcr_guard", "--socket",
                          os.path.join(short_tmp, "g.sock"), "--peer-listen", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60, env=env, check=False)
    assert out.returncode == 2 and "KVCR_PEER_SECRET" in out.stderr


def test_a_guard_fetches_from_its_peer_for_its_engines(short_tmp, harness) -> None:
    """Guarded mode: an engine asks its kvcr-guard (by ticket) to fetch from a peer guard;
    the blocks land in the shared pool byte-exactly. Endpoints the daemon does not list as
    peers are refused."""
    import time

    from kvcr_core.attach import AttachClient, RefusalReason, RunnerRefused

    secret_file = os.path.join(short_tmp, "peer.secret")
    with open(secret_file, "wb") as f:
        f.write(SECRET)
    dir_a, dir_b = os.path.join(short_tmp, "a"), os.path.join(short_tmp, "b")
    os.mkdir(dir_a)
    os.mkdir(dir_b)
    source = harness.Guard(dir_a, "--peer-listen", "127.0.0.1:0", "--peer-secret-file",
                           secret_file).start()
    harness.run_worker(source, "store", 31, 9)
    kvcr = os.path.join(os.path.dirname(sys.executable), "kvcr")
    endpoint = json.loads(subprocess.run([kvcr, "status", "--socket", source.socket, "--json"],
                                         capture_output=True, text=True,
                                         check=True).stdout)["peer_endpoint"]
    dest = harness.Guard(dir_b, "--peer", endpoint, "--peer-secret-file", secret_file).start()
    client = AttachClient(dest.socket, SPEC, BLOCK)
    keys = sequence_keys(SPEC, [31 * 100_000 + t for t in range(16 * 9)])
    ticket = client.peer_fetch(endpoint, [keys], deadline_s=10)
    deadline = time.monotonic() + 15
    while not (outcome := client.peer_poll(ticket)).done:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert outcome.statuses == [[FetchStatus.OK] * 9]
    assert client.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    try:
        client.peer_fetch("tcp://127.0.0.1:9", [keys], deadline_s=1)
        raise AssertionError("an unlisted endpoint was dialled")
    except RunnerRefused as exc:
        assert exc.refusal is RefusalReason.PEER_NOT_ALLOWED
    client.close()
    for g in (source, dest):
        assert g.stop() == 0
        g.log.close()


def test_nixl_between_guards_is_opt_in() -> None:
    """Risk: installing nixl silently exposes every guard's pool to peers' NIXL writes."""
    from kvcr_guard.cli import build_parser, config_from_args

    sock = os.path.join(tempfile.mkdtemp(prefix="kn"), "x.sock")
    base = ["--socket", sock, "--peer-listen", "127.0.0.1:0", "--peer-secret-env",
            "TEST_NIXL_PEER_SECRET"]
    os.environ["TEST_NIXL_PEER_SECRET"] = secret_for("nixl-opt-in-test-secret-0123456789")
    try:
        assert not config_from_args(build_parser().parse_args(base)).server.peer.nixl
        assert config_from_args(build_parser().parse_args([*base, "--peer-nixl"])).server.peer.nixl
    finally:
        del os.environ["TEST_NIXL_PEER_SECRET"]
