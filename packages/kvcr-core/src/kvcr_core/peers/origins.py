"""Origin tags: every block a fleet node serves carries the node that committed it and that
node's signature over its key and checksum (a `Manifest`, protocol `Origins`), checked by
every receiver, so a node can re-serve blocks it fetched but never pass off bytes of its own
(or of another node) as someone else's, and revoking a node drops its blocks everywhere.

- `OriginBook` (one per namespace store): the manifest of each block fetched from a peer
  (blocks committed here have none: their origin is this node). Bounded by the store's
  slots: past two entries per slot, entries of blocks the store no longer holds go. A block
  committed here again since it was fetched (another checksum) is served as this node's.
- `origins_for(...)`: the source's `Origins` for a fetch's found blocks: stored manifests for
  fetched ones (verbatim), one fresh signed manifest for this node's own.
- `expected_sums(...)`: the destination's check of an `Origins`: every manifest signed by a
  trusted, unrevoked node for this namespace; returns each found key's checksum as its origin
  committed it (a block is kept only if its bytes hash to that) and its manifest.

Cost: one Ed25519 signature per reply at the source (about 40 us here), one verification
per manifest at the destination (about 110 us, on a helper thread while the bytes arrive).
Thread-safe (one lock per book).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterable, Sequence

from kvcr_core.peers import protocol as pp
from kvcr_core.peers.fleet import FleetCredential
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import BlockKey

_DOMAIN = b"kvcr-origin-v1|"
_SUM = struct.Struct("<Q")


def manifest_message(namespace: bytes, origin: str, keys: Sequence[bytes],
                     checksums: Sequence[int]) -> bytes:
    return b"".join((_DOMAIN, namespace, origin.encode(), b"|", *keys,
                     *(_SUM.pack(s) for s in checksums)))


def sign_manifest(credential: FleetCredential, namespace: bytes, keys: Sequence[bytes],
                  checksums: Sequence[int]) -> pp.Manifest:
    message = manifest_message(namespace, credential.name, keys, checksums)
    return pp.Manifest(credential.name, list(keys), list(checksums),
                       credential.key.sign(message))


def manifest_valid(credential: FleetCredential, namespace: bytes, m: pp.Manifest) -> bool:
    found = credential.fleet.key_of(m.origin)
    if found is None or found[1] or len(m.keys) != len(m.checksums):  # routers sign nothing
        return False
    return credential.verify(found[0], m.signature,
                             manifest_message(namespace, m.origin, m.keys, m.checksums))


class OriginBook:
    """Which manifest each fetched block of one namespace came with."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._of: dict[BlockKey, pp.Manifest] = {}

    def __len__(self) -> int:
        return len(self._of)

    def record(self, kept: Iterable[BlockKey], manifests: dict[BlockKey, pp.Manifest],
               store: NamespaceStore) -> None:
        """Remembers the manifests of blocks just fetched into `store`; past two entries per
        slot, those of blocks `store` no longer holds are forgotten."""
        with self._lock:
            for key in kept:
                m = manifests.get(key)
                if m is not None:
                    self._of[key] = m
            if len(self._of) <= 2 * store.index.capacity_slots:
                return
            keys = list(self._of)
            for key, held in zip(keys, store.contains(keys), strict=True):
                if not held:
                    del self._of[key]

    def get(self, key: BlockKey) -> pp.Manifest | None:
        return self._of.get(key)

    def forget(self, keys: Iterable[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._of.pop(key, None)

    def keys_from(self, origins: frozenset[str]) -> list[BlockKey]:
        """The blocks whose origin is one of `origins` (revoked nodes)."""
        with self._lock:
            return [k for k, m in self._of.items() if m.origin in origins]


def origins_for(credential: FleetCredential, book: OriginBook, namespace: bytes, seq: int,
                found: Sequence[tuple[BlockKey, int]]) -> pp.Origins:
    """`found`: (key, committed checksum) of each found block, in order."""
    manifests: list[pp.Manifest] = []
    index: dict[int, int] = {}  # id(stored manifest) -> its place
    own_keys: list[bytes] = []
    own_sums: list[int] = []
    of_found: list[int] = []
    sums_of: dict[int, dict[bytes, int]] = {}
    for key, checksum in found:
        m = book.get(key)
        if m is not None:
            signed = sums_of.setdefault(id(m), dict(zip(m.keys, m.checksums, strict=False)))
            if signed.get(key) != checksum:
                m = None  # committed again here since (its bytes are this node's now)
        if m is None:
            own_keys.append(key)
            own_sums.append(checksum)
            of_found.append(-1)
            continue
        place = index.get(id(m))
        if place is None:
            if len(manifests) >= pp.MAX_MANIFESTS - 1:
                of_found.append(-2)  # too many origins in one reply: not served
                continue
            place = index[id(m)] = len(manifests)
            manifests.append(m)
        of_found.append(place)
    if own_keys:
        manifests.append(sign_manifest(credential, namespace, own_keys, own_sums))
        of_found = [len(manifests) - 1 if i == -1 else i for i in of_found]
    return pp.Origins(seq, manifests, of_found)


Expected = dict[bytes, tuple[int, pp.Manifest]]


def expected_sums(credential: FleetCredential, namespace: bytes, origins: pp.Origins,
                  found_keys: Sequence[bytes]) -> Expected:
    """For each found key whose origin checks out: (the checksum its origin signed, its
    manifest). Keys left out are not to be kept, whatever their bytes."""
    if len(origins.of_found) != len(found_keys):
        return {}
    valid = [manifest_valid(credential, namespace, m) for m in origins.manifests]
    lookup = [dict(zip(m.keys, m.checksums, strict=False)) for m in origins.manifests]
    out: Expected = {}
    for key, place in zip(found_keys, origins.of_found, strict=True):
        if 0 <= place < len(valid) and valid[place]:
            checksum = lookup[place].get(key)
            if checksum is not None:
                out[key] = (checksum, origins.manifests[place])
    return out


class OriginRegistry:
    """The origin books of one Runner's namespaces (its peer server's and clients')."""

    def __init__(self, credential: FleetCredential) -> None:
        self.credential = credential
        self._lock = threading.Lock()
        self._books: dict[bytes, OriginBook] = {}

    def book(self, namespace: bytes) -> OriginBook:
        with self._lock:
            return self._books.setdefault(bytes(namespace), OriginBook())

    def frame_for(self, namespace: bytes) -> Callable[[int, Sequence[tuple[BlockKey, int]]],
                                                       bytes]:
        """What a source connection of `namespace` calls to encode a fetch's Origins."""
        book = self.book(namespace)

        def frame(seq: int, found: Sequence[tuple[BlockKey, int]]) -> bytes:
            return pp.encode(origins_for(self.credential, book, namespace, seq, found))

        return frame

    def revoked(self, names: frozenset[str], runner: Runner) -> int:
        """Drops every block whose origin is one of `names` (just revoked) from `runner`'s
        namespaces; returns how many."""
        dropped = 0
        for digest in runner.namespaces:
            book = self.book(digest)
            keys = book.keys_from(names)
            if not keys:
                continue
            store = runner.namespace(digest)
            with store.lock:
                dropped += store.index.discard(keys)
            book.forget(keys)
        return dropped
