"""Eviction policies: they rank READY blocks; the block index (the mechanism) evicts.

Contract for a policy (built-in or `module:Class`, constructed as `Policy(capacity_slots)`):
- `on_ready(slot, key)`: a block became READY (resident). Called once per residency.
- `on_access(slot, key)`: a resident block was read (a lease was taken on it).
- `on_remove(slot, key, evicted)`: the residency ended (`evicted` False when it was dropped
  for another reason, e.g. cleared).
- optional `on_ready_many(slots, keys)` / `on_access_many(slots, keys)`: the same for a batch,
  in order (the index calls them once per batch when present; it loops otherwise).
- `victims()`: resident slots in eviction order, best victim first. The mechanism skips slots
  that are leased and stops iterating before it mutates anything, so an iterator over live
  structures is fine.
A policy never frees memory and never sees a FILLING block. The index survives a policy that
raises or yields nonsense (it falls back to a scan), so a buggy plug-in costs hit rate, never
correctness.

Threading: called only under the owning index's lock.
"""

from __future__ import annotations

import array
import importlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from kvcr_core.errors import ConfigError
from kvcr_core.types import BlockKey, SlotId


@runtime_checkable
class EvictionPolicy(Protocol):
    def on_ready(self, slot: SlotId, key: BlockKey) -> None: ...

    def on_access(self, slot: SlotId, key: BlockKey) -> None: ...

    def on_remove(self, slot: SlotId, key: BlockKey, evicted: bool) -> None: ...

    def victims(self) -> Iterator[SlotId]: ...


class LRUPolicy:
    """Least recently used first. An intrusive doubly linked list in two int arrays
    (8 bytes per slot), so 1M blocks cost 8 MB and every hook is O(1)."""

    name = "lru"

    def __init__(self, capacity_slots: int) -> None:
        self._head = capacity_slots  # sentinel: _next[head] = LRU, _prev[head] = MRU
        self._next = array.array("i", [-1]) * (capacity_slots + 1)
        self._prev = array.array("i", [-1]) * (capacity_slots + 1)
        self._next[self._head] = self._head
        self._prev[self._head] = self._head

    def _link_mru(self, slot: int) -> None:
        head, prev, nxt = self._head, self._prev, self._next
        last = prev[head]
        nxt[last] = slot
        prev[slot] = last
        nxt[slot] = head
        prev[head] = slot

    def _unlink(self, slot: int) -> None:
        prev, nxt = self._prev, self._next
        p, n = prev[slot], nxt[slot]
        if p < 0:
            return
        nxt[p] = n
        prev[n] = p
        prev[slot] = nxt[slot] = -1

    def on_ready(self, slot: SlotId, key: BlockKey) -> None:
        self._link_mru(slot)

    def on_access(self, slot: SlotId, key: BlockKey) -> None:
        self._unlink(slot)
        self._link_mru(slot)

    def on_remove(self, slot: SlotId, key: BlockKey, evicted: bool) -> None:
        self._unlink(slot)

    def on_ready_many(self, slots: Sequence[SlotId], keys: Sequence[BlockKey]) -> None:
        self.on_access_many(slots, keys)

    def on_access_many(self, slots: Sequence[SlotId], keys: Sequence[BlockKey]) -> None:
        """Moves each slot to the MRU end, in order: one loop, locals only (hot path)."""
        head, prev, nxt = self._head, self._prev, self._next
        for slot in slots:
            p = prev[slot]
            if p >= 0:
                n = nxt[slot]
                nxt[p] = n
                prev[n] = p
            last = prev[head]
            nxt[last] = slot
            prev[slot] = last
            nxt[slot] = head
            prev[head] = slot

    def victims(self) -> Iterator[SlotId]:
        head, nxt = self._head, self._next
        slot = nxt[head]
        while slot != head:
            following = nxt[slot]
            yield SlotId(slot)
            slot = following


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha): recency list T1 and frequency list T2,
    with ghost lists B1/B2 of recently evicted keys steering the target size of T1. Blocks
    seen twice (T2) survive scans of one-off prompts. Ghosts are bounded by capacity each."""

    name = "arc"

    def __init__(self, capacity_slots: int) -> None:
        self._capacity = capacity_slots
        self._t1: OrderedDict[BlockKey, SlotId] = OrderedDict()
        self._t2: OrderedDict[BlockKey, SlotId] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self._target_t1 = 0.0

    def on_ready(self, slot: SlotId, key: BlockKey) -> None:
        if key in self._b1:
            self._target_t1 = min(
                float(self._capacity),
                self._target_t1 + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = slot
        elif key in self._b2:
            self._target_t1 = max(
                0.0, self._target_t1 - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = slot
        else:
            self._t1[key] = slot

    def on_access(self, slot: SlotId, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = slot
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, slot: SlotId, key: BlockKey, evicted: bool) -> None:
        if self._t1.pop(key, None) is not None:
            ghosts = self._b1
        elif self._t2.pop(key, None) is not None:
            ghosts = self._b2
        else:
            return
        if evicted:
            ghosts[key] = None
            while len(ghosts) > self._capacity:
                ghosts.popitem(last=False)

    def victims(self) -> Iterator[SlotId]:
        first, second = (self._t1, self._t2) if len(self._t1) > self._target_t1 else (
            self._t2, self._t1)
        yield from first.values()
        yield from second.values()


BUILTIN_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def resolve_policy(name: str) -> type[EvictionPolicy]:
    """A built-in policy by name, or any class given as `package.module:ClassName`."""
    if name in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[name]
    module_name, sep, class_name = name.partition(":")
    if not sep or not module_name or not class_name:
        raise ConfigError("eviction_policy", name,
                          f"use {', '.join(BUILTIN_POLICIES)} or 'package.module:ClassName'")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("eviction_policy", name, f"cannot load it ({exc}); check the "
                          "module is installed and the class name is spelled right") from None
    missing = [m for m in ("on_ready", "on_access", "on_remove", "victims")
               if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError("eviction_policy", name,
                          f"the class lacks {', '.join(missing)}; see kvcr_core.eviction")
    return cls  # type: ignore[no-any-return]


def make_policy(name: str, capacity_slots: int) -> EvictionPolicy:
    return resolve_policy(name)(capacity_slots)  # type: ignore[call-arg]
