"""`PeerDirectory`: which blocks each configured peer holds, from following their inventory
feeds, so a Runner can pull on a local miss without a router or a hint.

One thread per peer polls the peer's inventory (`InventoryReader`: the peer port, the shared
secret, an inventory-only connection) every `interval_s` (at once again while batches keep
coming) and applies the batches, as a router's indexer does: `stored` before `removed` (a
block stored and evicted within one batch is gone), a batch not newer than the last applied is
ignored, a gap, a `reset` or a new epoch (the peer restarted) clears what was known of that
peer, and a failed poll clears it too (reconnect with backoff up to `MAX_BACKOFF_S`; under-
credit, never over-credit). Bounded: at most `max_blocks` router hashes per peer, all
namespaces together; past that the oldest known are forgotten first.

`run(namespace, hashes, min_blocks)` answers for the hashes of a request's blocks after its
local prefix: the peer holding the longest run of them from the first (never across a hole),
if that run has at least `min_blocks` blocks. A listing is advice: the fetch that follows still
checks every block's checksum, and a block evicted at the source meanwhile is a miss.

Threading: follower threads write each peer's view under the directory lock; `run` reads under
it (a few dictionary lookups per peer and block).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from kvcr_core.inventory import InventoryBatch
from kvcr_core.logs import ThrottledLog, printable
from kvcr_core.peers.metrics import DirectoryMetrics
from kvcr_core.types import NamespaceDigest

log = logging.getLogger("kvcr_core.peers")
MAX_BACKOFF_S = 5.0


class InventorySource(Protocol):
    """What the directory follows (an `InventoryReader` in production)."""

    epoch: int | None

    def poll(self) -> tuple[bool, list[InventoryBatch]]: ...

    def close(self) -> None: ...


class PeerView:
    """What is known of one peer: router hashes per namespace, oldest first."""

    __slots__ = ("blocks", "epoch", "resets", "seq", "total", "up_to_date_at")

    def __init__(self) -> None:
        self.blocks: dict[bytes, collections.OrderedDict[int, None]] = {}
        self.total = 0
        self.epoch: int | None = None
        self.seq = 0
        self.resets = 0
        self.up_to_date_at: float | None = None  # last poll that left nothing unread

    def clear(self) -> None:
        self.blocks.clear()
        self.total = 0
        self.seq = 0

    def apply(self, epoch: int, reset: bool, batches: Sequence[InventoryBatch],
              max_blocks: int) -> None:
        if reset or epoch != self.epoch:
            if self.epoch is not None:
                self.resets += 1
            self.clear()
            self.epoch = epoch
        for batch in batches:
            if batch.seq <= self.seq:
                continue  # already applied
            if self.seq and batch.seq > self.seq + 1:
                self.resets += 1
                self.clear()  # batches were lost: rebuild from what follows
            self.seq = batch.seq
            self._apply_one(batch.namespace, batch.stored, batch.removed)
        while self.total > max_blocks:
            self._forget_oldest()

    def _apply_one(self, namespace: bytes, stored: Iterable[int],
                   removed: Iterable[int]) -> None:
        known = self.blocks.setdefault(namespace, collections.OrderedDict())
        before = len(known)
        for h in stored:
            known[h] = None
            known.move_to_end(h)
        for h in removed:
            known.pop(h, None)
        self.total += len(known) - before
        if not known:
            del self.blocks[namespace]

    def _forget_oldest(self) -> None:
        namespace = max(self.blocks, key=lambda n: len(self.blocks[n]))
        known = self.blocks[namespace]
        known.popitem(last=False)
        self.total -= 1
        if not known:
            del self.blocks[namespace]

    def run_length(self, namespace: bytes, hashes: Sequence[int]) -> int:
        known = self.blocks.get(namespace)
        if not known:
            return 0
        n = 0
        for h in hashes:
            if h not in known:
                break
            n += 1
        return n


class PeerDirectory:
    """Follows the inventory of every peer in `sources` (endpoint -> a reader factory)."""

    def __init__(self, sources: Mapping[str, Callable[[], InventorySource]],
                 metrics: DirectoryMetrics, *, max_blocks: int, interval_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_blocks = max_blocks
        self.interval_s = interval_s
        self.metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._views = {endpoint: PeerView() for endpoint in sources}
        self._stop = threading.Event()
        self._warn = ThrottledLog(log, 60.0)
        metrics.bind(self)
        self._threads = [threading.Thread(target=self._follow, args=(endpoint, factory),
                                          name=f"kvcr-peer-feed-{i}", daemon=True)
                         for i, (endpoint, factory) in enumerate(sources.items())]
        for thread in self._threads:
            thread.start()

    # -- answers -----------------------------------------------------------------------------

    def run(self, namespace: NamespaceDigest, hashes: Sequence[int],
            min_blocks: int = 1) -> tuple[str, int] | None:
        """(peer, n): the peer holding the longest run of `hashes` from the first, if n >=
        `min_blocks`; None otherwise (counted either way)."""
        best: tuple[str, int] | None = None
        with self._lock:
            for endpoint, view in self._views.items():
                n = view.run_length(namespace, hashes)
                if n and (best is None or n > best[1]):
                    best = (endpoint, n)
        if best is None:
            self.metrics.on_lookup("none", 0)
            return None
        if best[1] < min_blocks:
            self.metrics.on_lookup("short", 0)
            return None
        self.metrics.on_lookup("remote_run", best[1])
        return best

    def snapshot(self) -> dict[str, tuple[int, int, float | None]]:
        """Per peer: (blocks known, resets, seconds since it was last up to date)."""
        now = self._clock()
        with self._lock:
            return {endpoint: (v.total, v.resets,
                               None if v.up_to_date_at is None else now - v.up_to_date_at)
                    for endpoint, v in self._views.items()}

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)

    # -- following ---------------------------------------------------------------------------

    def _follow(self, endpoint: str, new_reader: Callable[[], InventorySource]) -> None:
        reader: InventorySource | None = None
        delay = self.interval_s
        while not self._stop.is_set():
            try:
                reader = reader or new_reader()
                reset, batches = reader.poll()
            except Exception as exc:  # any fault: forget this peer, retry with backoff
                if reader is not None:
                    reader.close()
                    reader = None
                self._lost(endpoint, exc)
                self._stop.wait(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
                continue
            delay = self.interval_s
            with self._lock:
                view = self._views[endpoint]
                view.apply(reader.epoch or 0, reset, batches, self.max_blocks)
                if not batches:
                    view.up_to_date_at = self._clock()
            if not batches:
                self._stop.wait(self.interval_s)
        if reader is not None:
            reader.close()

    def _lost(self, endpoint: str, exc: Exception) -> None:
        with self._lock:
            view = self._views[endpoint]
            if view.epoch is not None or view.total:
                view.resets += 1
            view.clear()
            view.epoch = None
        self._warn.log(logging.WARNING, endpoint, "inventory of peer %s unavailable (%s); "
                       "pulling nothing from it until it answers", endpoint,
                       printable(f"{type(exc).__name__}: {exc}"))
