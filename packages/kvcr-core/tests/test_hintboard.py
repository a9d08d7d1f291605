"""HintBoard: posted hints map block hashes to sources, bounded and expiring, with endpoint
tables per poster and overall that junk from one poster cannot fill for the others."""

from __future__ import annotations

import json

import pytest

from kvcr_core.hintboard import MAX_ENDPOINTS, MAX_ENDPOINTS_PER_POSTER, HintBoard
from kvcr_core.hints import parse_hint
from kvcr_core.peers import InventoryReader, PeerSecret
from kvcr_core.runner import Runner
from kvcr_core.testing import secret_for
from kvcr_core.testing.nodes import stocked_source
from kvcr_core.types import NamespaceDigest

REAL = "tcp://10.9.9.9:7500"


def junk(i: int) -> str:
    return f"tcp://10.0.{i // 250}.{i % 250 + 1}:7000"


def envelope(source: str, hashes: list[int]) -> dict[str, object]:
    return {"protocol_version": "0.1", "actions": [
        {"action_type": "kv.fetch", "action_version": "1.0",
         "payload": {"source_control_endpoint": source, "block_hashes": hashes}}]}


@pytest.mark.unit
def test_sources_follow_the_latest_hint_per_hash() -> None:
    """Risk: a block is fetched from a source no hint named, or from a superseded one."""
    board = HintBoard()
    assert board.post(parse_hint(envelope("tcp://10.0.0.1:7000", [1, 2, 3]))) == 3
    assert board.post(parse_hint(envelope("tcp://10.0.0.2:7000", [3, 4]))) == 2
    assert board.sources([1, 3, 4, 5]) == ["tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000",
                                          "tcp://10.0.0.2:7000", None]
    assert board.matched_hashes == 3


@pytest.mark.unit
def test_entries_expire_and_the_table_is_bounded() -> None:
    """Risk: stale hints send fetches to a source long after, or a router's flood grows the
    daemon's memory without bound (or, full, refuses every new source)."""
    now = [0.0]
    board = HintBoard(max_hashes=4, ttl_s=10, clock=lambda: now[0])
    board.post(parse_hint(envelope("tcp://10.0.0.1:7000", [1, 2, 3, 4, 5, 6])))
    assert len(board) == 4
    assert board.sources([1, 2, 6]) == [None, None, "tcp://10.0.0.1:7000"]
    now[0] = 11.0
    assert board.sources([6]) == [None]
    for i in range(MAX_ENDPOINTS + 5):
        board.post(parse_hint(envelope(junk(i), [100 + i])), poster=f"router-{i % 8}")
    assert board.endpoint_count == MAX_ENDPOINTS
    assert board.sources([100 + MAX_ENDPOINTS + 4]) == [junk(MAX_ENDPOINTS + 4)]


@pytest.mark.unit
def test_runner_post_hint_counts_rejections_and_remembers_nothing_from_them() -> None:
    """Risk: a malformed posted hint is half-applied, or not counted."""
    runner = Runner()
    assert runner.post_hint("{bad") == 0
    assert runner.post_hint(envelope("tcp://10.0.0.1:7000", [9])) == 1
    assert runner.metrics.hints["bad_json"] == 1 and runner.metrics.hints["accepted"] == 1
    assert runner.hint_board.sources([9]) == ["tcp://10.0.0.1:7000"]
    runner.close()


@pytest.mark.unit
def test_one_posters_junk_endpoints_cannot_crowd_out_another_posters_source() -> None:
    """Risk: a poster naming 512 junk sources fills the endpoint table, so a real router's
    source gets 0 hashes (issue 36), or later junk evicts the real source."""
    board = HintBoard()
    for i in range(512):
        board.post(parse_hint(envelope(junk(i), [1000 * i + j for j in range(8)])), "junk")
    assert board.post(parse_hint(envelope(REAL, [1, 2, 3])), "router") == 3
    for i in range(512, 1024):
        board.post(parse_hint(envelope(junk(i), [1000 * i])), "junk")
    assert board.sources([1, 2, 3]) == [REAL] * 3
    assert board.endpoint_count == MAX_ENDPOINTS_PER_POSTER + 1  # junk kept to its quota
    assert board.evicted_endpoints == 1024 - MAX_ENDPOINTS_PER_POSTER


@pytest.mark.unit
def test_a_full_table_replaces_dead_endpoints_then_the_biggest_posters_oldest() -> None:
    """Risk: a full endpoint table refuses a new source, or makes room by evicting a live
    source of a poster with few endpoints instead of one with no live hash or the flooder's."""
    now = [0.0]
    board = HintBoard(max_endpoints=6, max_endpoints_per_poster=4, ttl_s=10,
                      clock=lambda: now[0])
    board.post(parse_hint(envelope("tcp://10.8.0.1:7000", [2])), "other")  # dead at 10
    now[0] = 3.0
    board.post(parse_hint(envelope(REAL, [1])), "router")  # live until 13
    now[0] = 4.0
    for i in range(4):
        board.post(parse_hint(envelope(junk(i), [100 + i])), "junk")  # live until 14
    now[0] = 5.0
    assert board.sources([2]) == ["tcp://10.8.0.1:7000"]  # "other" is now the newest used
    now[0] = 12.0
    board.post(parse_hint(envelope("tcp://10.7.0.1:7000", [3])), "late")  # replaces "other"
    board.post(parse_hint(envelope("tcp://10.7.0.2:7000", [4])), "late")  # replaces junk 0
    assert board.sources([1, 2, 100, 101, 3, 4]) == [
        REAL, None, None, junk(1), "tcp://10.7.0.1:7000", "tcp://10.7.0.2:7000"]
    assert board.endpoint_count == 6


@pytest.mark.unit
def test_past_the_hash_bound_the_poster_holding_the_most_loses_its_oldest() -> None:
    """Risk: one poster's flood of hashes pushes out every other poster's hints (the oldest
    hashes overall went first), or the bound is not kept."""
    board = HintBoard(max_hashes=100)
    board.post(parse_hint(envelope(REAL, [1, 2, 3])), "router")
    for i in range(10):
        board.post(parse_hint(envelope(junk(i), list(range(1000 * (i + 1), 1000 * (i + 1) + 50)))),
                   "junk")
    assert len(board) == 100
    assert board.sources([1, 2, 3]) == [REAL] * 3
    assert board.sources([10_049, 1000]) == [junk(9), None]  # the flooder's newest stay


@pytest.mark.unit
def test_an_anonymous_flood_keeps_memory_bounded_and_a_new_source_taken() -> None:
    """Risk: hints posted without a poster (one shared quota) grow the daemon by 200 MiB and
    leave a real source no room, as 512 junk endpoints of 4096 hashes did (issue 36)."""
    board = HintBoard()
    for i in range(512):
        board.post(parse_hint(envelope(junk(i), [(i << 20) + j for j in range(4096)])))
    assert len(board) <= MAX_ENDPOINTS_PER_POSTER * 4096 <= board.max_hashes
    assert board.endpoint_count == MAX_ENDPOINTS_PER_POSTER
    assert board.post(parse_hint(envelope(REAL, [1, 2, 3]))) == 3
    assert board.sources([1, 2, 3, 0]) == [REAL, REAL, REAL, None]


@pytest.mark.integration
def test_a_real_source_posted_over_the_peer_port_after_512_junk_endpoints_is_taken() -> None:
    """Risk: through a real peer server, a poster's 512 junk sources leave a router's real
    source with 0 hashes on the runner's board."""
    secret = PeerSecret(secret_for("hint-board-flood").encode())
    runner, server, _, _ = stocked_source(NamespaceDigest(bytes(16)), 4096, secret, 1, seed=1,
                                          nixl=False)
    try:
        flooder = InventoryReader(server.endpoint, secret, 5.0)
        for i in range(512):
            assert flooder.post_hint(json.dumps(envelope(junk(i), [(i << 20) + 1]))) == 1
        flooder.close()
        router = InventoryReader(server.endpoint, secret, 5.0)
        assert router.post_hint(json.dumps(envelope(REAL, [1, 2, 3]))) == 3
        router.close()
        assert runner.hint_board.sources([1, 2, 3]) == [REAL] * 3
        assert runner.hint_board.endpoint_count <= MAX_ENDPOINTS
    finally:
        server.close()
        runner.close()
