"""Whole-block copies through anything that hands out pool slots (the `SlotOwner` protocol: a
local `NamespaceStore`, or a client's `RunnerOps` for its first namespace), into and out of
the pool it hands them out of. Write = reserve + copy + commit (abort if the copy fails, so
nothing half-written is published); read = acquire + copy + release. Thread-safety is the
slot owner's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvcr_core.checksums import block_checksum
from kvcr_core.index import Lease, Reservation
from kvcr_core.memory import SlotPool
from kvcr_core.types import BlockKey, OpId


class SlotOwner(Protocol):
    def reserve(self, keys: Sequence[BlockKey]) -> Reservation: ...

    def commit(self, op: OpId, *, checksums: Sequence[int]) -> int: ...

    def abort(self, op: OpId) -> int: ...

    def acquire(self, keys: Sequence[BlockKey], *, prefix_only: bool = True) -> Lease: ...

    def release(self, op: OpId) -> bool: ...


def store_blocks(owner: SlotOwner, pool: SlotPool, keys: Sequence[BlockKey],
                 blocks: Sequence[bytes | memoryview]) -> int:
    """Copies `blocks[i]` in for every key not already present; returns blocks stored."""
    if len(keys) != len(blocks):
        raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
    res = owner.reserve(keys)
    if not res.granted:
        return 0
    sums: list[int] = []
    try:
        for slot, block in zip(res.slots, blocks, strict=True):
            if slot is not None:
                pool.write(slot, block)
                # of what was meant to land, not of the slot: a process of another uid that
                # maps the pool (a shared tenant) could punch or change it between the copy
                # and the hash, and the commit would then vouch for its bytes
                sums.append(block_checksum(block))
    except BaseException:
        owner.abort(res.op)
        raise
    return owner.commit(res.op, checksums=sums)


def load_blocks(owner: SlotOwner, pool: SlotPool, keys: Sequence[BlockKey]) -> list[bytes]:
    """Bytes of the longest READY prefix of `keys`, copied out under a lease."""
    lease = owner.acquire(keys)
    try:
        view = pool.view
        return [bytes(view(slot)) for slot in lease.slots if slot is not None]
    finally:
        owner.release(lease.op)
