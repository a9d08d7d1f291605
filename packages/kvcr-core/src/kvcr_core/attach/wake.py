"""`WakePipe`: how other threads and signal handlers wake a selectors loop.

`wake()` may be called from any thread or signal handler, at any time, also after `close()`:
it then does nothing. It never writes to a closed descriptor number (another file may have
taken it since): the close and the write exclude each other, and a `wake()` that finds the
close under way skips the write instead of waiting (a signal handler on the loop's own thread
must never block on it).
"""

from __future__ import annotations

import contextlib
import os
import threading


class WakePipe:
    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()

    def wake(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # closing (the loop is ending anyway), or another wake is writing
        try:
            if self._write_fd >= 0:
                with contextlib.suppress(BlockingIOError):  # full: a wake is pending already
                    os.write(self._write_fd, b"x")
        finally:
            self._lock.release()

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.read_fd, 4096)

    def close(self) -> None:
        with self._lock:
            if self._write_fd >= 0:
                os.close(self.read_fd)
                os.close(self._write_fd)
                self._write_fd = self.read_fd = -1
