"""Garbage and hostile frames against a real daemon: refused, counted, daemon keeps serving."""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import struct

import msgspec
import pytest

from kvcr_core.attach import AttachClient
from kvcr_core.attach import protocol as p
from kvcr_core.keys import NamespaceSpec
from kvcr_core.testing import pattern_block, random_keys

pytestmark = pytest.mark.integration

BLOCK = 16384
SPEC = NamespaceSpec(model_id="tiny", dtype="float32", kv_dtype="float32", block_size_tokens=16,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/guard")
HELLO = p.Hello(p.PROTOCOL_VERSION, [p.NamespaceFields(**dataclasses.asdict(SPEC))], BLOCK, "raw",
                os.getpid())


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s


def outcome(sock: socket.socket) -> str:
    """The Goodbye reason the daemon sent before closing, or 'closed' (EOF without one)."""
    try:
        while True:
            payload, fds = p.recv_frame(sock, max_fds=4)
            for fd in fds:
                os.close(fd)
            message = p.decode_server(payload)
            if isinstance(message, p.Goodbye):
                return message.reason.value
    except ConnectionError:
        return "closed"
    finally:
        sock.close()


def attach_raw(path: str) -> socket.socket:
    s = raw(path)
    s.sendall(p.encode_frame(HELLO))
    payload, fds = p.recv_frame(s, max_fds=4)
    for fd in fds:
        os.close(fd)
    assert isinstance(p.decode_server(payload), p.Welcome)
    return s


def frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def assert_still_serving(path: str) -> None:
    client = AttachClient(path, SPEC, BLOCK)
    keys = random_keys(2, seed=random.randrange(1 << 30))
    assert client.store(keys, [pattern_block(k, BLOCK) for k in keys]) == 2
    assert client.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    client.close()


@pytest.mark.parametrize("name,send,reason", [
    ("random bytes", lambda s: s.sendall(os.urandom(4096)), "oversized_frame|malformed"),
    ("huge length", lambda s: s.sendall(struct.pack("<I", 0xFFFFFFF0) + b"x"),
     "oversized_frame"),
    ("msgpack garbage", lambda s: s.sendall(frame(b"\xc1\xc1\xc1")), "malformed"),
    ("unknown tag", lambda s: s.sendall(frame(msgspec.msgpack.encode(["nope", 1]))),
     "malformed"),
    ("wrong version", lambda s: s.sendall(p.encode_frame(
        msgspec.structs.replace(HELLO, protocol=99))), "wrong_version"),
    ("request before hello", lambda s: s.sendall(p.encode_frame(p.Request(1, []))),
     "out_of_order"),
    ("bad namespace", lambda s: s.sendall(p.encode_frame(
        msgspec.structs.replace(HELLO, namespaces=[{"model_id": "x"}]))), "malformed"),
    ("geometry mismatch", lambda s: s.sendall(p.encode_frame(
        msgspec.structs.replace(HELLO, block_bytes=BLOCK * 2))), "bad_namespace"),
    ("truncated then EOF", lambda s: (s.sendall(struct.pack("<I", 100) + b"abc"),
                                      s.shutdown(socket.SHUT_WR)), "closed"),
])
def test_bad_first_frames_are_refused(guard, name, send, reason) -> None:
    """Each malformed opening is closed with its reason; the daemon serves others after."""
    sock = raw(guard.socket)
    if name == "geometry mismatch":
        assert_still_serving(guard.socket)  # the namespace exists with BLOCK-sized slots
    send(sock)
    got = outcome(sock)
    assert got in reason.split("|"), got
    assert_still_serving(guard.socket)


@pytest.mark.parametrize("name,frames,reason", [
    ("second hello", lambda: [HELLO], "out_of_order"),
    ("seq not increasing", lambda: [p.Request(5, [p.Stats()]), p.Request(5, [p.Stats()])],
     "out_of_order"),
    ("short key", lambda: [p.Request(1, [p.Lookup([b"short"])])], "malformed"),
    ("too many ops", lambda: [p.Request(1, [p.Stats()] * (p.MAX_OPS_PER_REQUEST + 1))],
     "malformed"),
    ("too many keys", lambda: [p.Request(1, [p.Lookup([bytes(16)] * (p.MAX_KEYS_PER_OP + 1))])],
     "malformed"),
    ("probe after hello", lambda: [p.Probe(p.PROTOCOL_VERSION)], "out_of_order"),
    ("namespace not opened", lambda: [p.Request(1, [p.Lookup([bytes(16)], ns=1)])],
     "malformed"),
    ("keys for more namespaces", lambda: [p.Request(1, [p.LookupAll([[bytes(16)]] * 2)])],
     "malformed"),
])
def test_violations_after_attach_close_only_that_client(guard, name, frames, reason) -> None:
    """A misbehaving attached client is cut off; others keep their connection and data."""
    bystander = AttachClient(guard.socket, SPEC, BLOCK)
    keys = random_keys(3, seed=11)
    bystander.store(keys, [pattern_block(k, BLOCK) for k in keys])
    sock = attach_raw(guard.socket)
    for message in frames():
        sock.sendall(p.encode_frame(message))
    assert outcome(sock) == reason
    assert bystander.lookup(keys) == 3
    bystander.close()


def test_fuzzed_frames_never_hurt_the_daemon(guard) -> None:
    """200 random payloads in well-formed frames, attached or not: all refused, none served."""
    rng = random.Random(1234)
    for i in range(200):
        sock = attach_raw(guard.socket) if i % 2 else raw(guard.socket)
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        sock.sendall(frame(body))
        assert outcome(sock) in {"malformed", "out_of_order", "wrong_version", "bad_namespace",
                                 "closed"}
    assert_still_serving(guard.socket)
    assert guard.metric("kvcr_guard_connections_closed_total", reason="malformed") >= 100


def test_foreign_op_ids_do_nothing(guard) -> None:
    """A client cannot commit or release another client's reservation or lease by id."""
    alice = AttachClient(guard.socket, SPEC, BLOCK)
    mallory = AttachClient(guard.socket, SPEC, BLOCK)
    keys = random_keys(2, seed=5)
    res = alice.reserve(keys)
    assert mallory.commit(res.op, checksums=[0, 0]) == 0 and mallory.abort(res.op) == 0
    assert alice.lookup(keys) == 0
    alice.abort(res.op)
    alice.close()
    mallory.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_another_uid_is_refused(guard) -> None:
    """Only allowed uids attach (default: the daemon's own); others get not_allowed."""
    os.chmod(guard.dir, 0o755)
    os.chmod(guard.socket, 0o666)  # let the kernel connect so the daemon's check is what says no
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody, connect, report the Goodbye reason
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(guard.socket)
            reason = p.decode_server(p.recv_frame(s)[0]).reason  # type: ignore[union-attr]
            os.write(write_end, reason.value.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    assert os.read(read_end, 100).decode() == "not_allowed"
    os.close(read_end)
    assert guard.metric("kvcr_guard_connections_closed_total", reason="not_allowed") == 1
    assert_still_serving(guard.socket)
