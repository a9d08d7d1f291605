"""Trust boundary, peer port: the handshake has one deadline, guesses of the secret are
throttled per source address. Against a real kvcr-guard's peer port; integration layer.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from kvcr_core.framing import recv_frame
from kvcr_core.peers import PeerSecret
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.auth import new_nonce
from kvcr_core.testing import secret_for

sys.path.insert(0, os.path.dirname(__file__))
from test_attach_server_hostile import legit_round, peer_endpoint

pytestmark = pytest.mark.integration
SECRET = secret_for("trust-peer-port")


@pytest.fixture
def peer_guard(short_tmp: str, harness):
    secret = os.path.join(short_tmp, "secret")
    Path(secret).write_text(SECRET)
    g = harness.Guard(short_tmp, "--peer-listen", "127.0.0.1:0", "--peer-secret-file",
                      secret).start()
    host, port = peer_endpoint(g).removeprefix("tcp://").rsplit(":", 1)
    return g, (host, int(port))


def test_a_trickled_handshake_is_closed_by_one_deadline(peer_guard) -> None:
    """Risk: the peer handshake's timeout restarts with every read, so connections that send
    one byte now and then are held forever (16 were still open after 30 s; the docs say 2 s)
    and keep peers that know the secret out."""
    guard, address = peer_guard
    hello = pp.encode(pp.Hello(pp.PEER_PROTOCOL_VERSION, new_nonce()))
    slow = [socket.create_connection(address, timeout=5) for _ in range(12)]
    started = time.monotonic()
    closed_at: dict[int, float] = {}
    for sent in range(len(hello) - 1):  # never the last byte: the Hello never completes
        for n, sock in enumerate(slow):
            if n in closed_at:
                continue
            try:
                sock.sendall(hello[sent:sent + 1])
            except OSError:
                closed_at[n] = time.monotonic() - started
        if len(closed_at) == len(slow) or time.monotonic() - started > 8:
            break
        time.sleep(0.25)
    for sock in slow:
        sock.close()
    assert len(closed_at) == len(slow), "trickling connections outlived the deadline"
    assert max(closed_at.values()) < 6  # 2 s deadline, with room for a slow machine
    assert guard.settled_metric("kvcr_peer_refusals_total", len(slow), reason="timeout") >= 1
    legit_round(guard.socket)


def _guess(address: tuple[str, int], n: int) -> str:
    """One wrong guess of the secret: "refused" (heard and refused), or "closed" (closed
    before the handshake)."""
    sock = socket.create_connection(address, timeout=5)
    try:
        nonce = new_nonce()
        sock.sendall(pp.encode(pp.Hello(pp.PEER_PROTOCOL_VERSION, nonce)))
        challenge = pp.decode_to_client(recv_frame(sock)[0])
        assert isinstance(challenge, pp.Challenge)
        wrong = PeerSecret(secret_for(f"guess {n}").encode())
        sock.sendall(pp.encode(pp.Auth(wrong.prove(b"client", nonce, challenge.nonce), "",
                                       b"", 4096)))
        answer = pp.decode_to_client(recv_frame(sock)[0])
        assert isinstance(answer, pp.Refused) and answer.reason is pp.PeerRefusal.AUTH
        return "refused"
    except (ConnectionError, OSError):
        return "closed"
    finally:
        sock.close()


def test_guessing_the_secret_is_throttled_per_source(peer_guard) -> None:
    """Risk: an attacker tries about 1,900 guesses of the secret per second against the
    peer port; now an address that failed 5 times in 10 s is closed unheard."""
    guard, address = peer_guard
    outcomes = [_guess(address, n) for n in range(40)]
    assert outcomes[:5] == ["refused"] * 5
    assert outcomes[5:] == ["closed"] * 35
    assert guard.metric("kvcr_peer_refusals_total", reason="auth") == 5
    assert guard.settled_metric("kvcr_peer_refusals_total", 35, reason="throttled") == 35
    legit_round(guard.socket)
