"""Test doubles and helpers shipped with the product (the `trio.testing` pattern).

- `pattern_block(key, nbytes)`: deterministic bytes derived from a block key, so any reader
  can check that a slot holds exactly the bytes written for that key.
- `random_keys(n, seed)`: distinct 16-byte keys without hashing token ids.
- `RaisingPolicy`: an eviction policy whose every hook raises, to prove the index survives.
- `network_namespaces`: two throwaway network namespaces joined by a veth pair (root only),
  the "two hosts" of peer tests and benchmarks.
Pure and thread-safe, except `network_namespaces` (creates and removes system state).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import subprocess
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


@contextlib.contextmanager
def network_namespaces(tag: str, subnet: int) -> Iterator[tuple[str, str, str] | None]:
    """Namespaces `kvcr<tag>a` (10.201.<subnet>.1) and `kvcr<tag>b` (.2) joined by a veth
    pair; yields (a, b, address of a), or None when they cannot be made (not root, no
    iproute2). Removed on exit, and before creation in case a crashed run left them."""
    names = (f"kvcr{tag}a", f"kvcr{tag}b")

    def remove() -> None:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30,
                           check=False)

    if os.geteuid() != 0 or shutil.which("ip") is None:
        yield None
        return
    a, b = names
    va, vb = f"kvcr{tag}va", f"kvcr{tag}vb"
    steps = [("netns", "add", a), ("netns", "add", b),
             ("link", "add", va, "type", "veth", "peer", "name", vb),
             ("link", "set", va, "netns", a), ("link", "set", vb, "netns", b),
             ("-n", a, "addr", "add", f"10.201.{subnet}.1/24", "dev", va),
             ("-n", b, "addr", "add", f"10.201.{subnet}.2/24", "dev", vb),
             ("-n", a, "link", "set", va, "up"), ("-n", b, "link", "set", vb, "up"),
             ("-n", a, "link", "set", "lo", "up"), ("-n", b, "link", "set", "lo", "up")]
    remove()
    try:
        for step in steps:
            subprocess.run(["ip", *step], check=True, capture_output=True, timeout=30)
    except subprocess.CalledProcessError:
        remove()
        yield None
        return
    try:
        yield a, b, f"10.201.{subnet}.1"
    finally:
        remove()
