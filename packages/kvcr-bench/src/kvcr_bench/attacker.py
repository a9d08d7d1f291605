"""A misbehaving client of kvcr-guard, for `kvcr bench guard --under-attack`:
`python -m kvcr_bench.attacker MODE SOCKET PEER_HOST PEER_PORT [ARG]` misbehaves as MODE says
until it is stopped (SIGTERM: it prints what it got as one JSON line, `{}` for modes that
report nothing). Each mode is one way the trust boundary is attacked (docs/guard.md); the
bench runs some of them as another uid (kvcr_core.testing.uids):

hints      attached, posts the largest KV hints the protocol takes, back to back
keys       attached, requests of as many keys as a frame holds (lookups, reserves, leases)
squat      attached, reserves every slot it can and never commits
malformed  connects, sends a garbage frame, again and again
idle       keeps as many never-speaking connections open as it can
tenant     says Hello with another tenant's namespace, again and again
fd         attached, keeps the pool fd and tries to shrink, grow and reseal it
scribble   attached, writes over the pool (committed blocks included) as fast as it can
peer       floods the peer port with connections that never authenticate
capture    opens as many junk namespaces as its uid may (reserving every slot of each) and
           keeps asking for more; ARG: the daemon's uid, which it trusts
foreign-flood  keeps the socket flooded with connections that never say Hello (run as a uid
           the daemon does not allow)
fake-server    binds SOCKET (a path the engine might be pointed at) and reads what comes
punch      attached to the engine's namespace (a tenant it shares with the engine's uid),
           punches every page out of the pool memfd (madvise MADV_REMOVE), again and again
poison     a compromised fleet node (key `poisoner` of the fleet in SOCKET, a directory): serves
           bytes of its own making under keys the engine misses, tagged as node `honest`'s,
           on 127.0.0.1:PORT
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import json
import mmap
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Callable

from kvcr_core.attach import AttachClient, RunnerError
from kvcr_core.attach import protocol as p
from kvcr_core.keys import NamespaceSpec
from kvcr_core.testing import random_keys

SPEC = NamespaceSpec(model_id="kvcr-bench", dtype="float32", kv_dtype="float32",
                     block_size_tokens=16, num_layers=1, num_kv_heads=1, head_dim=128,
                     layout="bench", extra={"block_bytes": "4096"})
BLOCK = 4096
SHARED_TENANT = "bench-team"  # named for the engine's uid and the attacker's (punch)
POISON_SEED = 424_242  # the keys of the blocks the engine misses and the poisoner serves
POISON_BLOCKS = 8
POISON_BYTE = 0xEE
REPORT: dict[str, int] = {}
"""What the running mode got so far: printed as one JSON line when it is stopped."""


def _attach(path: str, spec: NamespaceSpec = SPEC) -> tuple[socket.socket, int, p.Welcome]:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(p.encode_frame(p.Hello(p.PROTOCOL_VERSION,
                                        [p.NamespaceFields(**dataclasses.asdict(spec))], BLOCK,
                                        "attacker", os.getpid())))
    payload, fds = p.recv_frame(sock, max_fds=4)
    welcome = p.decode_server(payload)
    if not isinstance(welcome, p.Welcome):
        raise SystemExit(f"not attached: {welcome}")
    return sock, fds[0], welcome


def _requests(path: str, make_ops: Callable[[int], list[p.Op]]) -> None:
    sock, fd, _ = _attach(path)
    os.close(fd)
    seq = 0
    while True:
        seq += 1
        sock.sendall(p.encode_frame(p.Request(seq, make_ops(seq))))
        p.recv_frame(sock)


def hint_envelope(limit_bytes: int) -> str:
    """The largest valid KV hint (one fetch action) of at most `limit_bytes`."""
    hashes = [random.getrandbits(63) for _ in range(limit_bytes // 20)]
    while True:
        envelope = json.dumps({"protocol_version": "0.1", "message_id": "m", "actions": [{
            "action_type": "kv.fetch", "action_version": "1.0", "payload": {
                "source_control_endpoint": "tcp://10.0.0.9:7500", "block_hashes": hashes}}]})
        if len(envelope) <= limit_bytes:
            return envelope
        hashes = hashes[: len(hashes) * 19 // 20]


def hints(path: str) -> None:
    envelope = hint_envelope(p.MAX_REQUEST_FRAME_BYTES - 4096)
    _requests(path, lambda seq: [p.PostHint(envelope)])


def _raw_keys(n: int, seed: int) -> list[bytes]:
    return [bytes(k) for k in random_keys(n, seed=seed)]


def keys(path: str) -> None:
    many = _raw_keys(p.MAX_KEYS_PER_OP, seed=7)
    kinds: list[p.Op] = [p.Lookup(many), p.Reserve(many), p.Acquire(many, False)]
    _requests(path, lambda seq: [kinds[seq % 3]])  # as many keys as a frame holds


def squat(path: str) -> None:
    _requests(path, lambda seq: [p.Reserve(_raw_keys(p.MAX_KEYS_PER_OP, seed=seq))])


def malformed(path: str) -> None:
    while True:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(path)
            sock.sendall(b"\x08\x00\x00\x00" + os.urandom(8))
            while sock.recv(4096):
                pass


def idle(path: str) -> None:
    held: list[socket.socket] = []
    while True:
        with contextlib.suppress(OSError):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(path)
            held.append(sock)
        if len(held) > 400:
            held.pop(0).close()
        time.sleep(0.001)


def tenant(path: str) -> None:
    other = dataclasses.replace(SPEC, tenant="someone-else")
    while True:
        with contextlib.suppress(OSError, SystemExit):
            sock, fd, _ = _attach(path, other)
            os.close(fd)
            sock.close()


def fd(path: str) -> None:
    _sock, pool_fd, welcome = _attach(path)  # held open: attached all along
    while True:
        for attack in (lambda: os.ftruncate(pool_fd, 0),
                       lambda: os.ftruncate(pool_fd, welcome.pools[0].region_bytes * 2),
                       lambda: fcntl.fcntl(pool_fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)):
            with contextlib.suppress(OSError):
                attack()
        time.sleep(0.0001)


def scribble(path: str) -> None:
    _sock, pool_fd, welcome = _attach(path)  # held open: attached all along
    with mmap.mmap(pool_fd, welcome.pools[0].region_bytes) as mapped:
        junk = b"\xaa" * BLOCK
        while True:
            at = random.randrange(welcome.pools[0].capacity_slots) * welcome.pools[0].stride_bytes
            mapped[at:at + BLOCK] = junk


def peer(host: str, port: int) -> None:
    held: list[socket.socket] = []
    while True:
        with contextlib.suppress(OSError):
            sock = socket.create_connection((host, port), timeout=1)
            if random.random() < 0.5:
                sock.sendall(b"\x00\x00\x10\x00")  # a 1 MiB frame announced, never sent
            held.append(sock)
        if len(held) > 200:
            held.pop(0).close()


def capture(path: str, runner_uid: str) -> None:
    held: list[AttachClient] = []
    REPORT.update(opened=0, refused=0)
    for n in itertools.count():
        me = AttachClient(path, dataclasses.replace(SPEC, tenant=f"junk-{n}"), BLOCK,
                          identity="capture", runner_uids=frozenset({int(runner_uid)}))
        try:
            me.attach()
            me.reserve(random_keys(me.stats().capacity_slots, seed=n))  # never committed
            held.append(me)
        except RunnerError:
            me.close()
            REPORT["refused"] += 1
            time.sleep(0.01)  # and asks again: room may have come back
        REPORT["opened"] = len(held)


def foreign_flood(path: str) -> None:
    held: list[socket.socket] = []
    REPORT.update(connections=0)
    while True:
        held[:] = [s for s in held if _open(s)]
        while len(held) < 400:
            sock = socket.socket(socket.AF_UNIX)
            sock.setblocking(False)
            try:
                sock.connect(path)
            except OSError:
                sock.close()
                break  # the backlog is full: that is the point
            held.append(sock)
            REPORT["connections"] += 1


def _open(sock: socket.socket) -> bool:
    """Whether the daemon has not closed `sock` (closes it here if it has)."""
    try:
        if sock.recv(4096):
            return True
    except BlockingIOError:
        return True
    except OSError:
        pass
    sock.close()
    return False


def fake_server(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    os.chmod(path, 0o777)
    listener.listen(16)
    REPORT.update(connections=0, received_bytes=0)
    while True:
        conn, _ = listener.accept()
        REPORT["connections"] += 1
        conn.settimeout(2)
        with contextlib.suppress(OSError), conn:
            while chunk := conn.recv(65536):
                REPORT["received_bytes"] += len(chunk)


def punch(path: str) -> None:
    _sock, pool_fd, welcome = _attach(path, dataclasses.replace(SPEC, tenant=SHARED_TENANT))
    REPORT.update(punches=0)
    with mmap.mmap(pool_fd, welcome.pools[0].region_bytes) as mapped:
        while True:
            mapped.madvise(mmap.MADV_REMOVE)
            REPORT["punches"] += 1
            time.sleep(random.uniform(0.001, 0.02))  # some loads start between punches


def poison(fleet_dir: str, port: int) -> None:
    from kvcr_core.peers import PeerServer
    from kvcr_core.peers.fleet import FleetCredential, NodeKey
    from kvcr_core.peers.origins import OriginRegistry
    from kvcr_core.testing import peer_node
    from kvcr_core.testing.fleet import forge_origin

    cred = FleetCredential(NodeKey.from_file(os.path.join(fleet_dir, "poisoner.key")),
                           os.path.join(fleet_dir, "fleet.yaml"))
    runner, store, metrics = peer_node(SPEC.digest(), BLOCK)
    poisoned = random_keys(POISON_BLOCKS, seed=POISON_SEED)
    store.store(poisoned, [bytes([POISON_BYTE]) * BLOCK] * len(poisoned))
    origins = OriginRegistry(cred)
    forge_origin(origins, "honest")
    PeerServer(runner, cred, metrics, port=port, origins=origins)
    REPORT.update(serving=len(poisoned))
    while True:
        time.sleep(1)


MODES = {"hints": hints, "keys": keys, "squat": squat, "malformed": malformed, "idle": idle,
         "tenant": tenant, "fd": fd, "scribble": scribble, "foreign-flood": foreign_flood,
         "fake-server": fake_server, "punch": punch}


def _stopped(signum: int, frame: object) -> None:
    print(json.dumps(REPORT), flush=True)
    os._exit(0)


def main() -> None:
    signal.signal(signal.SIGTERM, _stopped)
    mode, path, host, port, *arg = sys.argv[1:]
    if mode == "peer":
        peer(host, int(port))
    elif mode == "poison":
        poison(path, int(port))
    elif mode == "capture":
        capture(path, arg[0])
    else:
        MODES[mode](path)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError, ConnectionError):
        main()
