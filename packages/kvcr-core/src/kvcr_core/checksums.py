"""Block checksums: xxh3-64 of a block's bytes (`block_checksum`), and `SlotChecksums`, the
checksum of each READY slot of one namespace as its writer fixed it when it committed.

Every writer hashes each block right after its copy (while the bytes are in its cache) and
sends the checksums with the commit (`Commit(op, checksums)` on the attach protocol;
`NamespaceStore.commit` hashes for in-process writers that pass none); a peer fetch records
the checksum each block was verified against. Peers are served these recorded checksums and
`verify_loads` checks local loads against them, so a block whose pool bytes were changed
after its commit (a buggy or hostile process writing into its mapping) fails every check
instead of being served as good.

Keyed by slot generation, not by block key: every reservation bumps the slot's generation
(`BlockIndex.generation`), so a recorded checksum belongs to the bytes of one commit only; a
slot with no checksum recorded for its current generation is hashed on first use (`of`).
Bounded: two 8-byte integers per slot. Threading: `record` runs under the store's lock; `of`
and `known` only for slots the caller holds a lease on (their generation cannot change).
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import xxhash

from kvcr_core.types import SlotId

if TYPE_CHECKING:
    from kvcr_core.index import BlockIndex


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """The xxh3-64 of one block's bytes (what commits carry and peers verify)."""
    return xxhash.xxh3_64_intdigest(data)


def block_checksum_nogil(data: bytes | bytearray | memoryview) -> int:
    """`block_checksum`, computed with the GIL released (the binding's streaming update
    releases it; its one-shot function does not): for hashing threads. About a quarter
    slower than `block_checksum` on one thread."""
    state = xxhash.xxh3_64()
    state.update(data)
    return state.intdigest()


def parts_checksum(parts: Iterable[bytes | bytearray | memoryview]) -> int:
    """`block_checksum` of the concatenation of `parts` (a block spread over several
    buffers, such as one engine's KV planes), without joining them."""
    state = xxhash.xxh3_64()
    for part in parts:
        state.update(part)
    return state.intdigest()


class SlotChecksums:
    def __init__(self, index: BlockIndex, view: Callable[[SlotId], memoryview]) -> None:
        self._index = index
        self._view = view
        slots = index.capacity_slots
        self._generation = array.array("Q", [0]) * slots  # 0: never (leased slots have >= 1)
        self._sum = array.array("Q", [0]) * slots
        self.computed = 0  # checksums hashed here (not recorded by a writer)

    def record(self, slots: Iterable[SlotId], sums: Iterable[int]) -> None:
        """The checksums the writer fixed for freshly committed `slots`."""
        now, taken, values = self._index.generations, self._generation, self._sum
        for slot, value in zip(slots, sums, strict=True):
            values[slot] = value
            taken[slot] = now[slot]

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
        """The checksum of leased slot `slot`'s bytes as committed."""
        generation = self._index.generation(slot)
        if self._generation[slot] == generation:
            return self._sum[slot]
        value = block_checksum(self._view(slot))
        self._sum[slot] = value
        self._generation[slot] = generation
        self.computed += 1
        return value
