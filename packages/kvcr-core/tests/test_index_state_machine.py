"""Hypothesis state machine over the index and a real slot pool: the safety invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from kvcr_core.eviction import ARCPolicy, LRUPolicy
from kvcr_core.index import BlockIndex
from kvcr_core.memory import RegionKind, SlotPool
from kvcr_core.testing import pattern_block
from kvcr_core.types import BlockKey, OpId, OwnerId, SlotState

pytestmark = pytest.mark.unit

CAPACITY = 5
BLOCK = 128
KEYS = [BlockKey(bytes([i]) * 16) for i in range(12)]


class IndexMachine(RuleBasedStateMachine):
    """Random reserve/commit/abort/acquire/release/lookup against the real index and pool."""

    reservations = Bundle("reservations")
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.policy_name = "lru"
        self.index = BlockIndex(CAPACITY, LRUPolicy(CAPACITY), max_reservations=4, max_leases=4)
        self.pool = SlotPool.create(CAPACITY, BLOCK, RegionKind.ANONYMOUS)
        self.leased: dict[OpId, list[tuple[BlockKey, int]]] = {}

    def teardown(self) -> None:
        self.pool.close()

    @rule(policy=st.sampled_from(["lru", "arc"]))
    @precondition(lambda self: self.index.used_slots == 0 and self.index.open_leases == 0)
    def restart_with_policy(self, policy: str) -> None:
        cls = LRUPolicy if policy == "lru" else ARCPolicy
        self.index = BlockIndex(CAPACITY, cls(CAPACITY), max_reservations=4, max_leases=4)

    @rule(target=reservations, keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
          torn=st.booleans())
    def reserve(self, keys: list[BlockKey], torn: bool) -> OpId:
        res = self.index.reserve(keys)
        assert len(res.slots) == len(keys)
        for key, slot in zip(keys, res.slots, strict=True):
            if slot is None:
                continue
            assert self.index.state_of(slot) is SlotState.FILLING
            data = pattern_block(key, BLOCK)
            # A torn write: only half the bytes land (what a crash mid-copy leaves).
            self.pool.view(slot)[: BLOCK // 2 if torn else BLOCK] = data[: BLOCK // 2 if torn
                                                                             else BLOCK]
        return res.op

    @rule(op=reservations)
    def commit(self, op: OpId) -> None:
        record = self.index._ops.get(op)
        if record is not None and record.writing:
            for key, slot in zip(record.keys, record.slots, strict=True):
                self.pool.view(slot)[:] = pattern_block(key, BLOCK)  # finish the write
        self.index.commit(op)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=3, max_size=6, unique=True))
    def store_under_pressure(self, keys: list[BlockKey]) -> None:
        res = self.index.reserve(keys)
        for key, slot in zip(keys, res.slots, strict=True):
            if slot is not None:
                self.pool.view(slot)[:] = pattern_block(key, BLOCK)
        self.index.commit(res.op)

    @rule(op=reservations)
    def abort(self, op: OpId) -> None:
        self.index.abort(op)

    @rule(target=leases, keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
          prefix=st.booleans())
    def acquire(self, keys: list[BlockKey], prefix: bool) -> OpId:
        lease = self.index.acquire(keys, prefix_only=prefix)
        held = [(k, s) for k, s in zip(keys, lease.slots, strict=True) if s is not None]
        for key, slot in held:
            assert bytes(self.pool.view(slot)) == pattern_block(key, BLOCK)
        if lease.granted:
            self.leased[lease.op] = held
        return lease.op

    @rule(op=leases)
    def release(self, op: OpId) -> None:
        known = op in self.leased
        assert self.index.release(op) == known
        self.leased.pop(op, None)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def lookup_has_no_side_effects(self, keys: list[BlockKey]) -> None:
        before = self._snapshot()
        n = self.index.lookup(keys)
        after = self._snapshot()
        assert before == after
        assert all(self.index.slot_of(k) is not None for k in keys[:n])
        assert n == len(keys) or self.index.slot_of(keys[n]) is None

    @rule(target=reservations, keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def client_dies_mid_write(self, keys: list[BlockKey]) -> OpId:
        dead = OwnerId(99)
        res = self.index.reserve(keys, dead)
        for slot in res.slots:
            if slot is not None:
                self.pool.view(slot)[:8] = b"partial!"
        self.index.drop_owner(dead)
        assert self.index.ops_of(dead) == frozenset()
        return res.op

    def _snapshot(self) -> tuple[object, ...]:
        idx = self.index
        return (dict(idx._ready), bytes(idx._state), idx.open_reservations, idx.open_leases,
                idx.free_slots, list(idx.policy.victims()))

    @invariant()
    def ready_slots_hold_their_own_bytes(self) -> None:
        for key, slot in self.index._ready.items():
            assert self.index.key_of(slot) == key
            assert bytes(self.pool.view(slot)) == pattern_block(key, BLOCK)

    @invariant()
    def leased_blocks_are_never_evicted(self) -> None:
        for held in self.leased.values():
            for key, slot in held:
                assert self.index.slot_of(key) == slot
                assert self.index.lease_count(slot) > 0

    @invariant()
    def capacity_and_accounting(self) -> None:
        idx = self.index
        assert idx.used_slots + idx.free_slots == CAPACITY
        assert 0 <= idx.used_slots <= CAPACITY
        states = [idx.state_of(s) for s in range(CAPACITY)]
        assert states.count(SlotState.READY) == idx.ready_blocks
        assert states.count(SlotState.FILLING) == idx.filling_blocks
        assert idx.open_reservations <= idx.max_reservations
        assert idx.open_leases <= idx.max_leases


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
TestIndexInvariants = IndexMachine.TestCase
