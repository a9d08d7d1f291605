"""HintBoard: posted hints map block hashes to sources, bounded and expiring."""

from __future__ import annotations

import pytest

from kvcr_core.hintboard import MAX_ENDPOINTS, HintBoard
from kvcr_core.hints import parse_hint
from kvcr_core.runner import Runner

pytestmark = pytest.mark.unit


def envelope(source: str, hashes: list[int]) -> dict[str, object]:
    return {"protocol_version": "0.1", "actions": [
        {"action_type": "kv.fetch", "action_version": "1.0",
         "payload": {"source_control_endpoint": source, "block_hashes": hashes}}]}


def test_sources_follow_the_latest_hint_per_hash() -> None:
    """Risk: a block is fetched from a source no hint named, or from a superseded one."""
    board = HintBoard()
    assert board.post(parse_hint(envelope("tcp://10.0.0.1:7000", [1, 2, 3]))) == 3
    assert board.post(parse_hint(envelope("tcp://10.0.0.2:7000", [3, 4]))) == 2
    assert board.sources([1, 3, 4, 5]) == ["tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000",
                                          "tcp://10.0.0.2:7000", None]
    assert board.matched_hashes == 3


def test_entries_expire_and_the_table_is_bounded() -> None:
    """Risk: stale hints send fetches to a source long after, or a router's flood grows the
    daemon's memory without bound."""
    now = [0.0]
    board = HintBoard(max_hashes=4, ttl_s=10, clock=lambda: now[0])
    board.post(parse_hint(envelope("tcp://10.0.0.1:7000", [1, 2, 3, 4, 5, 6])))
    assert len(board) == 4
    assert board.sources([1, 2, 6]) == [None, None, "tcp://10.0.0.1:7000"]
    now[0] = 11.0
    assert board.sources([6]) == [None]
    for i in range(MAX_ENDPOINTS + 5):
        board.post(parse_hint(envelope(f"tcp://10.0.{i // 250}.{i % 250 + 1}:7000", [100 + i])))
    assert board.sources([100 + MAX_ENDPOINTS + 1]) == [None]  # past the endpoint bound


def test_runner_post_hint_counts_rejections_and_remembers_nothing_from_them() -> None:
    """Risk: a malformed posted hint is half-applied, or not counted."""
    runner = Runner()
    assert runner.post_hint("{bad") == 0
    assert runner.post_hint(envelope("tcp://10.0.0.1:7000", [9])) == 1
    assert runner.metrics.hints["bad_json"] == 1 and runner.metrics.hints["accepted"] == 1
    assert runner.hint_board.sources([9]) == ["tcp://10.0.0.1:7000"]
    runner.close()
