"""Deterministic blocks and keys, and a failing eviction policy, for tests of anything that
stores blocks. Pure; thread-safe."""

from __future__ import annotations

import base64
import hashlib
import random
from collections.abc import Iterator

from kvcr_core.types import KEY_BYTES, BlockKey, SlotId


def pattern_block(key: bytes, nbytes: int) -> bytes:
    """`nbytes` of content that only `key` produces (BLAKE2b-512 of the key, repeated)."""
    unit = hashlib.blake2b(key, digest_size=64).digest()
    reps, rest = divmod(nbytes, len(unit))
    return unit * reps + unit[:rest]


def random_keys(n: int, seed: int = 0) -> list[BlockKey]:
    rng = random.Random(seed)
    return [BlockKey(rng.getrandbits(8 * KEY_BYTES).to_bytes(KEY_BYTES, "little"))
            for _ in range(n)]


class RaisingPolicy:
    """An eviction policy plug-in that fails at every call."""

    name = "raising"

    def __init__(self, capacity_slots: int) -> None:
        self.capacity_slots = capacity_slots

    def on_ready(self, slot: SlotId, key: BlockKey) -> None:
        raise RuntimeError("policy on_ready failed")

    def on_access(self, slot: SlotId, key: BlockKey) -> None:
        raise RuntimeError("policy on_access failed")

    def on_remove(self, slot: SlotId, key: BlockKey, evicted: bool) -> None:
        raise RuntimeError("policy on_remove failed")

    def victims(self) -> Iterator[SlotId]:
        raise RuntimeError("policy victims failed")


def secret_for(label: str) -> str:
    """A strong peer secret derived from `label` (the same label, the same secret): for
    tests and benchmarks, where each side must agree without a file."""
    digest = hashlib.blake2b(label.encode(), digest_size=32).digest()
    return base64.b64encode(digest).decode()
