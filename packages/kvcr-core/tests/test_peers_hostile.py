"""The peer port against connections that do not know the secret (or do not try): they cost a
bounded amount before authentication, learn nothing to guess the secret with offline, and
never keep peers or routers that know it out. Real PeerServer, real sockets."""

from __future__ import annotations

import base64
import random
import socket
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from kvcr_core.config import KVCRConfig
from kvcr_core.errors import ConfigError
from kvcr_core.framing import recv_frame
from kvcr_core.peers import (
    FetchStatus,
    InventoryReader,
    PeerClient,
    PeerMetrics,
    PeerSecret,
    PeerServer,
)
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.auth import new_nonce, weakness
from kvcr_core.runner import Runner
from kvcr_core.testing import pattern_block, random_keys, secret_for
from kvcr_core.types import NamespaceDigest

pytestmark = pytest.mark.unit

SECRET = PeerSecret(secret_for("peer-port-hostile-test-secret-0123456789").encode())
NS = NamespaceDigest(b"hostile-peer-ns!")
BLOCK = 4096


@pytest.fixture
def source() -> Iterator[tuple[PeerServer, list[bytes]]]:
    registry = CollectorRegistry()
    runner = Runner(KVCRConfig(pool_bytes=64 * BLOCK), registry=registry)
    keys = random_keys(8, seed=1)
    runner.open_namespace(NS, BLOCK).store(keys, [pattern_block(k, BLOCK) for k in keys])
    server = PeerServer(runner, SECRET, PeerMetrics(registry), max_pending=8,
                        handshake_timeout_s=0.5)
    yield server, keys
    server.close()
    runner.close()


def fetches_fine(server: PeerServer, keys: list[bytes]) -> None:
    registry = CollectorRegistry()
    dest = Runner(KVCRConfig(pool_bytes=64 * BLOCK), registry=registry)
    store = dest.open_namespace(NS, BLOCK)
    client = PeerClient(store, SECRET, PeerMetrics(registry))
    started = time.monotonic()
    result = client.fetch(server.endpoint, keys, deadline_s=5)
    assert result.statuses == (FetchStatus.OK,) * len(keys), result.detail
    assert time.monotonic() - started < 2.0
    assert store.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    client.close()
    dest.close()


def connect(server: PeerServer) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=5)


def test_idle_connections_never_keep_peers_or_routers_out(source) -> None:
    """Risk: 64 connections that never authenticate made every authenticated fetch `busy`
    and cut the router's inventory feed (same port)."""
    server, keys = source
    idle = [connect(server) for _ in range(64)]
    fetches_fine(server, keys)
    reader = InventoryReader(server.endpoint, SECRET)
    reset, batches = reader.poll()
    assert not reset and sum(len(b.stored) for b in batches) == 8
    reader.close()
    gone = 0
    for sock in idle:  # each is closed by its handshake deadline: wait for that, no longer
        sock.settimeout(10)
        try:
            gone += sock.recv(1) == b""
        except OSError:
            gone += 1
        sock.close()
    assert gone == 64
    assert server.metrics.refused["busy"] >= 64 - 8


def test_before_authentication_a_frame_is_small_and_the_secret_is_never_tested(source) -> None:
    """Risk: an unauthenticated connection makes the source allocate a 1 MiB frame, or gets
    a MAC of the secret it can test guesses against offline (`passwordpassword` fell in 4
    guesses): now the source proves itself only to a client that proved itself first."""
    server, _ = source
    big = connect(server)
    big.sendall((1 << 20).to_bytes(4, "little"))
    reply = pp.decode_to_client(recv_frame(big)[0])
    assert isinstance(reply, pp.Refused) and reply.reason is pp.PeerRefusal.MALFORMED
    big.close()

    guesser = connect(server)
    nonce = new_nonce()
    guesser.sendall(pp.encode(pp.Hello(pp.PEER_PROTOCOL_VERSION, nonce)))
    challenge_frame = recv_frame(guesser)[0]
    challenge = pp.decode_to_client(challenge_frame)
    assert isinstance(challenge, pp.Challenge)
    wrong = PeerSecret(secret_for("a-guess-of-the-secret-0123456789abc").encode())
    guesser.sendall(pp.encode(pp.Auth(wrong.prove(b"client", nonce, challenge.nonce), "", NS,
                                      BLOCK)))
    answer = bytes(recv_frame(guesser)[0])
    assert isinstance(pp.decode_to_client(answer), pp.Refused)
    proof = SECRET.prove(b"server", challenge.nonce, nonce)
    assert proof not in bytes(challenge_frame) + answer  # nothing to test guesses against
    guesser.close()
    assert server.metrics.refused["auth"] == 1


@pytest.mark.parametrize("text", [b"passwordpassword" * 2, b"short", b"a" * 64,
                                  b"abcabcabcabcabcabcabcabcabcabcabc",
                                  b"kvcr-peer-secret-production-2024",
                                  b"correct horse battery staple, 2026 edition",
                                  b"CorrectHorseBatteryStaple2026Edition!!",
                                  b"kvcr-fleet-secret-0123456789-abcdefghij"])
def test_weak_secrets_are_refused_with_what_to_do(text: bytes) -> None:
    """Risk: a guessable secret protects the whole pool."""
    with pytest.raises(ConfigError, match="kvcr secret generate"):
        PeerSecret(text)


def test_random_secrets_always_pass_the_strength_estimate() -> None:
    """Risk: the entropy estimate refuses what `openssl rand` or `kvcr secret generate`
    made (base64, base64url or hex of 32 random bytes), so operators cannot start."""
    rng = random.Random(36)
    for _ in range(3000):
        raw = rng.randbytes(32)
        for text in (base64.b64encode(raw), base64.urlsafe_b64encode(raw).rstrip(b"="),
                     raw.hex().encode()):
            assert weakness(text) is None, text


def test_the_file_and_environment_forms_of_one_secret_agree(tmp_path, monkeypatch) -> None:
    """Risk: one Kubernetes Secret delivered as a file (with its trailing newline) and as an
    environment variable gave two different keys, and the peers could not authenticate."""
    value = secret_for("one-kubernetes-secret-both-ways-0123456789")
    path = tmp_path / "secret"
    path.write_text(f"  {value}\n")
    monkeypatch.setenv("TEST_PEER_SECRET_BOTH_WAYS", f"{value}\n")
    from_file, from_env = PeerSecret.from_file(str(path)), PeerSecret.from_env(
        "TEST_PEER_SECRET_BOTH_WAYS")
    nonce_a, nonce_b = new_nonce(), new_nonce()
    assert from_file.prove(b"client", nonce_a, nonce_b) == from_env.prove(b"client", nonce_a,
                                                                          nonce_b)
