"""Who is at the other end of a Unix socket, by the kernel's word (`SO_PEERCRED`: the pid,
uid and gid of the process that connected, or of the one that called `listen` on a server's
socket), never by what the peer says about itself. The attach server uses it to admit
clients; an engine's client uses it to accept only a Runner served by a uid it trusts, so a
socket bound first by another uid never receives the engine's KV or serves it blocks.
`grant_connect` lets exactly the allowed uids connect to a socket path (a POSIX ACL), so the
kernel refuses every other uid before the server sees the connection.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import stat
import struct
from collections.abc import Iterable

_UCRED = struct.Struct("3i")
_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = struct.Struct("<I")
_ACL_ENTRY = struct.Struct("<HHI")  # tag, permissions, id
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_RW, _ACL_NONE, _ACL_NO_ID = 6, 0, 0xFFFFFFFF


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


def grant_connect(path: str, uids: Iterable[int]) -> str | None:
    """Lets `uids` (and this uid; root always can) connect to the socket at `path` and no one
    else: mode 0600 plus an access ACL entry (read-write) per other uid, so the kernel turns
    every other uid away at connect, before the server spends anything on it. Returns why it
    could not (the filesystem keeps no ACLs), None when done or when no other uid is named."""
    others = sorted({u for u in uids if u not in (os.getuid(), 0)})
    os.chmod(path, 0o600)
    if not others:
        return None
    entries = [(_ACL_USER_OBJ, _ACL_RW, _ACL_NO_ID),
               *((_ACL_USER, _ACL_RW, uid) for uid in others),
               (_ACL_GROUP_OBJ, _ACL_NONE, _ACL_NO_ID), (_ACL_MASK, _ACL_RW, _ACL_NO_ID),
               (_ACL_OTHER, _ACL_NONE, _ACL_NO_ID)]
    blob = _ACL_VERSION.pack(2) + b"".join(_ACL_ENTRY.pack(*e) for e in entries)
    try:
        os.setxattr(path, _ACL_XATTR, blob)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
            raise
        return (f"the filesystem of {path} keeps no POSIX ACLs ({exc.strerror}), so uids "
                f"{others} cannot connect to a socket of mode 0600: put the socket on one "
                "that does (tmpfs, ext4, xfs), or give them access yourself (a group: chgrp, "
                "chmod 0660); uids not allowed are still refused at connect")
    return None
