"""An attacker process for the trust tests, run as another uid (kvcr_core.testing.as_other_uid;
one mode per process). It prints one JSON line when ready (and, for modes that report, one
more with what it saw) and waits on stdin: the test closes it to end a mode that holds.

Modes: `fake-server PATH` (bind PATH, answer every connection by reading what it sends),
`squat NAME...` (bind these abstract names), `client SOCKET ACTION [ARGS]` (attach to a
Runner with the guard tests' namespace, as the engine would, and try ACTION), `flood SOCKET
N` (N connections that never say Hello).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import threading

from kvcr_core.attach import AttachClient, RunnerError, probe_status
from kvcr_core.testing import pattern_block

sys.path.insert(0, os.path.dirname(__file__))
from attach_worker import BLOCK, SPEC, keys_for


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


def client(path: str, action: str, args: list[str]) -> None:
    spec = dataclasses.replace(SPEC, tenant=args[0]) if action.endswith("-tenant") else SPEC
    me = AttachClient(path, spec, BLOCK, identity="attacker", runner_uids=frozenset({0}))
    try:
        me.attach()
    except RunnerError as exc:
        say(ready=True, attached=False, reason=str(exc))
        return
    keys = keys_for(int(args[-2]), int(args[-1])) if action in ("read", "overwrite") else []
    if action == "read":  # how many of the victim's blocks this uid reads back exactly
        lease = me.acquire(keys)
        pool = me.pool()
        exact = sum(1 for k, s in zip(keys, lease.slots, strict=True)
                    if s is not None and bytes(pool.view(s)) == pattern_block(k, BLOCK))
        say(ready=True, attached=True, read=exact)
    elif action == "overwrite":  # scribble over every slot of the mapping
        pool = me.pool()
        for slot in range(pool.slots):
            pool.view(slot)[:] = b"\xee" * BLOCK
        say(ready=True, attached=True, overwrote=pool.slots)
    elif action == "status":
        say(ready=True, attached=True, status=probe_status(path, timeout_s=2.0))
    else:
        say(ready=True, attached=True)
    hold()
    me.close()


def flood(path: str, count: int) -> None:
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            continue
        socks.append(sock)
    say(ready=True, connected=len(socks))
    hold()


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
