"""`PeerDirectory`: what a Runner knows of its peers' blocks from their inventory feeds (pull
on miss). Unit tests with scripted feeds; `test_pull_on_miss.py` runs real peer ports."""

from __future__ import annotations

import array
import threading
import tracemalloc
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvcr_core.inventory import InventoryBatch
from kvcr_core.peers.directory import PeerDirectory, PeerView
from kvcr_core.peers.metrics import DirectoryMetrics

pytestmark = pytest.mark.unit

NS = bytes(range(16))
OTHER = bytes(16)


def batch(seq: int, stored: list[int], removed: list[int] = (), ns: bytes = NS  # type: ignore[assignment]
          ) -> InventoryBatch:
    return InventoryBatch(seq, ns, array.array("Q", stored), array.array("Q", removed))


class ScriptedFeed:
    """An inventory source that answers polls from a script: (epoch, reset, batches) or an
    exception; then empty polls."""

    def __init__(self, script: list[tuple[int, bool, list[InventoryBatch]] | Exception]) -> None:
        self.script = script
        self.epoch: int | None = None
        self.polls = 0
        self.closed = 0
        self.drained = threading.Event()

    def poll(self) -> tuple[bool, list[InventoryBatch]]:
        self.polls += 1
        if not self.script:
            self.drained.set()
            return False, []
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        self.epoch, reset, batches = step
        return reset, batches

    def close(self) -> None:
        self.closed += 1


def directory(feeds: dict[str, ScriptedFeed], **kw: int) -> tuple[PeerDirectory, CollectorRegistry]:
    registry = CollectorRegistry()
    sources: dict[str, Callable[[], ScriptedFeed]] = {e: (lambda f=f: f) for e, f in feeds.items()}
    d = PeerDirectory(sources, DirectoryMetrics(registry), interval_s=0.01,
                      max_blocks=kw.get("max_blocks", 1000))
    for feed in feeds.values():
        assert feed.drained.wait(10)
    return d, registry


def test_the_longest_run_from_the_first_block_wins_and_holes_end_it() -> None:
    """Risk: pulling from a peer that holds fewer blocks than another, or across a hole (a
    run the local prefix cannot extend)."""
    a = ScriptedFeed([(1, False, [batch(1, [10, 11, 12])])])
    b = ScriptedFeed([(1, False, [batch(1, [10, 11, 12, 13]), batch(2, [15])])])
    d, _ = directory({"tcp://a:1": a, "tcp://b:1": b})
    try:
        assert d.run(NS, [10, 11, 12, 13, 14, 15]) == ("tcp://b:1", 4)
        assert d.run(NS, [11, 12]) in (("tcp://a:1", 2), ("tcp://b:1", 2))
        assert d.run(NS, [14, 15]) is None  # nobody holds the first block
        assert d.run(OTHER, [10, 11]) is None  # another namespace
        assert d.run(NS, [10, 11, 12, 13], min_blocks=5) is None  # not worth it
    finally:
        d.close()


def test_removed_blocks_epochs_gaps_and_lost_connections_forget_what_they_should() -> None:
    """Risk: pulling a block the peer evicted, or trusting a view that missed batches, was
    left by a restart, or belongs to a peer no longer reachable (over-credit)."""
    view = PeerView()
    view.apply(7, False, [batch(1, [1, 2, 3]), batch(2, [4], [2])], 100)
    assert view.run_length(NS, [1, 2]) == 1 and view.run_length(NS, [3, 4]) == 2
    view.apply(7, False, [batch(2, [9])], 100)  # a batch seen already: ignored
    assert view.run_length(NS, [9]) == 0
    view.apply(7, False, [batch(5, [20])], 100)  # 3 and 4 were lost: start over
    assert view.run_length(NS, [3]) == 0 and view.run_length(NS, [20]) == 1
    view.apply(8, False, [batch(1, [30])], 100)  # the peer restarted
    assert view.run_length(NS, [20]) == 0 and view.run_length(NS, [30]) == 1
    view.apply(8, True, [batch(9, [40])], 100)  # the reader fell behind
    assert view.run_length(NS, [30]) == 0 and view.run_length(NS, [40]) == 1
    assert view.resets == 3

    feed = ScriptedFeed([(1, False, [batch(1, [5, 6])]), ConnectionError("peer gone")])
    d, registry = directory({"tcp://a:1": feed})
    try:
        assert d.run(NS, [5, 6]) is None  # the failed poll dropped the peer's blocks
        assert feed.closed >= 1
        text = generate_latest(registry).decode()
        assert 'kvcr_peer_feed_resets_total{peer="tcp://a:1"} 1.0' in text
    finally:
        d.close()


def test_a_flooding_peer_stays_within_the_bound() -> None:
    """Risk: a peer that announces millions of blocks grows the follower's memory without
    bound."""
    flood = ScriptedFeed([(1, False, [batch(i + 1, list(range(i * 4096, (i + 1) * 4096)))
                                      for i in range(20)])])
    d, registry = directory({"tcp://a:1": flood}, max_blocks=10_000)
    try:
        assert d.snapshot()["tcp://a:1"][0] == 10_000
        newest = list(range(20 * 4096 - 100, 20 * 4096))
        assert d.run(NS, newest) == ("tcp://a:1", 100)  # the oldest were forgotten first
        assert d.run(NS, [0]) is None
        assert 'kvcr_peer_feed_blocks{peer="tcp://a:1"} 10000.0' in generate_latest(
            registry).decode()
    finally:
        d.close()


def test_lookups_are_counted_by_outcome() -> None:
    """Risk: operators cannot tell whether pull on miss finds anything."""
    d, registry = directory({"tcp://a:1": ScriptedFeed([(1, False, [batch(1, [1, 2, 3])])])})
    try:
        d.run(NS, [1, 2, 3])
        d.run(NS, [1], min_blocks=2)
        d.run(NS, [9])
        text = generate_latest(registry).decode()
        for outcome in ("remote_run", "short", "none"):
            assert f'kvcr_pull_lookups_total{{outcome="{outcome}"}} 1.0' in text
        assert "kvcr_pull_offered_blocks_total 3.0" in text
    finally:
        d.close()


@pytest.mark.parametrize("blocks", [100_000])
def test_follower_memory_per_peer_block_is_bounded(blocks: int) -> None:
    """Risk: the per-block cost of following a peer is much larger than documented (about
    100 bytes), so the default bound costs more memory than operators plan for."""
    view = PeerView()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    view.apply(1, False, [batch(i + 1, list(range(i * 4096, min(blocks, (i + 1) * 4096))))
                          for i in range(-(-blocks // 4096))], blocks)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert view.total == blocks
    assert used / blocks < 160
