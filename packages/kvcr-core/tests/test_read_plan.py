"""`read_plan`: how a NIXL fetch splits into READs. Guards the risks of a plan that skips or
repeats blocks, exceeds the largest READ, or ends in a large READ (whose check nothing overlaps).
"""

from __future__ import annotations

import pytest

from kvcr_core.peers.reads import read_plan
from kvcr_core.testing import LoopbackTransport

pytestmark = pytest.mark.unit

KIB = 1024


@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 5, 8, 16, 63, 64, 65, 100, 1000, 4097])
@pytest.mark.parametrize("block_bytes", [16 * KIB, 256 * KIB, 2048 * KIB])
def test_every_block_once_within_bounds_and_a_short_last_read(blocks: int,
                                                                block_bytes: int) -> None:
    largest, last = 16 << 20, 1 << 20
    plan = read_plan(blocks, block_bytes, largest, last)
    assert sum(plan) == blocks and all(n >= 1 for n in plan)
    per_read = max(1, largest // block_bytes)
    assert max(plan) <= per_read
    assert plan[-1] <= max(1, last // block_bytes)
    tail = plan[1:]
    assert tail == sorted(tail, reverse=True)  # shrinking toward the end, after the first


def test_sizes_halve_toward_the_end_and_a_small_remainder_joins_the_first() -> None:
    assert read_plan(64, 256 * KIB, 16 << 20, 1 << 20) == [36, 16, 8, 4]
    assert read_plan(4, 256 * KIB, 16 << 20, 1 << 20) == [4]  # one READ, checked in line
    # a read transport's own sizes: 1 MiB READs, the last 512 KiB (a 16 MiB fetch of 256 KiB
    # blocks)
    default = LoopbackTransport()
    assert read_plan(64, 256 * KIB, default.largest_read_bytes,
                     default.last_read_bytes) == [2] + [4] * 15 + [2]
    assert read_plan(8, 256 * KIB, 16 << 20, 1 << 20) == [4, 4]
    assert read_plan(3, 16 * KIB, 16 * KIB, 1 << 20) == [1, 1, 1]  # one block per READ
    assert read_plan(1000, 256 * KIB, 16 << 20, 1 << 20) == (
        [44] + [64] * 14 + [32, 16, 8, 4])
