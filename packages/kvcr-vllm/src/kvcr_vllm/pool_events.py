"""kvcr's pool as vLLM KV events (`KVConnectorBase_V1.take_events`): owns which blocks this
engine announced to a KV-aware router (NVIDIA Dynamo) as held in its host tier.

- `BlockStored` (vLLM's block hashes as its own events publish them, the parent hash, the
  blocks' token ids, the block size, medium `CPU_PINNED`) once a block this engine saved or
  fetched from a peer is READY in kvcr on every TP rank. Blocks are first *pending*: the
  workers commit saves after the step's forward pass, so each `take()` asks the Runner which
  pending blocks are READY (`contains`) and announces those; a block not READY within
  `SETTLE_S` (its save was refused, or evicted at once) is dropped unannounced.
- `BlockRemoved` (same medium) when kvcr no longer holds an announced block: each `take()`
  after `SWEEP_S` re-checks the oldest announced blocks, at most `SWEEP_BLOCKS` of them.
- Bounded: at most `max_blocks` announced (one more removes the oldest, announced as
  removed: a router may under-credit kvcr, never over-credit it) and `MAX_PENDING` pending
  runs (the oldest dropped).
- Never `AllBlocksCleared`: that event means vLLM's own cache; kvcr's pool is not cleared
  with it. `announce_again()` (vLLM reset its cache, and a router may have dropped every tier
  of this worker) announces every held block once more, `AGAIN_BLOCKS` per step (an event
  batch stays small).
- Guarded mode: kvcr-guard's pool is shared by the node's engines, and each engine announces
  only the blocks it saved or fetched; a block another engine saved is credited to that
  engine only, though every engine of the node can load it (docs/dynamo.md).
- A lost Runner announces nothing new (counted by the caller); it never fails a step.

Threading: vLLM's scheduler thread only.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvcr_core.attach import AttachClient, RunnerUnavailable
from kvcr_core.types import BlockKey

MEDIUM = "CPU_PINNED"
SETTLE_S = 5.0
SWEEP_S = 1.0
SWEEP_BLOCKS = 1024
MAX_PENDING = 4096
AGAIN_BLOCKS = 4096
DEFAULT_MAX_BLOCKS = 1 << 16


@dataclasses.dataclass(frozen=True)
class _Block:
    """What an announcement of one block needs, kept small (tokens as packed u32)."""

    keys: tuple[BlockKey, ...]  # per rank
    block_hash: Any  # as vLLM's events publish it (bytes, or int)
    parent: Any
    tokens: bytes

    def token_ids(self) -> list[int]:
        return array.array("I", self.tokens).tolist()


@dataclasses.dataclass
class _Run:
    blocks: list[_Block]
    since: float


class PoolEvents:
    """Announces kvcr blocks as vLLM KV events; `take()` once per engine step."""

    def __init__(self, clients: Sequence[AttachClient], block_size: int, *,
                 max_blocks: int = DEFAULT_MAX_BLOCKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clients = list(clients)
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._clock = clock
        self._pending: collections.deque[_Run] = collections.deque(maxlen=MAX_PENDING)
        self._announced: collections.OrderedDict[tuple[BlockKey, ...], _Block] = \
            collections.OrderedDict()
        self._next_sweep = clock() + SWEEP_S
        self._again: collections.deque[tuple[BlockKey, ...]] = collections.deque()
        self.lost_runner = 0  # take() calls that could not ask the Runner

    def track(self, request: Any, start: int, end: int,
              keys_by_rank: Sequence[Sequence[BlockKey]]) -> None:
        """Blocks [start, end) of `request` were saved or fetched: announce them once READY.
        Blocks vLLM has not hashed (yet) are left out, and all of them when vLLM hashes
        blocks of another size (its hash i is then not block i)."""
        hashes = list(getattr(request, "block_hashes", ()) or ())
        tokens = request.all_token_ids
        bs = self.block_size
        if len(hashes) != len(tokens) // bs:
            return
        end = min(end, len(hashes))
        blocks = []
        for i in range(start, end):
            keys = tuple(rank[i] for rank in keys_by_rank)
            if keys in self._announced:
                continue
            blocks.append(_Block(
                keys, maybe_convert_block_hash(hashes[i]),
                maybe_convert_block_hash(hashes[i - 1]) if i > 0 else None,
                array.array("I", tokens[i * bs:(i + 1) * bs]).tobytes()))
        if blocks:
            self._pending.append(_Run(blocks, self._clock()))

    def announce_again(self) -> None:
        """Announce every held block once more, from the next `take()` on."""
        self._again = collections.deque(self._announced)

    def take(self) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = []
        try:
            events += self._stored(self._again_slice())
            events += self._settle()
            if self._clock() >= self._next_sweep:
                self._next_sweep = self._clock() + SWEEP_S
                events += self._sweep()
        except RunnerUnavailable:
            self.lost_runner += 1
        return events

    def _again_slice(self) -> list[_Block]:
        """The next AGAIN_BLOCKS blocks to announce again (those still announced)."""
        blocks: list[_Block] = []
        while self._again and len(blocks) < AGAIN_BLOCKS:
            block = self._announced.get(self._again.popleft())
            if block is not None:
                blocks.append(block)
        return blocks

    def _ready(self, blocks: Sequence[_Block]) -> list[bool]:
        """Whether each block is READY on every rank (raises RunnerUnavailable)."""
        flags = [True] * len(blocks)
        for rank, client in enumerate(self.clients):
            held = client.contains([b.keys[rank] for b in blocks])
            flags = [f and h for f, h in zip(flags, held, strict=True)]
        return flags

    def _settle(self) -> list[KVCacheEvent]:
        """Announces the pending blocks that became READY; keeps the others for SETTLE_S."""
        if not self._pending:
            return []
        runs = list(self._pending)
        ready = self._ready([b for run in runs for b in run.blocks])  # may raise: kept
        self._pending.clear()
        now = self._clock()
        fresh: list[_Block] = []
        at = 0
        for run in runs:
            flags = ready[at:at + len(run.blocks)]
            at += len(run.blocks)
            fresh += [b for b, ok in zip(run.blocks, flags, strict=True)
                      if ok and b.keys not in self._announced]
            waiting = [b for b, ok in zip(run.blocks, flags, strict=True) if not ok]
            if waiting and now - run.since < SETTLE_S:
                self._pending.append(_Run(waiting, run.since))
        events: list[KVCacheEvent] = []
        for block in fresh:
            self._announced[block.keys] = block
        while len(self._announced) > self.max_blocks:
            _, oldest = self._announced.popitem(last=False)
            events.append(self._removed([oldest]))
        return self._stored(fresh) + events

    def _sweep(self) -> list[KVCacheEvent]:
        """Re-checks the oldest announced blocks; those kvcr evicted are announced removed."""
        oldest = list(itertools.islice(self._announced.values(), SWEEP_BLOCKS))
        if not oldest:
            return []
        gone = []
        for block, held in zip(oldest, self._ready(oldest), strict=True):
            if held:
                self._announced.move_to_end(block.keys)
            else:
                del self._announced[block.keys]
                gone.append(block)
        return [self._removed(gone)] if gone else []

    def _stored(self, blocks: Sequence[_Block]) -> list[KVCacheEvent]:
        """One BlockStored per chain of consecutive blocks (each the parent of the next)."""
        events: list[KVCacheEvent] = []
        chain: list[_Block] = []
        for block in [*blocks, None]:
            if chain and (block is None or block.parent != chain[-1].block_hash):
                events.append(BlockStored(
                    block_hashes=[b.block_hash for b in chain], parent_block_hash=chain[0].parent,
                    token_ids=[t for b in chain for t in b.token_ids()],
                    block_size=self.block_size, lora_id=None, medium=MEDIUM, lora_name=None))
                chain = []
            if block is not None:
                chain.append(block)
        return events

    @staticmethod
    def _removed(blocks: Sequence[_Block]) -> KVCacheEvent:
        return BlockRemoved(block_hashes=[b.block_hash for b in blocks], medium=MEDIUM)
