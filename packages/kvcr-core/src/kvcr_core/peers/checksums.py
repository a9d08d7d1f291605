"""`SlotChecksums`: the source side's xxh3-64 of each READY slot, computed once per slot
generation and reused by every later fetch of the same block.

A slot's bytes change only while it is FILLING, and every reservation bumps the slot's
generation (`BlockIndex.generation`), so a checksum taken while the slot was READY at
generation g is the checksum of its bytes for as long as the generation stays g. Keyed by
generation, not by block key: a key evicted and stored again into the same slot (or new bytes
under an old key) always misses. The checksum is of the bytes as they were when first served;
if pool memory were later changed behind the index's back, destinations would see a mismatch
and drop the block, which is the point of a checksum.

Bounded: two 8-byte integers per slot of the namespace. Threading: call `of` only for slots
the caller holds a lease on (their generation cannot change); concurrent callers may compute
the same value twice, harmlessly (the sum is written before its generation).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

from kvcr_core.peers.protocol import checksum
from kvcr_core.runner import NamespaceStore
from kvcr_core.types import SlotId


class SlotChecksums:
    def __init__(self, store: NamespaceStore) -> None:
        self._index = store.index
        self._view = store.pool.view
        slots = store.index.capacity_slots
        self._generation = array.array("Q", [0]) * slots  # 0: never (leased slots have >= 1)
        self._sum = array.array("Q", [0]) * slots
        self.computed = 0  # checksums actually computed (the rest were reused)

    def known(self, slots: Sequence[SlotId]) -> list[int]:
        """The checksums of the leading leased `slots` that are known already (up to the first
        that `of` would hash): one loop, for a whole fetch."""
        now, taken, sums = self._index.generations, self._generation, self._sum
        out: list[int] = []
        for slot in slots:
            if taken[slot] != now[slot]:
                break
            out.append(sums[slot])
        return out

    def of(self, slot: SlotId) -> int:
        """The checksum of leased slot `slot`'s bytes."""
        generation = self._index.generation(slot)
        if self._generation[slot] == generation:
            return self._sum[slot]
        value = checksum(self._view(slot))
        self._sum[slot] = value
        self._generation[slot] = generation
        self.computed += 1
        return value
