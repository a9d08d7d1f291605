"""An attacker for the trust tests, run as another uid by `Attacker(mode, ...)`
(kvcr_core.testing.as_other_uid; one mode per process). It prints one JSON line when ready
(and, for modes that report, one more with what it saw) and waits on stdin: the test closes
it to end a mode that holds.

Modes: `fake-server PATH` (bind PATH, read what connecting engines send), `squat NAME...`
(bind these abstract names), `client SOCKET ACTION [ARGS]` (attach to a Runner with the
guard tests' namespace, as an engine would, then: `read[-tenant T] PROMPT BLOCKS`,
`overwrite`, `punch[-tenant T]`, `status`, `clear[-tenant T]`, `fill N` junk namespaces, `hog T`,
`squat-size`, `hint-flood`),
`flood SOCKET N` (keep up to N connections that never say Hello).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable

from kvcr_core.attach import AttachClient, RunnerError, probe_status
from kvcr_core.testing import pattern_block, random_keys
from kvcr_core.testing.uids import as_other_uid

sys.path.insert(0, os.path.dirname(__file__))
from attach_worker import BLOCK, SPEC, keys_for


class Attacker:
    """A trust_attacker.py mode running as uid 65534 (or, `same_uid`, as this test's own
    uid: an attacker inside the victim's namespace); `finish()` ends it and returns its last
    report."""

    def __init__(self, *args: str, same_uid: bool = False) -> None:
        argv = [sys.executable, __file__, *args]
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        self.proc = subprocess.Popen(argv, **pipes) if same_uid else as_other_uid(argv, **pipes)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read().decode() if self.proc.stderr else ""
        self.ready = json.loads(line)

    def finish(self) -> dict[str, object]:
        out, err = self.proc.communicate(timeout=30)
        lines = out.decode().strip().splitlines()
        return json.loads(lines[-1]) if lines else {"stderr": err.decode()}



_MADV_REMOVE = 9


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def hold() -> None:
    sys.stdin.read()  # until the test closes our stdin (or kills us)


def fake_server(path: str) -> None:
    """Binds `path` and reads whatever connecting engines send."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path.replace("@", "\0", 1) if path.startswith("@") else path)
    if not path.startswith("@"):
        os.chmod(path, 0o777)
    listener.listen(16)
    received = [0]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.settimeout(2)
            with contextlib.suppress(OSError):
                while chunk := conn.recv(65536):
                    received[0] += len(chunk)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    say(ready=True)
    hold()
    say(received=received[0])


def squat(names: list[str]) -> None:
    held = []
    for name in names:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(OSError):
            sock.bind("\0" + name.lstrip("@"))
            sock.listen(1)
            held.append(sock)
    say(ready=True, squatted=len(held))
    hold()


def hint(source: str, hashes: Iterable[int]) -> str:
    """A KV hint envelope: `hashes` are held by `source`."""
    return json.dumps({"protocol_version": "0.1", "message_id": "m", "actions": [{
        "action_type": "kv.fetch", "payload": {"source_control_endpoint": source,
                                               "block_hashes": list(hashes)}}]})


def attacker(path: str, tenant: str = "") -> AttachClient:
    return AttachClient(path, dataclasses.replace(SPEC, tenant=tenant), BLOCK,
                        identity="attacker", runner_uids=frozenset({0}))


def fill(path: str, count: int) -> None:
    """Opens `count` junk namespaces (one client each): how many opened."""
    opened = []
    for n in range(count):
        me = attacker(path, f"junk-{n}")
        with contextlib.suppress(RunnerError):
            me.attach()
            opened.append(me)
    say(ready=True, opened=len(opened))
    hold()


def hog(path: str, tenant: str) -> None:
    """Two connections in `tenant`, each reserving every slot it can, never committing."""
    granted = 0
    clients = [attacker(path, tenant) for _ in range(2)]
    for me in clients:
        granted += me.reserve(random_keys(me.stats().capacity_slots, seed=id(me))).granted
    say(ready=True, granted=granted, capacity=clients[0].stats().capacity_slots)
    hold()


def client(path: str, action: str, args: list[str]) -> None:
    if action == "fill":
        return fill(path, int(args[0]))
    if action == "hog":
        return hog(path, args[0])
    if action == "hint-flood":  # 512 junk sources of 64 hashes each
        junk = attacker(path)
        taken = sum(junk.post_hint(hint(f"tcp://10.9.{n // 250}.{n % 250}:7500",
                                        range(n * 64 + 1, n * 64 + 65))) for n in range(512))
        say(ready=True, attached=True, taken=taken)
        return hold()
    if action == "squat-size":  # the victim's namespace, opened first with another block size
        squatter = AttachClient(path, SPEC, 2 * BLOCK, identity="attacker",
                                runner_uids=frozenset({0}))
        squatter.attach()
        say(ready=True, attached=True)
        return hold()
    me = attacker(path, args[0] if action.endswith("-tenant") else "")
    try:
        me.attach()
    except RunnerError as exc:
        say(ready=True, attached=False, reason=str(exc))
        return
    keys = keys_for(int(args[-2]), int(args[-1])) if action.startswith("read") else []
    if action.startswith("read"):  # how many of the victim's blocks this uid reads back exactly
        lease = me.acquire(keys)
        pool = me.pool()
        exact = sum(1 for k, s in zip(keys, lease.slots, strict=True)
                    if s is not None and bytes(pool.view(s)) == pattern_block(k, BLOCK))
        say(ready=True, attached=True, read=exact)
    elif action == "overwrite":  # scribble over every slot of the mapping
        pool = me.pool()
        for slot in range(pool.capacity_slots):
            pool.view(slot)[:] = b"\xee" * BLOCK
        say(ready=True, attached=True, overwrote=pool.capacity_slots)
    elif action.startswith("punch"):  # MADV_REMOVE every slot: the pages leave the memfd
        pool = me.pool()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        done = libc.madvise(pool.region.address, pool.region.size_bytes, _MADV_REMOVE)
        say(ready=True, attached=True, punched=done == 0)
    elif action == "status":
        say(ready=True, attached=True, status=probe_status(path, timeout_s=2.0))
    elif action.startswith("clear"):
        try:
            say(ready=True, attached=True, cleared=me.clear())
        except RunnerError as exc:
            say(ready=True, attached=True, refused=str(exc))
    else:
        say(ready=True, attached=True)
    hold()
    me.close()


def flood(path: str, count: int) -> None:
    """Keeps the socket flooded until told to stop: connects again and again without ever
    saying Hello, holding up to `count` connections."""
    held: list[socket.socket] = []
    made = [0]
    stop = threading.Event()

    def connect_forever() -> None:
        while not stop.is_set():
            held[:] = [s for s in held if _alive(s)]
            while len(held) < count and not stop.is_set():
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    sock.connect(path)
                except OSError:
                    sock.close()
                    break  # the backlog is full: that is the point
                held.append(sock)
                made[0] += 1

    worker = threading.Thread(target=connect_forever, daemon=True)
    worker.start()
    while made[0] < count // 4:
        threading.Event().wait(0.01)
    say(ready=True, connected=made[0])
    hold()
    stop.set()
    worker.join()
    say(connections=made[0])


def _alive(sock: socket.socket) -> bool:
    try:
        if sock.recv(4096) == b"":
            sock.close()
            return False
    except BlockingIOError:
        return True
    except OSError:
        sock.close()
        return False
    return True


def main() -> None:
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "fake-server":
        fake_server(rest[0])
    elif mode == "squat":
        squat(rest)
    elif mode == "client":
        client(rest[0], rest[1], rest[2:])
    elif mode == "flood":
        flood(rest[0], int(rest[1]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
