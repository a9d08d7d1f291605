"""`AuthThrottle`: failed peer authentications, counted per source address, so guessing the
secret (or a node key) costs an attacker time: after `max_failures` failures within
`window_s`, that address's connections are closed at accept until the window has passed.
Bounded (`max_sources` addresses, oldest forgotten first) and thread-safe.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable


class AuthThrottle:
    def __init__(self, max_failures: int = 5, window_s: float = 10.0, *,
                 max_sources: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._max_sources = max_sources
        self._clock = clock
        self._lock = threading.Lock()
        # address -> (failures in the window, when the window started), oldest first
        self._failures: collections.OrderedDict[str, tuple[int, float]] = \
            collections.OrderedDict()

    def blocked(self, address: str) -> bool:
        """Whether `address` failed too often lately (its connection is closed unheard)."""
        with self._lock:
            entry = self._failures.get(address)
            if entry is None:
                return False
            failures, since = entry
            if self._clock() - since >= self.window_s:
                del self._failures[address]
                return False
            return failures >= self.max_failures

    def failed(self, address: str) -> None:
        now = self._clock()
        with self._lock:
            failures, since = self._failures.pop(address, (0, now))
            if now - since >= self.window_s:
                failures, since = 0, now
            self._failures[address] = (failures + 1, since)
            while len(self._failures) > self._max_sources:
                self._failures.popitem(last=False)
