"""`HintBoard`: KV hints posted to a Runner ahead of the requests they are for.

For engines that do not hand hints to their cache plug-in (SGLang 0.5.23 keeps a request's
`kv_hints` on the request and passes it to no storage backend or linker), a router posts the
hint to the worker node's Runner instead (peer protocol `PostHint`, or the guard socket). The
board remembers, per router block hash, which source endpoint holds the block. When the
engine then misses those blocks, its adapter asks the board (`sources`) and has the Runner
fetch them from that source; content addressing ties the two together, no request id needed.

A hint is advice: the fetch still only dials configured, authenticated peers and checksums
what arrives. Bounded: at most `max_hashes` entries (oldest dropped first) and `ttl_s` of
life each; at most `MAX_ENDPOINTS` distinct sources. Thread-safe (one lock).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable

from kvcr_core.hints import KVHint

MAX_ENDPOINTS = 256


class HintBoard:
    def __init__(self, *, max_hashes: int = 1 << 20, ttl_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_hashes = max_hashes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[int, tuple[int, float]] = (
            collections.OrderedDict())  # hash -> (endpoint id, expiry), oldest first
        self._endpoints: list[str] = []
        self._endpoint_ids: dict[str, int] = {}
        self.posted_hashes = 0
        self.matched_hashes = 0

    def post(self, hint: KVHint) -> int:
        """Remembers every fetch action's hashes under its source; returns hashes taken."""
        taken = 0
        with self._lock:
            expiry = self._clock() + self.ttl_s
            for action in hint.fetches:
                endpoint = self._endpoint_id(action.source_endpoint)
                if endpoint < 0:
                    continue
                for h in action.block_hashes:
                    self._entries[h] = (endpoint, expiry)
                    self._entries.move_to_end(h)
                    taken += 1
            while len(self._entries) > self.max_hashes:
                self._entries.popitem(last=False)
            self.posted_hashes += taken
        return taken

    def sources(self, hashes: Iterable[int]) -> list[str | None]:
        """The hinted source of each hash (None: no live hint for it)."""
        now = self._clock()
        out: list[str | None] = []
        with self._lock:
            for h in hashes:
                entry = self._entries.get(h)
                if entry is None or entry[1] < now:
                    out.append(None)
                    continue
                out.append(self._endpoints[entry[0]])
                self.matched_hashes += 1
        return out

    def __len__(self) -> int:
        return len(self._entries)

    def _endpoint_id(self, endpoint: str) -> int:
        found = self._endpoint_ids.get(endpoint)
        if found is not None:
            return found
        if len(self._endpoints) >= MAX_ENDPOINTS:
            return -1  # bounded: a flood of distinct sources cannot grow the table
        self._endpoint_ids[endpoint] = len(self._endpoints)
        self._endpoints.append(endpoint)
        return len(self._endpoints) - 1
