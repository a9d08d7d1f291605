"""The attach server's wake pipe: wakes from any thread or signal handler, also late."""

from __future__ import annotations

import os
import threading

import pytest

from kvcr_core.attach.wake import WakePipe

pytestmark = pytest.mark.unit


def test_a_wake_after_close_never_writes_to_a_reused_descriptor() -> None:
    """Risk: `request_shutdown` after the loop closed its wake pipe (a stop racing the loop's
    own shutdown) writes to a closed descriptor: EBADF out of `stop()` (seen in CI), or, once
    another file took that number, a stray byte into someone else's pipe or socket."""
    pipe = WakePipe()
    pipe.wake()
    pipe.drain()
    old_write = pipe._write_fd
    pipe.close()
    pipe.close()  # twice: harmless
    reader, writer = os.pipe2(os.O_NONBLOCK)
    os.dup2(writer, old_write)  # another file now holds the wake pipe's old number
    try:
        pipe.wake()
        try:
            stray = os.read(reader, 16)
        except BlockingIOError:
            stray = b""
        assert stray == b"", "a wake after close wrote into another file"
    finally:
        for fd in {reader, writer, old_write}:
            os.close(fd)


def test_a_wake_during_close_returns_at_once() -> None:
    """Risk: a signal handler that requests shutdown on the loop's own thread while the loop
    is closing the pipe waits for a lock its own thread holds: the daemon hangs at SIGTERM."""
    pipe = WakePipe()
    with pipe._lock:  # the loop's close, under way
        waker = threading.Thread(target=pipe.wake, daemon=True)
        waker.start()
        waker.join(timeout=5)
        assert not waker.is_alive(), "wake() waited for the close"
    pipe.close()
