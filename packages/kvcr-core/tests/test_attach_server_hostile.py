"""Hostile and buggy clients against a real kvcr-guard, over real sockets. Every test breaks
one defence's assumption on purpose and then checks what a legitimate engine still gets: the
daemon is alive, a legitimate client attaches and loads the exact bytes it stored, no slot or
lease is left held, and nothing is left on disk."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import mmap
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcr_core.attach import AttachClient, RunnerUnavailable
from kvcr_core.attach import protocol as p
from kvcr_core.checksums import block_checksum
from kvcr_core.keys import NamespaceSpec
from kvcr_core.peers import FetchStatus, InventoryReader, PeerClient, PeerMetrics, PeerSecret
from kvcr_core.testing import pattern_block, random_keys, secret_for

pytestmark = pytest.mark.integration

BLOCK = 16384
SPEC = NamespaceSpec(model_id="tiny", dtype="float32", kv_dtype="float32", block_size_tokens=16,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/hostile")
SECRET = secret_for("hostile-client-test-secret-0123456789").encode()


def hello(spec: NamespaceSpec = SPEC, identity: str = "attacker") -> p.Hello:
    return p.Hello(p.PROTOCOL_VERSION, [p.NamespaceFields(**dataclasses.asdict(spec))], BLOCK,
                   identity, os.getpid())


def attach_raw(path: str, spec: NamespaceSpec = SPEC) -> tuple[socket.socket, int, p.Welcome]:
    """A client that keeps the pool's memfd (a hostile one would)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(p.encode_frame(hello(spec)))
    payload, fds = p.recv_frame(sock, max_fds=4)
    welcome = p.decode_server(payload)
    assert isinstance(welcome, p.Welcome) and len(fds) == 1, welcome
    return sock, fds[0], welcome


_rounds = itertools.count(1 << 20)


def legit_round(path: str) -> None:
    """What an engine does after any attack: attach, store new blocks, load them exactly,
    detach."""
    client = AttachClient(path, SPEC, BLOCK, identity="legit")
    keys = random_keys(4, seed=next(_rounds))
    assert client.store(keys, [pattern_block(k, BLOCK) for k in keys]) == 4
    assert client.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    client.close()


def nothing_held(path: str) -> None:
    """No slot FILLING and none leased once the attackers are gone."""
    client = AttachClient(path, SPEC, BLOCK, identity="observer")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats.filling_blocks == 0 and stats.leased_slots == 0:
            break
        time.sleep(0.05)
    assert (stats.filling_blocks, stats.leased_slots, stats.open_leases) == (0, 0, 0)
    client.close()


@pytest.fixture
def guard(short_tmp: str, harness) -> Iterator:
    secret = os.path.join(short_tmp, "secret")
    Path(secret).write_bytes(SECRET)
    g = harness.Guard(short_tmp, "--peer-listen", "127.0.0.1:0", "--peer-secret-file", secret,
                      "--handshake-timeout-s", "0.5", "--max-pending", "8").start()
    yield g
    assert g.proc is not None and g.proc.poll() is None, "the daemon died: " + g.logs()
    assert g.stop() == 0, g.logs()
    assert not os.path.exists(g.socket)  # nothing left behind
    g.log.close()


def peer_endpoint(guard) -> str:
    kvcr = os.path.join(os.path.dirname(sys.executable), "kvcr")
    out = subprocess.run([kvcr, "status", "--socket", guard.socket, "--json"], check=True,
                         capture_output=True, text=True)
    return str(msgspec.json.decode(out.stdout)["peer_endpoint"])


def test_a_client_cannot_shrink_grow_or_reseal_the_pool(guard) -> None:
    """Risk: one attached process ftruncates the pool memfd and every mapping of it (other
    engines, the daemon) dies of SIGBUS on its next touch."""
    legit = AttachClient(guard.socket, SPEC, BLOCK, identity="legit")
    keys = random_keys(8, seed=1)
    legit.store(keys, [pattern_block(k, BLOCK) for k in keys])
    sock, fd, welcome = attach_raw(guard.socket)
    region_bytes = welcome.pools[0].region_bytes
    for attack in (lambda: os.ftruncate(fd, 0), lambda: os.ftruncate(fd, region_bytes * 2),
                   lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)):
        with pytest.raises(PermissionError):
            attack()
    assert os.fstat(fd).st_size == welcome.pools[0].region_bytes
    with mmap.mmap(fd, welcome.pools[0].region_bytes) as mapped:
        assert mapped[:4] is not None  # still mapped whole
    os.close(fd)
    sock.close()
    assert legit.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    legit.close()
    legit_round(guard.socket)
    nothing_held(guard.socket)


def test_a_client_refuses_a_pool_fd_that_is_not_sealed(tmp_path: Path) -> None:
    """Risk: a client maps an fd another process could shrink under it."""
    from kvcr_core.memory import HostRegion

    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 1 << 20)
    with pytest.raises(ValueError, match="not sealed"):
        HostRegion.map_fd(fd, 1 << 20)
    region = HostRegion.create(1 << 20)
    with pytest.raises(ValueError, match="announced"):
        HostRegion.map_fd(os.dup(region.fd), 2 << 20)
    region.close()


def _scribble(guard, keys: list[bytes]) -> None:
    """An attacker attached to the same namespace writes over committed blocks."""
    sock, fd, welcome = attach_raw(guard.socket)
    legit = AttachClient(guard.socket, SPEC, BLOCK, identity="legit")
    lease = legit.acquire(keys)
    with mmap.mmap(fd, welcome.pools[0].region_bytes) as mapped:
        for slot in lease.slots:
            assert slot is not None
            offset = slot * welcome.pools[0].stride_bytes
            mapped[offset:offset + 64] = b"\xaa" * 64
    legit.release(lease.op)
    legit.close()
    os.close(fd)
    sock.close()


def test_blocks_scribbled_after_commit_are_refused_by_peers_and_verified_loads(guard) -> None:
    """Risk: bytes changed in the pool after their commit are served as good (to a peer,
    which used to get checksums computed at first serve, after the corruption) or loaded as
    good by an engine that verifies its loads."""
    keys = random_keys(6, seed=3)
    writer = AttachClient(guard.socket, SPEC, BLOCK, identity="writer")
    writer.store(keys, [pattern_block(k, BLOCK) for k in keys])
    writer.close()
    _scribble(guard, keys[:3])

    from prometheus_client import CollectorRegistry

    from kvcr_core.config import KVCRConfig
    from kvcr_core.runner import Runner

    node = Runner(KVCRConfig(pool_bytes=64 * BLOCK), registry=CollectorRegistry())
    store = node.open_namespace(SPEC, BLOCK)
    peer = PeerClient(store, PeerSecret(SECRET), PeerMetrics(CollectorRegistry()))
    result = peer.fetch(peer_endpoint(guard), keys, deadline_s=10)
    assert result.statuses == (FetchStatus.CHECKSUM,) * 3 + (FetchStatus.OK,) * 3
    assert store.contains(keys) == [False] * 3 + [True] * 3
    peer.close()
    node.close()

    reader = AttachClient(guard.socket, SPEC, BLOCK, identity="verifying engine")
    lease = reader.acquire(keys, checksums=True)
    view = reader.pool().view
    verdicts = [block_checksum(view(s)) == c for s, c in zip(lease.slots, lease.checksums,
                                                              strict=True) if s is not None]
    assert verdicts == [False] * 3 + [True] * 3
    reader.release(lease.op)
    reader.close()
    legit_round(guard.socket)


def test_a_tenant_cannot_open_another_tenants_namespace(short_tmp: str, harness) -> None:
    """Risk: any local client says Hello with another tenant's namespace and gets a writable
    mapping of it (reads its KV, scribbles over it, clears it)."""
    other_uid = os.getuid() + 1
    g = harness.Guard(short_tmp, "--allowed-uid", str(os.getuid()), "--allowed-uid",
                      str(other_uid), "--tenant", f"team-b={other_uid}").start()
    team_b = dataclasses.replace(SPEC, tenant="team-b")
    with pytest.raises(RunnerUnavailable) as refused:
        AttachClient(g.socket, team_b, BLOCK).attach()
    assert refused.value.reason == "not_allowed" and "team-b" in refused.value.detail
    legit_round(g.socket)  # tenant "" is open to every allowed uid
    assert g.metric("kvcr_guard_connections_closed_total", reason="not_allowed") == 1
    assert g.stop() == 0


def test_one_client_cannot_squat_every_slot_or_every_namespace(guard) -> None:
    """Risk: one client reserves every slot and never commits (or opens namespaces until the
    pool is gone), and no other engine can store anything."""
    squatter = AttachClient(guard.socket, SPEC, BLOCK, identity="squatter")
    capacity = squatter.stats().capacity_slots
    res = squatter.reserve(random_keys(capacity, seed=6))
    assert 0 < res.granted <= capacity // 2 and res.refused == capacity - res.granted
    assert squatter.reserve(random_keys(4, seed=7)).granted == 0  # at its quota
    legit_round(guard.socket)
    squatter.close()
    nothing_held(guard.socket)


def test_idle_slow_and_half_open_connections_cost_nothing_for_long(guard) -> None:
    """Risk: connections that never say Hello (or send half a frame) stay forever, count
    against every client, and crowd out engines."""
    idle = [socket.socket(socket.AF_UNIX) for _ in range(20)]
    for sock in idle:
        with contextlib.suppress(OSError):
            sock.connect(guard.socket)
    with contextlib.suppress(OSError):  # on a slow machine the daemon may have closed it
        idle[0].sendall(b"\x10\x00")  # half a frame header
    legit = AttachClient(guard.socket, SPEC, BLOCK, identity="legit")
    keys = random_keys(2, seed=9)
    legit.store(keys, [pattern_block(k, BLOCK) for k in keys])  # attached clients unaffected
    for sock in idle:  # each is closed by the handshake deadline: wait for that, no longer
        sock.settimeout(10)
        with contextlib.suppress(OSError):
            while sock.recv(4096):  # a Goodbye, then EOF
                pass
    assert guard.settled_metric("kvcr_guard_connections_closed_total", 20,
                                reason="handshake_timeout") + guard.metric(
        "kvcr_guard_connections_closed_total", reason="too_many_clients") >= 20
    assert guard.metric("kvcr_guard_pending_connections") == 0
    for sock in idle:
        sock.close()
    assert legit.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    legit.close()
    legit_round(guard.socket)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_decodable_messages_with_hostile_values_close_only_their_connection(guard, data) -> None:
    """Risk: a message that decodes but carries hostile values (zero or negative sizes, a
    list where a mapping belongs, huge numbers, foreign op ids) kills the daemon (it used to:
    an `extra` list, a block size of 0) or another client's work."""
    anything = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
                            | st.text(max_size=40) | st.binary(max_size=40),
                            lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                            max_leaves=12)
    tag = data.draw(st.sampled_from(["hello", "probe", "request"]))
    fields = data.draw(st.lists(anything, max_size=6))
    namespace = {**dataclasses.asdict(SPEC), **data.draw(
        st.dictionaries(st.sampled_from(["block_size_tokens", "extra", "tp_rank", "tp_size",
                                         "model_id", "num_layers"]), anything, max_size=2))}
    if tag == "hello" and data.draw(st.booleans()):
        fields = [p.PROTOCOL_VERSION, namespace, data.draw(anything), "x", os.getpid()]
    payload = msgspec.msgpack.encode([tag, *fields])
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(guard.socket)
    with contextlib.suppress(OSError):
        sock.sendall(len(payload).to_bytes(4, "little") + payload)
        if tag != "probe":
            sock.sendall(p.encode_frame(p.Request(1, [p.Commit(next(_rounds), [])])))
        while sock.recv(65536):
            pass
    sock.close()
    assert guard.proc.poll() is None, guard.logs()
    legit_round(guard.socket)


def test_an_inventory_bigger_than_a_frame_reaches_the_router_in_parts(
        short_tmp: str, harness) -> None:
    """Risk: commits of 8,192 keys made batches whose reply to a reader 16 batches behind was
    larger than a frame: the server's thread died and the router's feed stalled for good."""
    secret = os.path.join(short_tmp, "secret")
    Path(secret).write_bytes(SECRET)
    g = harness.Guard(short_tmp, "--pool-bytes", "600MiB", "--namespace-pool-bytes", "560MiB",
                      "--client-held-fraction", "1", "--peer-listen", "127.0.0.1:0",
                      "--peer-secret-file", secret).start()
    writer = AttachClient(g.socket, SPEC, 4096, identity="bulk writer")  # pages never touched
    stored = 0
    for seed in range(17):
        res = writer.reserve(random_keys(8192, seed=100 + seed))
        stored += writer.commit(res.op, checksums=[0] * res.granted)
    reader = InventoryReader(peer_endpoint(g), PeerSecret(SECRET))
    seen = 0
    for _ in range(40):
        _, batches = reader.poll()
        if not batches:
            break
        seen += sum(len(b.stored) for b in batches)
    assert seen == stored == 17 * 8192
    reader.close()
    writer.close()
    assert g.proc is not None and g.proc.poll() is None
    assert g.stop() == 0


def test_running_out_of_descriptors_pauses_accepting_and_nothing_dies(
        short_tmp: str, harness) -> None:
    """Risk: EMFILE on accept crashed kvcr-guard, and any accept error silently stopped peer
    serving for good."""
    secret = os.path.join(short_tmp, "secret")
    Path(secret).write_bytes(SECRET)
    g = harness.Guard(short_tmp, "--peer-listen", "127.0.0.1:0", "--peer-secret-file", secret,
                      "--max-pending", "200", "--max-pending-per-uid", "200")
    g.wrap = ["prlimit", "--nofile=48:48"]  # a daemon short of descriptors
    g.start()
    endpoint = peer_endpoint(g)
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    flood: list[socket.socket] = []
    for _ in range(60):
        local = socket.socket(socket.AF_UNIX)
        local.connect(g.socket)  # queued by the kernel even when the daemon cannot accept
        flood.append(local)
        flood.append(socket.create_connection((host, int(port)), timeout=5))
    assert g.settled_metric("kvcr_guard_accept_errors_total", 1) > 0
    assert g.settled_metric("kvcr_peer_accept_errors_total", 1) > 0
    for sock in flood:
        sock.close()
    time.sleep(1.5)  # accepting again after the pause
    assert g.proc is not None and g.proc.poll() is None, g.logs()
    legit_round(g.socket)

    from prometheus_client import CollectorRegistry

    from kvcr_core.config import KVCRConfig
    from kvcr_core.runner import Runner

    keys = random_keys(2, seed=12)
    writer = AttachClient(g.socket, SPEC, BLOCK)
    writer.store(keys, [pattern_block(k, BLOCK) for k in keys])
    writer.close()
    node = Runner(KVCRConfig(pool_bytes=64 * BLOCK), registry=CollectorRegistry())
    peer = PeerClient(node.open_namespace(SPEC, BLOCK), PeerSecret(SECRET),
                      PeerMetrics(CollectorRegistry()))
    assert peer.fetch(endpoint, keys, deadline_s=10).fetched == 2  # peers still served
    peer.close()
    node.close()
    assert g.stop() == 0


def _hint(hashes: list[int]) -> str:
    return msgspec.json.encode({"protocol_version": "0.1", "message_id": "m", "actions": [{
        "action_type": "kv.fetch", "payload": {"source_control_endpoint": "tcp://10.0.0.9:7500",
                                               "block_hashes": hashes}}]}).decode()


def test_no_request_is_heavy_enough_to_stall_the_other_clients(short_tmp: str, harness) -> None:
    """Risk: one client's request of thousands of keys (or a huge hint, or a huge frame)
    holds the daemon's single loop for milliseconds, and every engine's request waits behind
    it. Each request's work is bounded (the rest refused, counted); AttachClient splits big
    operations into pipelined parts, so an engine's large store, load and hint still work
    whole."""
    g = harness.Guard(short_tmp, "--pool-bytes", "96MiB", "--namespace-pool-bytes", "32MiB").start()
    sock, fd, _ = attach_raw(g.socket, dataclasses.replace(SPEC, layout="bounded"))
    os.close(fd)
    many = [bytes(k) for k in random_keys(p.MAX_KEYS_PER_OP, seed=21)]
    sock.sendall(p.encode_frame(p.Request(1, [p.Reserve(many), p.PostHint(
        _hint(list(range(1, 2000))))])))
    reply = p.decode_server(p.recv_frame(sock)[0])
    assert isinstance(reply, p.Reply)
    slots, hint = reply.results
    assert isinstance(slots, p.Slots) and isinstance(hint, p.Count)
    assert slots.granted == p.MAX_HEAVY_KEYS_PER_REQUEST
    assert slots.refused == len(many) - slots.granted and hint.n == 0
    assert g.metric("kvcr_guard_over_budget_total") == slots.refused + 1
    sock.sendall(b"\x00\x00\x04\x00" + bytes(64))  # announces a 256 KiB frame
    goodbye = p.decode_server(p.recv_frame(sock)[0])
    assert isinstance(goodbye, p.Goodbye) and goodbye.reason == p.CloseReason.OVERSIZED_FRAME
    sock.close()

    engine = AttachClient(g.socket, dataclasses.replace(SPEC, layout="engine"), 4096,
                          identity="engine")
    keys = random_keys(3000, seed=22)
    res = engine.reserve(keys)
    for slot in res.slots:  # written (one byte each): a never-written page is a hole
        engine.pool().view(slot)[:1] = b"\0"  # type: ignore[arg-type]
    assert res.granted == 3000 and engine.commit(res.op, checksums=[0] * 3000) == 3000
    lease = engine.acquire(keys, checksums=True)
    assert lease.granted == 3000 and lease.checksums == (0,) * 3000
    assert engine.release(lease.op)
    hashes = list(range(1, 3001))
    assert engine.post_hint(_hint(hashes)) == 3000
    assert engine.hint_sources(hashes) == ["tcp://10.0.0.9:7500"] * 3000
    with pytest.raises(ValueError, match="at most"):
        engine.batch([p.Lookup([bytes(k) for k in keys])] * 4)  # over the frame limit
    stats = engine.stats()
    assert (stats.ready_blocks, stats.filling_blocks, stats.leased_slots) == (3000, 0, 0)
    engine.close()
    assert g.proc is not None and g.proc.poll() is None, g.logs()
    assert g.stop() == 0


def test_log_lines_escape_client_strings_and_refusal_bursts_are_throttled_not_lost(
        guard) -> None:
    """Risk: an identity with a newline forges a daemon log line, and a burst of refused
    connections writes a warning each (438 in one burst) or, throttled, goes uncounted."""
    forged = "engine\n2026-12-01 12:00:00 ERROR kvcr_core.attach forged line"
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    sock.connect(guard.socket)
    sock.sendall(p.encode_frame(hello(identity=forged)))
    payload, fds = p.recv_frame(sock, max_fds=4)
    assert isinstance(p.decode_server(payload), p.Welcome)
    for fd in fds:
        os.close(fd)
    sock.sendall(b"\xff\xff\xff\x00")  # an oversized frame: a warning naming the client
    p.recv_frame(sock)
    sock.close()
    for _ in range(40):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(guard.socket)
            s.sendall(b"\xff\xff\xff\x00")
            p.recv_frame(s)  # Goodbye(oversized_frame)
    legit_round(guard.socket)
    logs = guard.logs()
    assert "engine\\x0a2026-12-01 12:00:00 ERROR kvcr_core.attach forged line" in logs
    assert not any(line.startswith("2026-12-01 12:00:00") for line in logs.splitlines())
    refusals = [line for line in logs.splitlines() if "oversized_frame" in line]
    assert 1 <= len(refusals) <= 2
    assert guard.metric("kvcr_guard_connections_closed_total", reason="oversized_frame") == 41
