"""kvcr's pool as vLLM KV events (`KVConnectorBase_V1.take_events`): owns which blocks this
engine announced to a KV-aware router (NVIDIA Dynamo) as held in its host tier.

- `BlockStored` (vLLM's block hashes as its own events publish them, the parent hash, the
  blocks' token ids, the block size, medium `CPU_PINNED`) once a block this engine saved or
  fetched from a peer is READY in kvcr on every TP rank. A planned save is *pending* until
  every rank's worker reported its commit (`saved`, from the workers' `WorkerReport`: saves
  report back like loads, nothing is polled); a block not reported within `SETTLE_S` (its
  save was refused, or failed) is dropped unannounced. A fetch announces what it made READY
  on every rank (`fetched`).
- `BlockRemoved` (same medium) when kvcr no longer holds an announced block, as the Runner's
  inventory log says (`RunnerOps.removed_since`: the same log that feeds peers and routers),
  followed from the first `take()` on and read at most every `SWEEP_S`; a removal of a
  pending block drops it. When the log cannot
  say (the Runner restarted, or this reader fell behind it) or a worker's report is
  `suspect`, every announced block is announced removed: a router may under-credit kvcr,
  never over-credit it.
- Bounded: at most `max_blocks` announced (one more removes the oldest, announced as
  removed) and `MAX_PENDING` pending blocks (the oldest dropped).
- Never `AllBlocksCleared`: that event means vLLM's own cache; kvcr's pool is not cleared
  with it. `announce_again()` (vLLM reset its cache, and a router may have dropped every tier
  of this worker) announces every held block once more, `AGAIN_BLOCKS` per step.
- Guarded mode: kvcr-guard's pool is shared by the node's engines, and each engine announces
  only the blocks it saved or fetched; a block another engine saved is credited to that
  engine only, though every engine of the node can load it (docs/dynamo.md).
- Blocks of salted, LoRA and multimodal requests are not announced: a router matches events by token
  ids (and a LoRA name vLLM's events would carry), so it could credit them to requests of
  another salt or none; under-credit, never over-credit.
- A lost Runner announces no removal (counted by the caller); it never fails a step.

Threading: vLLM's scheduler thread only.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvcr_core.attach import RunnerError, RunnerOps
from kvcr_core.keys import router_hash_kvcr_v1
from kvcr_core.types import BlockKey, FetchStatus

MEDIUM = "CPU_PINNED"
SETTLE_S = 5.0
SWEEP_S = 1.0
MAX_PENDING = 1 << 16
AGAIN_BLOCKS = 4096
DEFAULT_MAX_BLOCKS = 1 << 16
_READY = (FetchStatus.OK, FetchStatus.PRESENT)

Keys = tuple[BlockKey, ...]  # one block's key per rank


@dataclasses.dataclass(frozen=True)
class _Block:
    """What an announcement of one block needs, kept small (tokens as packed u32)."""

    keys: Keys
    block_hash: Any  # as vLLM's events publish it (bytes, or int)
    parent: Any
    tokens: bytes

    def token_ids(self) -> list[int]:
        return array.array("I", self.tokens).tolist()


@dataclasses.dataclass
class _Pending:
    block: _Block
    waiting: set[int]  # ranks whose commit is not reported yet
    since: float


class PoolEvents:
    """Announces kvcr blocks as vLLM KV events; `take()` once per engine step."""

    def __init__(self, runner: RunnerOps, block_size: int, *,
                 max_blocks: int = DEFAULT_MAX_BLOCKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._clock = clock
        self._pending: collections.OrderedDict[Keys, _Pending] = collections.OrderedDict()
        self._announced: collections.OrderedDict[Keys, _Block] = collections.OrderedDict()
        self._by_hash: dict[tuple[int, int], Keys] = {}  # (rank, router hash) -> block
        self._by_key: dict[bytes, Keys] = {}  # any rank's key -> block
        self._fresh: list[_Block] = []  # READY, to announce at the next take()
        self._gone: list[_Block] = []  # announced, to announce removed at the next take()
        self._again: collections.deque[Keys] = collections.deque()
        self._cursor: tuple[int, int] | None = None  # (log epoch, last batch read)
        self._next_sweep = clock() + SWEEP_S
        self.lost_runner = 0  # take() calls that could not ask the Runner

    # -- what happened to blocks ---------------------------------------------------------------

    def planned(self, request: Any, start: int, end: int,
                keys_by_rank: Sequence[Sequence[BlockKey]]) -> None:
        """Blocks [start, end) of `request` are being saved: announce each once every rank
        reported its commit."""
        now = self._clock()
        for block in self._blocks(request, start, end, keys_by_rank):
            if block.keys in self._announced or block.keys in self._pending:
                continue
            self._pending[block.keys] = _Pending(block, set(range(len(block.keys))), now)
            self._index(block.keys)
            if len(self._pending) > MAX_PENDING:
                self._forget(self._pending.popitem(last=False)[0])

    def saved(self, keys: Iterable[bytes], *, suspect: bool = False) -> None:
        """The workers committed these keys (any rank's)."""
        if suspect:
            gone = list(self._announced.values())
            self._announced.clear()
            self._gone += gone
            for block in gone:
                self._forget(block.keys)
        for key in keys:
            found = self._by_key.get(key)
            pending = self._pending.get(found) if found is not None else None
            if pending is not None and found is not None:
                pending.waiting.discard(found.index(BlockKey(key)))
        done = [keys for keys, pending in self._pending.items() if not pending.waiting]
        self._fresh += [self._pending.pop(keys).block for keys in done]  # in planned order

    def fetched(self, request: Any, start: int, keys_by_rank: Sequence[Sequence[BlockKey]],
                statuses: Sequence[Sequence[FetchStatus]]) -> None:
        """A fetch of blocks [start, ...) ended with these per-rank statuses."""
        ready = [all(rank[i] in _READY for rank in statuses) for i in range(len(statuses[0]))]
        for i, block in enumerate(self._blocks(request, start, start + len(ready),
                                               keys_by_rank)):
            if ready[i] and block.keys not in self._announced:
                self._pending.pop(block.keys, None)
                self._index(block.keys)
                self._fresh.append(block)

    def announce_again(self) -> None:
        """Announce every held block once more, from the next `take()` on."""
        self._again = collections.deque(self._announced)

    # -- events --------------------------------------------------------------------------------

    def take(self) -> list[KVCacheEvent]:
        now = self._clock()
        if now >= self._next_sweep or self._cursor is None:
            self._next_sweep = now + SWEEP_S
            self._read_removals()
        while self._pending and now - next(iter(self._pending.values())).since >= SETTLE_S:
            self._forget(self._pending.popitem(last=False)[0])
        events: list[KVCacheEvent] = []
        if self._gone:
            events.append(self._removed(self._gone))
            self._gone = []
        events += self._stored(self._again_slice())
        fresh, self._fresh = [b for b in self._fresh if b.keys not in self._announced], []
        for block in fresh:
            self._announced[block.keys] = block
        while len(self._announced) > self.max_blocks:
            _, oldest = self._announced.popitem(last=False)
            self._forget(oldest.keys)
            events.append(self._removed([oldest]))
        return self._stored(fresh) + events

    def _read_removals(self) -> None:
        """Applies what the Runner's inventory log says left kvcr since the last read."""
        try:
            if self._cursor is None:
                start = self.runner.removed_since(-1)
                self._cursor = (start.epoch, start.seq)
                return
            epoch, since = self._cursor
            answer = self.runner.removed_since(since)
        except RunnerError:
            self.lost_runner += 1
            return
        if answer.epoch != epoch or answer.reset:  # restarted, or fell behind: assume gone
            self.saved((), suspect=True)
        self._cursor = (answer.epoch, answer.seq)
        for rank, hashes in enumerate(answer.hashes):
            for router_hash in hashes:
                self._drop((rank, router_hash))

    def _drop(self, where: tuple[int, int]) -> None:
        keys = self._by_hash.get(where)
        if keys is None:
            return
        block = self._announced.pop(keys, None)
        if block is not None:
            self._gone.append(block)
        self._pending.pop(keys, None)
        self._fresh = [b for b in self._fresh if b.keys != keys]
        self._forget(keys)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _blocks(self, request: Any, start: int, end: int,
                keys_by_rank: Sequence[Sequence[BlockKey]]) -> list[_Block]:
        """Blocks [start, end) of `request` that vLLM hashed (none when vLLM hashes blocks
        of another size: its hash i is then not block i)."""
        hashes = list(getattr(request, "block_hashes", ()) or ())
        tokens = request.all_token_ids
        bs = self.block_size
        if len(hashes) != len(tokens) // bs:
            return []
        return [_Block(tuple(rank[i] for rank in keys_by_rank),
                       maybe_convert_block_hash(hashes[i]),
                       maybe_convert_block_hash(hashes[i - 1]) if i > 0 else None,
                       array.array("I", tokens[i * bs:(i + 1) * bs]).tobytes())
                for i in range(start, min(end, len(hashes)))]

    def _index(self, keys: Keys) -> None:
        for rank, key in enumerate(keys):
            self._by_hash[(rank, router_hash_kvcr_v1(key))] = keys
            self._by_key[key] = keys

    def _forget(self, keys: Keys) -> None:
        """Unindexes a block neither pending nor announced any more."""
        if keys in self._announced or keys in self._pending:
            return
        for rank, key in enumerate(keys):
            where = (rank, router_hash_kvcr_v1(key))
            if self._by_hash.get(where) == keys:
                del self._by_hash[where]
            if self._by_key.get(key) == keys:
                del self._by_key[key]

    def _again_slice(self) -> list[_Block]:
        """The next AGAIN_BLOCKS blocks to announce again (those still announced)."""
        blocks: list[_Block] = []
        while self._again and len(blocks) < AGAIN_BLOCKS:
            block = self._announced.get(self._again.popleft())
            if block is not None:
                blocks.append(block)
        return blocks

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
