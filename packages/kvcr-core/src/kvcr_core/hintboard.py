"""`HintBoard`: KV hints posted to a Runner ahead of the requests they are for.

For engines that do not hand hints to their cache plug-in (SGLang 0.5.23 keeps a request's
`kv_hints` on the request and passes it to no storage backend or linker), a router posts the
hint to the worker node's Runner instead (peer protocol `PostHint`, or the guard socket). The
board remembers, per router block hash, which source endpoint holds the block. When the
engine then misses those blocks, its adapter asks the board (`sources`) and has the Runner
fetch them from that source; content addressing ties the two together, no request id needed.

A hint is advice: the fetch still only dials configured, authenticated peers and checksums
what arrives. Bounded, so that junk from one poster (the caller's name for who posted: a peer
connection's address, an attach client's uid) cannot crowd out a real source:
- endpoints: at most `max_endpoints_per_poster` per poster (a poster past it loses its own
  least recently used one) and `max_endpoints` in all; when the table is full, a new endpoint
  takes the place of one with no live hash, else of the least recently used endpoint of the
  poster holding the most. A poster never refuses a new source; it only ages out old ones.
- hashes: at most `max_hashes` (about 200 bytes each), `ttl_s` of life each; past the bound,
  the oldest hashes of the poster holding the most go first.
Endpoint tables are keyed by (poster, endpoint), so two posters naming one source hold a row
each. Thread-safe (one lock); every operation is O(hashes it names + endpoints).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable

from kvcr_core.hints import KVHint

MAX_ENDPOINTS = 256
MAX_ENDPOINTS_PER_POSTER = 64
ANONYMOUS = ""
"""The poster of hints whose caller names none (all such callers share one quota)."""


@dataclasses.dataclass(eq=False, slots=True)
class _Row:
    """One source endpoint as named by one poster, and the hashes it is the source of."""

    poster: str
    endpoint: str
    expires: float = 0.0  # of its newest hash: no live hash after this
    hashes: collections.OrderedDict[int, float] = dataclasses.field(
        default_factory=collections.OrderedDict)  # hash -> expiry, oldest first


@dataclasses.dataclass(eq=False, slots=True)
class _Poster:
    rows: collections.OrderedDict[str, _Row] = dataclasses.field(
        default_factory=collections.OrderedDict)  # endpoint -> row, least recently used first
    hashes: int = 0


class HintBoard:
    def __init__(self, *, max_hashes: int = 1 << 18, ttl_s: float = 120.0,
                 max_endpoints: int = MAX_ENDPOINTS,
                 max_endpoints_per_poster: int = MAX_ENDPOINTS_PER_POSTER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_hashes = max_hashes
        self.ttl_s = ttl_s
        self.max_endpoints = max_endpoints
        self.max_endpoints_per_poster = min(max_endpoints_per_poster, max_endpoints)
        self._clock = clock
        self._lock = threading.Lock()
        self._where: dict[int, _Row] = {}  # hash -> the row of its latest hint
        self._posters: dict[str, _Poster] = {}
        self._rows: collections.OrderedDict[tuple[str, str], _Row] = (
            collections.OrderedDict())  # every row, least recently used first
        self.posted_hashes = 0
        self.matched_hashes = 0
        self.evicted_endpoints = 0

    def post(self, hint: KVHint, poster: str = ANONYMOUS) -> int:
        """Remembers every fetch action's hashes under its source, as posted by `poster`;
        returns hashes taken."""
        taken = 0
        with self._lock:
            now = self._clock()
            expiry = now + self.ttl_s
            for action in hint.fetches:
                row = self._row(poster, action.source_endpoint, now)
                row.expires = expiry
                for h in action.block_hashes:
                    self._put(h, row, expiry)
                taken += len(action.block_hashes)
            self._trim()
            self.posted_hashes += taken
        return taken

    def sources(self, hashes: Iterable[int]) -> list[str | None]:
        """The hinted source of each hash (None: no live hint for it)."""
        now = self._clock()
        out: list[str | None] = []
        with self._lock:
            for h in hashes:
                row = self._where.get(h)
                if row is None or row.hashes[h] < now:
                    out.append(None)
                    continue
                out.append(row.endpoint)
                self._touch(row)
                self.matched_hashes += 1
        return out

    def __len__(self) -> int:
        return len(self._where)

    @property
    def endpoint_count(self) -> int:
        """(poster, endpoint) rows held."""
        return len(self._rows)

    def _touch(self, row: _Row) -> None:
        self._rows.move_to_end((row.poster, row.endpoint))
        self._posters[row.poster].rows.move_to_end(row.endpoint)

    def _row(self, poster: str, endpoint: str, now: float) -> _Row:
        mine = self._posters.get(poster)
        row = mine.rows.get(endpoint) if mine is not None else None
        if row is not None:
            self._touch(row)
            return row
        if mine is not None and len(mine.rows) >= self.max_endpoints_per_poster:
            self._evict(next(iter(mine.rows.values())))  # its own least recently used
        elif len(self._rows) >= self.max_endpoints:
            self._evict(self._victim(now))
        mine = self._posters.setdefault(poster, _Poster())  # (anew if it lost its last row)
        row = _Row(poster, endpoint)
        mine.rows[endpoint] = row
        self._rows[(poster, endpoint)] = row
        return row

    def _victim(self, now: float) -> _Row:
        """The row a new one replaces: the least recently used with no live hash, else the
        least recently used of the poster holding the most rows."""
        for row in self._rows.values():
            if row.expires < now or not row.hashes:
                return row
        biggest = max(self._posters.values(), key=lambda p: len(p.rows))
        return next(iter(biggest.rows.values()))

    def _evict(self, row: _Row) -> None:
        for h in row.hashes:
            del self._where[h]
        owner = self._posters[row.poster]
        owner.hashes -= len(row.hashes)
        del owner.rows[row.endpoint]
        del self._rows[(row.poster, row.endpoint)]
        if not owner.rows:
            del self._posters[row.poster]
        self.evicted_endpoints += 1

    def _put(self, h: int, row: _Row, expiry: float) -> None:
        old = self._where.get(h)
        if old is not None:
            del old.hashes[h]
            self._posters[old.poster].hashes -= 1
        row.hashes[h] = expiry
        self._where[h] = row
        self._posters[row.poster].hashes += 1

    def _trim(self) -> None:
        """Drops hashes past `max_hashes`: the oldest of the poster holding the most, in
        rounds that bring it down to the next poster's count (or by 1/16 when they tie)."""
        while (excess := len(self._where) - self.max_hashes) > 0:
            ranked = sorted(self._posters.values(), key=lambda p: p.hashes, reverse=True)
            biggest = ranked[0]
            runner_up = ranked[1].hashes if len(ranked) > 1 else 0
            self._drop(biggest, min(excess, max(biggest.hashes - runner_up,
                                                1 + biggest.hashes // 16)))

    def _drop(self, poster: _Poster, count: int) -> None:
        for row in poster.rows.values():
            while count and row.hashes:
                h, _ = row.hashes.popitem(last=False)
                del self._where[h]
                poster.hashes -= 1
                count -= 1
            if not count:
                return
