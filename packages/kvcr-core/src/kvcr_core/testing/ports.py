"""`free_port()`: a TCP port on 127.0.0.1 that nothing listened on a moment ago, for the test
and benchmark servers that must be told their port before they start (the usual race: the
port is free when asked, not reserved; servers that lose it fail loudly at bind)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
