"""Log lines an operator can trust: strings a client chose are escaped (`printable`), and
repeated refusals are throttled (`ThrottledLog`) while every one is still counted in metrics.

A client-chosen string (an engine's identity, a hint's message id, a refused value) could
otherwise forge log lines (newlines, escape sequences) or flood the log; a burst of hostile
connections could write thousands of warnings. Pure and thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

_MAX_SHOWN = 120


def printable(text: object, limit: int = _MAX_SHOWN) -> str:
    """`text` with every control or non-ASCII character escaped, cut at `limit` characters
    (then ending in "..."): safe to put in a log line."""
    value = str(text)
    cut = len(value) > limit
    shown = value[:limit].encode("ascii", "backslashreplace").decode("ascii")
    shown = "".join(c if " " <= c <= "~" else f"\\x{ord(c):02x}" for c in shown)
    return shown + ("..." if cut else "")


class ThrottledLog:
    """At most one line per `key` every `interval_s`; the next one says how many were held
    back meanwhile."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 64) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, level: int, key: str, message: str, *args: object,
            exc_info: bool = False) -> None:
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return
            if len(self._last) >= self._max_keys and key not in self._last:
                self._last.clear()
                self._held.clear()
            self._last[key] = now
            held = self._held.pop(key, 0)
        suffix = f" ({held} more like it held back)" if held else ""
        self._logger.log(level, message + suffix, *args, exc_info=exc_info)
