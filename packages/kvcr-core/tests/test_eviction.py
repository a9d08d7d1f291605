"""Eviction policies rank; selection by name or module:Class; ARC resists one-off scans."""

from __future__ import annotations

import pytest

from kvcr_core.errors import ConfigError
from kvcr_core.eviction import ARCPolicy, LRUPolicy, make_policy, resolve_policy
from kvcr_core.index import BlockIndex
from kvcr_core.testing import RaisingPolicy, random_keys
from kvcr_core.types import BlockKey, SlotId

pytestmark = pytest.mark.unit


def test_lru_order_follows_access() -> None:
    """LRU yields the least recently readied/accessed slot first."""
    lru = LRUPolicy(4)
    keys = random_keys(3)
    for slot, key in enumerate(keys):
        lru.on_ready(SlotId(slot), key)
    lru.on_access(SlotId(0), keys[0])
    assert list(lru.victims()) == [1, 2, 0]
    lru.on_remove(SlotId(2), keys[2], evicted=True)
    assert list(lru.victims()) == [1, 0]


def _hit_rate(policy: str, capacity: int = 20) -> float:
    """Hot set of 10 blocks re-read between one-off scans of 15 cold blocks each."""
    idx = BlockIndex(capacity, make_policy(policy, capacity))
    hot = random_keys(10, seed=1)
    cold = random_keys(300, seed=2)
    hits = asked = 0
    for round_ in range(20):
        for key in hot:
            asked += 1
            lease = idx.acquire([key])
            if lease.granted:
                hits += 1
                idx.release(lease.op)
            else:
                idx.commit(idx.reserve([key]).op)
        for key in cold[round_ * 15:(round_ + 1) * 15]:
            idx.commit(idx.reserve([key]).op)
    return hits / asked


def test_arc_keeps_blocks_seen_twice_through_scans() -> None:
    """ARC protects a re-used hot set from one-off prompts that flush LRU."""
    lru, arc = _hit_rate("lru"), _hit_rate("arc")
    assert lru < 0.1
    assert arc > 0.8


def test_arc_ghost_hit_adapts_and_ghosts_are_bounded() -> None:
    """Re-admitting a recently evicted key goes to the frequency list; ghosts stay bounded."""
    arc = ARCPolicy(2)
    keys = random_keys(10)
    for i, key in enumerate(keys):
        arc.on_ready(SlotId(i % 2), key)
        arc.on_remove(SlotId(i % 2), key, evicted=True)
    assert len(arc._b1) <= 2
    arc.on_ready(SlotId(0), keys[-1])
    assert keys[-1] in arc._t2 and arc._target_t1 > 0


class CountingPolicy(LRUPolicy):
    """A user policy loaded by module path in the test below."""


def test_policy_selectable_by_name_or_module_path() -> None:
    """Users pick built-ins by name and their own class as module:Class."""
    assert resolve_policy("lru") is LRUPolicy
    assert resolve_policy("arc") is ARCPolicy
    assert resolve_policy("kvcr_core.testing:RaisingPolicy") is RaisingPolicy
    assert isinstance(make_policy(f"{__name__}:CountingPolicy", 4), CountingPolicy)


@pytest.mark.parametrize("name,match", [
    ("mru", "use lru, arc"),
    ("no_such_module_xyz:Policy", "cannot load"),
    ("kvcr_core.testing:Nope", "cannot load"),
    ("kvcr_core.testing:random_keys", "lacks"),
])
def test_bad_policy_names_say_how_to_fix(name: str, match: str) -> None:
    """A wrong policy name fails at start-up with the fix, never at the first eviction."""
    with pytest.raises(ConfigError, match=match) as err:
        resolve_policy(name)
    assert err.value.field == "eviction_policy"


def test_victims_of_arc_prefer_recency_list_when_it_is_over_target() -> None:
    """ARC evicts from T1 (seen once) before T2 (seen twice) at the initial target."""
    arc = ARCPolicy(4)
    once, twice = BlockKey(b"a" * 16), BlockKey(b"b" * 16)
    arc.on_ready(SlotId(0), twice)
    arc.on_access(SlotId(0), twice)
    arc.on_ready(SlotId(1), once)
    assert list(arc.victims()) == [1, 0]
