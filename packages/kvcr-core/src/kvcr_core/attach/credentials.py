"""Who is at the other end of a Unix socket, by the kernel's word (`SO_PEERCRED`: the pid,
uid and gid of the process that connected, or of the one that called `listen` on a server's
socket), never by what the peer says about itself. The attach server uses it to admit
clients; an engine's client uses it to accept only a Runner served by a uid it trusts, so a
socket bound first by another uid never receives the engine's KV or serves it blocks.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import stat
import struct
from collections.abc import Iterable

_UCRED = struct.Struct("3i")


@dataclasses.dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _UCRED.size))
    return PeerCredentials(pid, uid, gid)


def trusted_runner_uids(configured: Iterable[int] = ()) -> frozenset[int]:
    """The uids an engine accepts a Runner from: its own, plus those configured
    (`runner_uids`, e.g. the uid kvcr-guard runs as)."""
    return frozenset({os.getuid(), *configured})


def untrusted_runner(sock: socket.socket, trusted: frozenset[int], path: str) -> str | None:
    """Why the server behind the connected `sock` may not be trusted (None: it may)."""
    uid = peer_credentials(sock).uid
    if uid in trusted:
        return None
    shown = path.replace("\0", "@")
    return (f"{shown} is served by uid {uid}, not by this engine's uid {os.getuid()} or a uid "
            f"it trusts ({sorted(trusted)}); another uid may have bound it first. If uid {uid} "
            "runs your kvcr-guard, trust it with the engine key \"runner_uids\": "
            f"[{uid}]; otherwise find who serves it (ss -xlp) and stop that process")


def shared_directory_problem(directory: str) -> str | None:
    """Why a socket in `directory` could be bound first by another uid (None: it cannot):
    the directory, or one above it, may be written by a uid other than root and this one."""
    me = os.getuid()
    path = os.path.abspath(directory)
    while True:
        try:
            info = os.stat(path)
        except OSError as exc:
            return f"cannot inspect {path}: {exc.strerror}"
        if info.st_uid not in (0, me):
            return f"{path} belongs to uid {info.st_uid}"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (
                info.st_mode & stat.S_ISVTX and path != os.path.abspath(directory)):
            return (f"{path} is writable by other uids (mode "
                    f"{stat.S_IMODE(info.st_mode):04o})")
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
