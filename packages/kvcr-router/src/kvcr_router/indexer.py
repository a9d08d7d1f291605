"""`BlockIndexer`: where each block is, per worker and tier, from runner inventory events.

A worker is identified by name; tiers are `Tier.DEVICE` (the engine's own cache, from the
engine's KV events) and `Tier.POOL` (the node's kvcr pool, from kvcr inventory batches).
Events arrive in numbered batches per source (with the source's epoch); a batch not newer
than the last applied is ignored (reordering, duplicates), a gap or a `reset` clears that
source's view (loss: what follows rebuilds it), and a new epoch (restart) clears it too.
Bounded: at most `max_blocks_per_source` hashes per source; past that the oldest are
forgotten (the router then under-credits, never over-credits). Pure data; not thread-safe
(one router thread).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice, takewhile


class Tier(enum.Enum):
    DEVICE = "device"
    POOL = "pool"


class _Source:
    __slots__ = ("blocks", "epoch", "seq")

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.seq = 0
        self.blocks: OrderedDict[int, None] = OrderedDict()


class BlockIndexer:
    def __init__(self, max_blocks_per_source: int = 1_000_000) -> None:
        self.max_blocks = max_blocks_per_source
        self._sources: dict[tuple[str, Tier], _Source] = {}
        self.clears = 0

    def apply(self, worker: str, tier: Tier, epoch: int, seq: int, stored: Iterable[int],
              removed: Iterable[int], *, reset: bool = False) -> bool:
        """Applies one batch; returns False if it was stale (already applied, or older)."""
        source = self._sources.setdefault((worker, tier), _Source())
        if reset or epoch != source.epoch:  # told to, or the runner restarted
            self._clear(source, epoch)
        if seq <= source.seq:
            return False  # reordered or duplicated
        if source.seq and seq > source.seq + 1:
            self._clear(source, epoch)  # events were lost: rebuild from what follows
        source.seq = seq
        blocks = source.blocks
        for h in stored:  # stored before removed: a block both stored and evicted within one
            blocks[h] = None  # batch ends up absent (under-credit, never over-credit)
            blocks.move_to_end(h)
        for h in removed:
            blocks.pop(h, None)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
        return True

    def _clear(self, source: _Source, epoch: int) -> None:
        if source.blocks:
            self.clears += 1
        source.blocks.clear()
        source.epoch = epoch
        source.seq = 0

    def workers(self) -> list[str]:
        return sorted({w for w, _ in self._sources})

    def prefix(self, worker: str, tier: Tier, hashes: Sequence[int]) -> int:
        """Longest prefix of `hashes` this worker holds in `tier`."""
        source = self._sources.get((worker, tier))
        if source is None:
            return 0
        # takewhile over the dict's own __contains__ runs in C: an 8k-token prompt's 512
        # lookups per worker and tier are what bounds the router's decision time.
        return len(list(takewhile(source.blocks.__contains__, hashes)))

    def run_from(self, worker: str, tier: Tier, hashes: Sequence[int], start: int) -> int:
        """End of the contiguous run of `hashes` held from `start` (== start if none)."""
        source = self._sources.get((worker, tier))
        if source is None:
            return start
        return start + len(list(takewhile(source.blocks.__contains__,
                                          islice(hashes, start, None))))
