"""Inventory events: which blocks a Runner stored and removed, in numbered batches, for
KV-aware routers (wire format: docs/peers.md "Inventory").

The index reports every block that becomes READY and every READY block that goes (evicted or
discarded); `InventoryLog` groups them per namespace into batches with a global sequence
number. Readers poll with the last sequence they saw. The log is bounded (`max_batches`
batches of at most `max_events` events, 8 bytes each: 8 MiB at the defaults); a reader
that fell behind the oldest kept batch gets `reset=True` and must drop what it knew of this
runner, then rebuild from what follows.
Events carry the `kvcr-v1` router hashes of the keys; `epoch` changes when the runner
restarts (a reader seeing a new epoch starts over). Thread-safe.
"""

from __future__ import annotations

import array
import dataclasses
import os
import sys
import threading
from collections import deque

from kvcr_core.keys import router_hash_kvcr_v1
from kvcr_core.types import KEY_BYTES, BlockKey, NamespaceDigest


@dataclasses.dataclass(frozen=True)
class InventoryBatch:
    seq: int
    namespace: bytes
    stored: array.array[int]  # router hashes (u64) of blocks that became READY
    removed: array.array[int]  # router hashes of READY blocks that went away


class InventoryLog:
    def __init__(self, max_batches: int = 256, max_events: int = 4096) -> None:
        self.max_events = max_events
        self._lock = threading.Lock()
        self._batches: deque[InventoryBatch] = deque(maxlen=max_batches)
        self._open: dict[bytes, tuple[list[BlockKey], list[BlockKey]]] = {}
        self._open_events = 0
        self._open_keys_sized = True  # every open key is KEY_BYTES long (see _hashes)
        self._next_seq = 1
        self.epoch = int.from_bytes(os.urandom(8), "little")  # this incarnation of the runner

    def stored(self, namespace: NamespaceDigest, keys: list[BlockKey]) -> None:
        self._add(namespace, keys, 0)

    def removed(self, namespace: NamespaceDigest, keys: list[BlockKey]) -> None:
        self._add(namespace, keys, 1)

    def _add(self, namespace: bytes, keys: list[BlockKey], which: int) -> None:
        with self._lock:  # keys now, hashes at sealing: the index's hot path stays cheap
            entry = self._open.get(namespace)
            if entry is None:
                entry = self._open[namespace] = ([], [])
            entry[which].extend(keys)
            self._open_events += len(keys)
            if self._open_keys_sized and set(map(len, keys)) - {KEY_BYTES}:
                self._open_keys_sized = False
            if self._open_events >= self.max_events:
                self._seal()

    def _seal(self) -> None:
        """Closes the open events into batches of at most `max_events` stored and as many
        removed hashes each (one store of many keys becomes several batches), so any batch
        fits a peer frame."""
        step = self.max_events
        for namespace, (stored, removed) in self._open.items():
            for start in range(0, max(len(stored), len(removed)), step):
                self._batches.append(InventoryBatch(
                    self._next_seq, namespace, self._hashes(stored[start:start + step]),
                    self._hashes(removed[start:start + step])))
                self._next_seq += 1
        self._open.clear()
        self._open_events = 0
        self._open_keys_sized = True

    def _hashes(self, keys: list[BlockKey]) -> array.array[int]:
        """`router_hash_kvcr_v1` of each key (its first 8 bytes, little-endian). For keys of
        KEY_BYTES (16) each, done in C as every other u64 of the keys end to end, about 40
        times faster than key by key: sealing runs inside whichever store filled the batch."""
        if not self._open_keys_sized:
            return array.array("Q", map(router_hash_kvcr_v1, keys))
        words = array.array("Q", b"".join(keys))
        if sys.byteorder == "big":
            words.byteswap()
        return words[::KEY_BYTES // 8]

    def read(self, since: int, max_batches: int = 256) -> tuple[bool, list[InventoryBatch]]:
        """(reset, batches with seq > since), sealing what is pending first."""
        with self._lock:
            self._seal()
            oldest = self._batches[0].seq if self._batches else self._next_seq
            reset = since + 1 < oldest
            out = [b for b in self._batches if b.seq > since][:max_batches]
        return reset, out

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._next_seq - 1
