"""Fleet identities: each node (and each router) has its own Ed25519 key instead of a secret
every node shares, so one compromised node can neither pose as another nor pass its bytes
off as another's, and revoking it is one line in the fleet file.

- `NodeKey`: a node's private key, a file holding the base64 of its 32-byte seed (`kvcr fleet
  keygen` writes one, mode 0600, and prints the public key to list).
- `Fleet`: the fleet file every node and router reads (YAML or JSON): `nodes` (name ->
  base64 public key: peers that may fetch and serve), `routers` (name -> public key: may only
  read inventories), `revoked` (names no longer trusted, whatever else says).
- `FleetCredential`: what a Runner or router authenticates with: its key, its name (the
  fleet entry of its public key) and the fleet, re-read when the file changes (`refresh`).
  It proves itself by signing both nonces of a handshake, checks peers the same way, signs
  the origin manifests of the blocks it serves (kvcr_core.peers.origins) and checks those it
  receives. `PeerSecret` (kvcr_core.peers.auth) is the older credential: one shared secret,
  no names, no origins.

cryptography is imported here only, when a fleet credential is made (engines without a
fleet never import it). Thread-safe (the fleet is swapped whole under a lock).
"""

from __future__ import annotations

import base64
import dataclasses
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol

import yaml

from kvcr_core.errors import ConfigError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

_DOMAIN: Final = b"kvcr-peer-v3|"
_REFRESH_S: Final = 2.0  # the fleet file is looked at no more often than this
MAX_NODES: Final = 4096
_FIX_KEY = "make one with `kvcr fleet keygen --out FILE` and list its public key"


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who authenticated: a node name (empty with a shared secret), and whether it is a
    router (inventories only)."""

    name: str
    router: bool = False


class PeerCredential(Protocol):
    """What peer handshakes need of a credential (a `FleetCredential` or a `PeerSecret`)."""

    @property
    def name(self) -> str: ...

    def prove(self, role: bytes, mine: bytes, theirs: bytes) -> bytes: ...

    def identify(self, role: bytes, node: str, mine: bytes, theirs: bytes,
                 proof: bytes) -> Identity | None: ...

    def identify_again(self, identity: Identity) -> bool:
        """Whether `identity`, authenticated before, is still trusted (revocation)."""
        ...


def _ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise ConfigError("peer_fleet", None, "fleet identities need the `cryptography` "
                          "package: pip install cryptography") from None
    return ed25519


def _decode_key(text: str, what: str) -> bytes:
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 32:
        raise ConfigError(what, text[:16] + "...", "give the base64 of a 32-byte Ed25519 key; "
                          + _FIX_KEY)
    return raw


class NodeKey:
    __slots__ = ("_private", "public")

    def __init__(self, seed: bytes) -> None:
        self._private: Ed25519PrivateKey = _ed25519().Ed25519PrivateKey.from_private_bytes(seed)
        self.public = public_bytes(self._private.public_key())

    @classmethod
    def generate(cls) -> tuple[NodeKey, str]:
        """A new key and the text of its file."""
        seed = os.urandom(32)
        return cls(seed), base64.b64encode(seed).decode() + "\n"

    @classmethod
    def from_file(cls, path: str) -> NodeKey:
        try:
            with open(path, encoding="ascii") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("peer_node_key_file", path, f"cannot read it ({exc}); "
                              + _FIX_KEY) from None
        return cls(_decode_key(text, "peer_node_key_file"))

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)

    def __repr__(self) -> str:
        return f"NodeKey(public={base64.b64encode(self.public).decode()})"


def public_bytes(key: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclasses.dataclass(frozen=True)
class Fleet:
    nodes: Mapping[str, bytes]
    routers: Mapping[str, bytes]
    revoked: frozenset[str]

    @classmethod
    def load(cls, path: str) -> Fleet:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError("peer_fleet_file", path, f"cannot read it ({exc}); see "
                              "docs/peers.md for its format") from None
        return cls.from_mapping(data, path)

    @classmethod
    def from_mapping(cls, data: object, path: str = "") -> Fleet:
        if not isinstance(data, Mapping) or not set(data) <= {"nodes", "routers", "revoked"}:
            raise ConfigError("peer_fleet_file", path, "give a mapping with `nodes` (name: "
                              "public key), optional `routers` and `revoked` (names)")
        tables: dict[str, dict[str, bytes]] = {}
        for table in ("nodes", "routers"):
            entries = data.get(table) or {}
            if not isinstance(entries, Mapping) or len(entries) > MAX_NODES:
                raise ConfigError(f"peer_fleet_file.{table}", path,
                                  f"give at most {MAX_NODES} `name: public key` entries")
            tables[table] = {str(name): _decode_key(str(key), f"peer_fleet_file.{table}.{name}")
                             for name, key in entries.items()}
        both = set(tables["nodes"]) & set(tables["routers"])
        if both:
            raise ConfigError("peer_fleet_file", sorted(both)[0],
                              "a name is a node or a router, not both")
        revoked = data.get("revoked") or []
        if not isinstance(revoked, list) or not all(isinstance(n, str) for n in revoked):
            raise ConfigError("peer_fleet_file.revoked", revoked, "give a list of names")
        return cls(tables["nodes"], tables["routers"], frozenset(revoked))

    def key_of(self, name: str) -> tuple[bytes, bool] | None:
        """(public key, is a router) of a trusted name; None if unknown or revoked."""
        if name in self.revoked:
            return None
        if name in self.nodes:
            return self.nodes[name], False
        if name in self.routers:
            return self.routers[name], True
        return None


class FleetCredential:
    """A Runner's (or router's) identity in a fleet; see the module docstring."""

    def __init__(self, key: NodeKey, fleet_path: str, *,
                 clock: Any = time.monotonic) -> None:
        self.key = key
        self.fleet_path = fleet_path
        self._clock = clock
        self._lock = threading.Lock()
        self._fleet = Fleet.load(fleet_path)
        self._mtime = _mtime(fleet_path)
        self._checked = clock()
        self._verifiers: dict[bytes, Any] = {}
        mine = [n for n, k in {**self._fleet.nodes, **self._fleet.routers}.items()
                if k == key.public]
        if len(mine) != 1:
            pub = base64.b64encode(key.public).decode()
            raise ConfigError("peer_fleet_file", fleet_path,
                              f"list this node's public key once (e.g. `nodes: {{NAME: {pub}}}`)")
        self._name = mine[0]

    @property
    def name(self) -> str:
        return self._name

    @property
    def fleet(self) -> Fleet:
        return self._fleet

    def refresh(self) -> frozenset[str]:
        """Re-reads the fleet file if it changed (at most every 2 s); returns the names it
        newly revokes (or drops). A file that no longer parses keeps the last good fleet."""
        now = self._clock()
        if now - self._checked < _REFRESH_S:
            return frozenset()
        self._checked = now
        mtime = _mtime(self.fleet_path)
        if mtime == self._mtime:
            return frozenset()
        try:
            fresh = Fleet.load(self.fleet_path)
        except ConfigError:
            return frozenset()
        with self._lock:
            old, self._fleet, self._mtime = self._fleet, fresh, mtime
        trusted_before = (set(old.nodes) | set(old.routers)) - old.revoked
        trusted_now = (set(fresh.nodes) | set(fresh.routers)) - fresh.revoked
        return frozenset(trusted_before - trusted_now)

    def trusted(self, name: str) -> bool:
        return self._fleet.key_of(name) is not None

    def identify_again(self, identity: Identity) -> bool:
        self.refresh()
        return self.trusted(identity.name)

    def prove(self, role: bytes, mine: bytes, theirs: bytes) -> bytes:
        return self.key.sign(_handshake(role, self._name, mine, theirs))

    def identify(self, role: bytes, node: str, mine: bytes, theirs: bytes,
                 proof: bytes) -> Identity | None:
        found = self._fleet.key_of(node)
        if found is None or not self.verify(found[0], proof,
                                            _handshake(role, node, mine, theirs)):
            return None
        return Identity(node, found[1])

    def verify(self, public: bytes, signature: bytes, message: bytes) -> bool:
        verifier = self._verifiers.get(public)
        if verifier is None:
            verifier = _ed25519().Ed25519PublicKey.from_public_bytes(public)
            if len(self._verifiers) >= 2 * MAX_NODES:
                self._verifiers.clear()
            self._verifiers[public] = verifier
        try:
            verifier.verify(signature, message)
        except Exception:  # InvalidSignature, or a malformed one
            return False
        return True


def _handshake(role: bytes, node: str, mine: bytes, theirs: bytes) -> bytes:
    return _DOMAIN + role + b"|" + node.encode() + b"|" + mine + theirs


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime_ns / 1e9
    except OSError:
        return -1.0
