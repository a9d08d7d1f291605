"""Length-prefixed frames on stream sockets, shared by the guard and peer protocols.

A frame is a 4-byte little-endian payload length, then the payload. Lengths are bounded: a
larger announced length is refused before anything is allocated. Blocking sockets only (the
callers set timeouts for deadlines). Pure functions; thread-safe per socket owner.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
from collections.abc import Sequence
from typing import Final

MAX_FRAME_BYTES: Final = 1 << 20
FRAME_HEADER = struct.Struct("<I")
_IOV_MAX: Final = 1024  # Linux's limit on buffers per sendmsg


class FrameError(ValueError):
    """The peer announced a frame larger than allowed."""


def frame(payload: bytes, limit: int = MAX_FRAME_BYTES) -> bytes:
    if len(payload) > limit:
        raise ValueError(f"message of {len(payload)} bytes exceeds {limit}")
    return FRAME_HEADER.pack(len(payload)) + payload


def readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether `sock` has bytes (or EOF) within `timeout_s` (0: now), with microsecond
    resolution where select() can take the descriptor (poll() rounds up to whole ms)."""
    if sock.fileno() < 1024:  # FD_SETSIZE
        return bool(select.select([sock], [], [], timeout_s)[0])
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(round(timeout_s * 1000) if timeout_s <= 0 else
                            max(1, round(timeout_s * 1000))))


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from the socket (straight into the caller's memory: no extra copy)."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-message")
        got += n


def send_all(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Sends the buffers in order with as few system calls as the kernel allows (gather I/O,
    resumed after partial sends); a TLS socket sends them one by one."""
    if isinstance(sock, ssl.SSLSocket):
        for buffer in buffers:
            sock.sendall(buffer)
        return
    views = [memoryview(b) for b in buffers]
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first:first + _IOV_MAX])
        while sent:
            size = views[first].nbytes
            if sent < size:
                views[first] = views[first][sent:]
                break
            sent -= size
            first += 1


def recv_frame(sock: socket.socket, *, max_fds: int = 0,
               limit: int = MAX_FRAME_BYTES) -> tuple[bytearray, list[int]]:
    """One frame's payload (and fds passed with its first bytes).

    Raises ConnectionError when the peer closes, FrameError on an oversized length.
    """
    fds: list[int] = []
    header = bytearray()
    while len(header) < FRAME_HEADER.size:
        want = FRAME_HEADER.size - len(header)
        if max_fds and not fds:
            data, got, _, _ = socket.recv_fds(sock, want, max_fds)
            fds.extend(got)
        else:
            data = sock.recv(want)
        if not data:
            raise ConnectionError("the peer closed the connection")
        header += data
    (length,) = FRAME_HEADER.unpack(header)
    if length > limit:
        raise FrameError(f"peer announced a {length}-byte frame (limit {limit})")
    payload = bytearray(length)
    recv_exact_into(sock, memoryview(payload))
    return payload, fds
