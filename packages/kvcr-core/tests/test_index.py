"""The block index: states, leases, capacity, eviction and per-owner cleanup."""

from __future__ import annotations

import pytest

from kvcr_core.eviction import LRUPolicy
from kvcr_core.index import NO_OP, BlockIndex
from kvcr_core.testing import RaisingPolicy, random_keys
from kvcr_core.types import OwnerId, SlotState

pytestmark = pytest.mark.unit


def make(capacity: int = 4, **kw: int) -> BlockIndex:
    return BlockIndex(capacity, LRUPolicy(capacity), **kw)


def test_filling_blocks_are_invisible_until_commit() -> None:
    """A reserved block is invisible to lookup and acquire until commit (no torn reads)."""
    idx = make()
    keys = random_keys(3)
    res = idx.reserve(keys)
    assert res.granted == 3 and None not in res.slots
    assert idx.lookup(keys) == 0
    assert idx.acquire(keys).granted == 0
    assert idx.commit(res.op) == 3
    assert idx.lookup(keys) == 3
    assert all(idx.state_of(s) is SlotState.READY for s in res.slots if s is not None)


def test_abort_frees_slots_and_publishes_nothing() -> None:
    """An aborted write leaves no READY block and returns its slots to the pool."""
    idx = make()
    keys = random_keys(4)
    res = idx.reserve(keys)
    assert idx.free_slots == 0
    assert idx.abort(res.op) == 4
    assert idx.free_slots == 4 and idx.lookup(keys) == 0
    assert idx.commit(res.op) == 0  # a dead op cannot be revived


def test_reserve_skips_present_and_in_flight_keys() -> None:
    """A key already READY or being written elsewhere is not written twice."""
    idx = make(8)
    a, b, c = random_keys(3)
    idx.commit(idx.reserve([a]).op)
    first = idx.reserve([b])
    second = idx.reserve([a, b, c, c])
    assert second.slots[0] is None and second.slots[1] is None
    assert second.slots[2] is not None and second.slots[3] is None
    assert second.granted == 1 and first.granted == 1


def test_lookup_is_longest_ready_prefix() -> None:
    """lookup counts READY blocks from the start and stops at the first hole."""
    idx = make(8)
    keys = random_keys(5)
    idx.commit(idx.reserve([keys[0], keys[1], keys[3]]).op)
    assert idx.lookup(keys) == 2
    assert idx.lookup(keys[3:]) == 1
    assert idx.lookup([]) == 0


def test_lru_evicts_least_recent_and_never_leased() -> None:
    """Full pool: the least recently used unleased block goes; leased blocks stay."""
    idx = make(3)
    k = random_keys(6)
    for key in k[:3]:
        idx.commit(idx.reserve([key]).op)
    lease = idx.acquire([k[0]])  # k0 is leased (and most recent); k1 is now LRU
    idx.commit(idx.reserve([k[3]]).op)
    assert idx.contains(k[:4]) == [True, False, True, True]
    idx.commit(idx.reserve([k[4]]).op)  # evicts k2, not the leased k0
    assert idx.contains([k[0], k[2], k[4]]) == [True, False, True]
    assert idx.evictions == 2
    assert idx.release(lease.op) and not idx.release(lease.op)


def test_old_lease_survives_pressure_from_newer_blocks() -> None:
    """A block leased long ago (now least recent) is skipped by eviction while leased."""
    idx = make(3)
    k = random_keys(5)
    idx.commit(idx.reserve(k[:1]).op)
    lease = idx.acquire(k[:1])
    idx.commit(idx.reserve(k[1:3]).op)
    idx.commit(idx.reserve(k[3:5]).op)
    assert idx.contains(k) == [True, False, False, True, True]
    assert idx.release(lease.op)


def test_capacity_refusal_when_everything_is_leased_or_filling() -> None:
    """Beyond capacity the request is refused (never blocks, never exceeds capacity)."""
    idx = make(2)
    a, b, c, d = random_keys(4)
    idx.commit(idx.reserve([a]).op)
    lease = idx.acquire([a])
    open_res = idx.reserve([b])
    refused = idx.reserve([c, d])
    assert refused.granted == 0 and refused.refused == 2 and refused.op == NO_OP
    assert idx.used_slots == 2
    idx.release(lease.op)
    assert idx.reserve([c]).granted == 1  # a is evictable again
    assert idx.abort(open_res.op) == 1


def test_sequence_head_outlives_its_tail_under_lru() -> None:
    """Committing a chain makes its head most recent, so LRU trims chains from the tail."""
    idx = make(4)
    chain = random_keys(4, seed=1)
    idx.commit(idx.reserve(chain).op)
    other = random_keys(1, seed=2)
    idx.commit(idx.reserve(other).op)
    assert idx.lookup(chain) == 3


def test_tables_are_bounded() -> None:
    """Open reservations and leases are capped; excess requests are refused, not queued."""
    idx = make(16, max_reservations=2, max_leases=1)
    keys = random_keys(6)
    idx.reserve(keys[0:1])
    idx.reserve(keys[1:2])
    assert idx.reserve(keys[2:3]).refused == 1
    idx.commit(1)  # type: ignore[arg-type]
    assert idx.acquire(keys[0:1]).granted == 1
    assert idx.acquire(keys[0:1]).granted == 0


def test_drop_owner_reclaims_reservations_and_leases() -> None:
    """A dead client's FILLING blocks never become READY and its leases are released."""
    idx = make(4)
    keys = random_keys(3)
    idx.commit(idx.reserve(keys[:1]).op)
    dead = OwnerId(7)
    idx.acquire(keys[:1], dead)
    idx.reserve(keys[1:], dead)
    assert idx.drop_owner(dead) == (2, 1)
    assert idx.lease_count(idx.slot_of(keys[0])) == 0  # type: ignore[arg-type]
    assert idx.lookup(keys) == 1 and idx.filling_blocks == 0 and idx.ops_of(dead) == frozenset()


def test_foreign_ops_cannot_be_committed_or_released() -> None:
    """A client can only commit, abort or release its own ops (op ids are guessable)."""
    idx = make(4)
    keys = random_keys(2)
    alice, mallory = OwnerId(1), OwnerId(2)
    res = idx.reserve(keys[:1], alice)
    assert idx.commit(res.op, mallory) == 0 and idx.abort(res.op, mallory) == 0
    assert idx.commit(res.op, alice) == 1
    lease = idx.acquire(keys[:1], alice)
    assert not idx.release(lease.op, mallory)
    assert idx.release(lease.op, alice)


def test_acquire_prefix_only_and_per_key() -> None:
    """acquire stops at the first miss by default; per-key mode leases every READY key."""
    idx = make(8)
    keys = random_keys(3)
    idx.commit(idx.reserve([keys[0], keys[2]]).op)
    prefix = idx.acquire(keys)
    assert prefix.granted == 1 and prefix.slots[1:] == (None, None)
    each = idx.acquire(keys, prefix_only=False)
    assert each.granted == 2 and each.slots[1] is None and each.slots[2] is not None


def test_raising_policy_cannot_break_the_index() -> None:
    """A plug-in policy that raises costs hit rate, never correctness or availability."""
    idx = BlockIndex(2, RaisingPolicy(2))
    keys = random_keys(4)
    for key in keys:
        assert idx.commit(idx.reserve([key]).op) == 1
    assert idx.ready_blocks == 2 and idx.evictions == 2 and idx.policy_faults > 0


def test_discard_drops_only_unleased_ready_blocks() -> None:
    """Discarding known-bad blocks never pulls a block out from under a reader."""
    idx = make(4)
    a, b = random_keys(2)
    idx.commit(idx.reserve([a, b]).op)
    idx.acquire([a])
    assert idx.discard([a, b]) == 1
    assert idx.contains([a, b]) == [True, False]


def test_invalid_capacity_refused() -> None:
    """A zero-slot index is a configuration bug, reported at construction."""
    with pytest.raises(ValueError, match="at least one slot"):
        make(0)


def test_settle_publishes_only_the_intact_blocks() -> None:
    """A transfer where some blocks arrived corrupt publishes only the good ones."""
    idx = make(4)
    keys = random_keys(3)
    res = idx.reserve(keys)
    assert idx.settle(res.op, [keys[0], keys[2]]) == (2, 1)
    assert idx.contains(keys) == [True, False, True]
    assert idx.free_slots == 2 and idx.filling_blocks == 0
    assert idx.settle(res.op, keys) == (0, 0)  # settled ops are gone


def test_a_slots_generation_changes_with_every_reservation_and_only_then() -> None:
    """Whatever is derived from a READY slot's bytes (a peer source's cached checksum) can
    trust the slot's generation: every reservation, evicting ones too, bumps it; reads don't."""
    idx = make(capacity=1)
    first, second = random_keys(2)
    res = idx.reserve([first])
    slot = res.slots[0]
    assert slot is not None and idx.generation(slot) == 1
    idx.commit(res.op)
    lease = idx.acquire([first])
    assert idx.generation(slot) == 1  # leased reads change nothing
    idx.release(lease.op)
    res = idx.reserve([second])  # evicts `first`, reuses its slot
    assert res.slots == (slot,) and idx.generation(slot) == 2
    idx.abort(res.op)
    assert idx.generation(slot) == 2 and idx.reserve([first]).slots == (slot,)
    assert idx.generation(slot) == 3
