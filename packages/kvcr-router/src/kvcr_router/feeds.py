"""Block feeds into the `BlockIndexer`: kvcr runner inventory (pool tier) and vLLM's own KV
events (device tier), one asyncio task per worker and feed.

- `InventoryFeed` polls the worker's kvcr peer endpoint with an `InventoryReader` (blocking,
  run on a feed executor thread) and applies the batches of the router's namespace on the
  event loop; batches of other namespaces still advance the sequence (so they are not read
  as loss). A failed poll clears the worker's pool view (route without its credit) and the
  next poll re-syncs from the runner's oldest kept batch, with a backoff up to 5 s.
- `KvEventsFeed` subscribes to vLLM's ZMQ KV event publisher (`--kv-events-config`,
  research notes: multipart `(topic, seq u64 big-endian, msgpack EventBatch)`) and turns
  `BlockStored` events into kvcr router hashes with `VllmEventTranslator`: vLLM names blocks by
  its own hashes, but each event carries the token ids and the parent's vLLM hash, so the
  translator chains kvcr keys through a bounded map of vLLM hash -> kvcr key. A parent it does
  not know, a LoRA/multimodal/salted block or another medium is skipped (under-credit, never
  over-credit). A sequence that goes backwards is an engine restart (new epoch).
  pyzmq is imported lazily (`pip install pyzmq`; vLLM already depends on it).
Threading: the indexer is touched only on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

from kvcr_core.keys import block_keys, router_hash_kvcr_v1
from kvcr_core.peers import InventoryBatch, InventorySource
from kvcr_router.indexer import BlockIndexer, Tier
from kvcr_router.metrics import RouterMetrics

log = logging.getLogger("kvcr_router")
MAX_BACKOFF_S = 5.0


class InventoryFeed:
    def __init__(self, worker: str, namespace: bytes, new_reader: Callable[[], InventorySource],
                 indexer: BlockIndexer, metrics: RouterMetrics, executor: Executor,
                 interval_s: float) -> None:
        self.worker = worker
        self.namespace = namespace
        self.new_reader = new_reader
        self.indexer = indexer
        self.metrics = metrics
        self.executor = executor
        self.interval_s = interval_s
        self.up = False
        self._reader: InventorySource | None = None
        self._own_seen = False
        self._warned: set[str] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self.interval_s
        while True:
            reader = self._reader = self._reader or self.new_reader()
            try:
                reset, batches = await loop.run_in_executor(self.executor, reader.poll)
            except Exception as exc:  # any fault: drop credit, re-sync later (fail open)
                self._lost(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
                continue
            delay = self.interval_s
            self.metrics.feed_polls.labels(self.worker, "inventory", "ok").inc()
            self.up = True
            self.apply(reader.epoch or 0, reset, batches)
            if not batches:
                await asyncio.sleep(self.interval_s)

    def apply(self, epoch: int, reset: bool, batches: Sequence[InventoryBatch]) -> None:
        if reset:
            self.indexer.apply(self.worker, Tier.POOL, epoch, 0, (), (), reset=True)
        stored = self.metrics.feed_blocks.labels(self.worker, "inventory", "stored")
        removed = self.metrics.feed_blocks.labels(self.worker, "inventory", "removed")
        for batch in batches:
            if batch.namespace == self.namespace:
                self._own_seen = True
                self.indexer.apply(self.worker, Tier.POOL, epoch, batch.seq, batch.stored,
                                   batch.removed)
                stored.inc(len(batch.stored))
                removed.inc(len(batch.removed))
            else:  # still a step in the runner's numbering, or it would look like loss
                self.indexer.apply(self.worker, Tier.POOL, epoch, batch.seq, (), ())
                self._note_foreign(batch.namespace)

    def _note_foreign(self, namespace: bytes) -> None:
        if not self._own_seen and "foreign" not in self._warned:
            self._warned.add("foreign")
            log.warning("worker %s's runner stores blocks of namespace %s, which is not the "
                        "router's %s (another model, TP rank or tenant; if it should be this "
                        "one, check --namespace)", self.worker, namespace.hex(),
                        self.namespace.hex())

    def _lost(self, exc: Exception) -> None:
        self.metrics.feed_polls.labels(self.worker, "inventory", "failed").inc()
        if self.up or type(exc).__name__ not in self._warned:
            self._warned.add(type(exc).__name__)
            log.warning("inventory of worker %s unavailable (%s: %s): routing without its pool "
                        "credit until it answers", self.worker, type(exc).__name__, exc)
        self.up = False
        if self._reader is not None:
            self._reader.close()
            self._reader = None  # the next reader starts from the runner's oldest batch
        self.indexer.apply(self.worker, Tier.POOL, 0, 0, (), (), reset=True)


class VllmEventTranslator:
    """vLLM `BlockStored`/`BlockRemoved` events -> kvcr router hashes. Bounded, pure."""

    def __init__(self, namespace: bytes, block_size: int, max_blocks: int = 1_000_000) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._keys: OrderedDict[object, bytes] = OrderedDict()

    def clear(self) -> None:
        self._keys.clear()

    def stored(self, event: Mapping[str, Any]) -> list[int]:
        hashes, tokens = event.get("block_hashes"), event.get("token_ids")
        if (event.get("block_size") != self.block_size or event.get("medium") not in (None, "GPU")
                or event.get("lora_id") is not None or event.get("lora_name") is not None
                or event.get("group_idx") not in (None, 0)
                or any(k is not None for k in event.get("extra_keys") or ())
                or not isinstance(hashes, list) or not isinstance(tokens, list)):
            return []
        parent = event.get("parent_block_hash")
        parent_key = self.namespace if parent is None else self._keys.get(_hashable(parent))
        if parent_key is None:
            return []  # its chain started before we listened: cannot name it in kvcr keys
        try:
            keys = block_keys(parent_key, tokens, self.block_size)
        except ValueError:
            return []
        out: list[int] = []
        for vllm_hash, key in zip(hashes, keys, strict=False):
            h = _hashable(vllm_hash)
            self._keys[h] = key
            self._keys.move_to_end(h)
            out.append(router_hash_kvcr_v1(key))
        while len(self._keys) > self.max_blocks:
            self._keys.popitem(last=False)
        return out

    def removed(self, event: Mapping[str, Any]) -> list[int]:
        if event.get("medium") not in (None, "GPU"):
            return []
        keys = (self._keys.get(_hashable(h)) for h in event.get("block_hashes") or ())
        return [router_hash_kvcr_v1(k) for k in keys if k is not None]


def _hashable(value: object) -> object:
    return bytes(value) if isinstance(value, bytes | bytearray | list) else value


class KvEventsFeed:
    def __init__(self, worker: str, endpoint: str, translator: VllmEventTranslator,
                 indexer: BlockIndexer, metrics: RouterMetrics) -> None:
        self.worker = worker
        self.endpoint = endpoint
        self.translator = translator
        self.indexer = indexer
        self.metrics = metrics
        self.epoch = 0
        self._last_seq = -1

    async def run(self) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    seq = int.from_bytes(frames[-2], "big")
                    batch = msgspec.msgpack.decode(frames[-1])
                    events = batch[1] if isinstance(batch, list) else batch["events"]
                except (IndexError, KeyError, TypeError, msgspec.DecodeError):
                    self.metrics.feed_polls.labels(self.worker, "kv_events", "failed").inc()
                    continue
                self.metrics.feed_polls.labels(self.worker, "kv_events", "ok").inc()
                self.apply(seq, events)
        finally:
            sock.close(linger=0)

    def apply(self, seq: int, events: Sequence[Any]) -> None:
        """One publisher message: its sequence number and its events, in order."""
        if seq <= self._last_seq:  # the engine restarted and numbers from 0 again
            self.epoch += 1
            self.translator.clear()
        self._last_seq = seq
        stored: list[int] = []
        removed: list[int] = []
        reset = False
        for event in events:
            kind = event.get("type") if isinstance(event, Mapping) else None
            if kind == "BlockStored":
                stored += self.translator.stored(event)
            elif kind == "BlockRemoved":
                removed += self.translator.removed(event)
            elif kind == "AllBlocksCleared":
                reset, stored, removed = True, [], []
        # seq + 1: the indexer's numbering starts at 1; vLLM's at 0.
        self.indexer.apply(self.worker, Tier.DEVICE, self.epoch, seq + 1, stored, removed,
                           reset=reset)
        self.metrics.feed_blocks.labels(self.worker, "kv_events", "stored").inc(len(stored))
        self.metrics.feed_blocks.labels(self.worker, "kv_events", "removed").inc(len(removed))

    def lost(self) -> None:
        """The worker failed its health check: forget its engine cache until events return."""
        self.indexer.apply(self.worker, Tier.DEVICE, self.epoch, 0, (), (), reset=True)
