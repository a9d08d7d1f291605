"""Socket helpers shared by the guard and peer protocols."""

from __future__ import annotations

import fcntl
import resource
import socket
import time

import pytest

from kvcr_core.framing import readable

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("high_descriptor", [False, True], ids=["select", "poll"])
def test_readable_sees_bytes_and_eof_at_any_descriptor(high_descriptor: bool) -> None:
    """Risk: a server with many connections hands `readable` a descriptor past FD_SETSIZE
    (select() raises there), or a zero timeout blocks."""
    a, b = socket.socketpair()
    if high_descriptor:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if max(soft, hard) <= 1100:
            pytest.skip("the descriptor limit is too low to open descriptor 1100")
        if soft <= 1100:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2048), hard))
        high = socket.socket(fileno=fcntl.fcntl(b.fileno(), fcntl.F_DUPFD, 1100))
        b.close()
        b = high
        assert b.fileno() >= 1024
    start = time.monotonic()
    assert not readable(b, 0)  # nothing yet, and no wait
    assert time.monotonic() - start < 0.5
    a.sendall(b"x")
    assert readable(b, 1.0)
    assert b.recv(1) == b"x"
    assert not readable(b, 0.01)
    a.close()
    assert readable(b, 1.0)  # EOF counts
    b.close()
