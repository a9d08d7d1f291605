"""`TestFleet`: a fleet for tests and benchmarks: a key file per name (`{name}.key`) and a
fleet file (`fleet.yaml`) in one directory; names starting with "router" are routers.
`write(revoked=...)` rewrites the fleet file atomically (what an operator's revocation is).
`forge_origin` makes a node's server lie about its blocks' origin (a compromised node).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import yaml

from kvcr_core.peers import protocol as pp
from kvcr_core.peers.fleet import FleetCredential, NodeKey
from kvcr_core.peers.origins import OriginRegistry, manifest_message


class TestFleet:
    __test__ = False  # not a pytest test class

    def __init__(self, directory: str | Path, names: Iterable[str]) -> None:
        self.dir = Path(directory)
        self.keys: dict[str, NodeKey] = {}
        for name in names:
            key, text = NodeKey.generate()
            path = self.dir / f"{name}.key"
            path.write_text(text)
            path.chmod(0o600)
            self.keys[name] = key
        self.write()

    @property
    def file(self) -> str:
        return str(self.dir / "fleet.yaml")

    def key_file(self, name: str) -> str:
        return str(self.dir / f"{name}.key")

    def credential(self, name: str) -> FleetCredential:
        return FleetCredential(NodeKey.from_file(self.key_file(name)), self.file)

    def write(self, revoked: Iterable[str] = ()) -> None:
        public = {n: base64.b64encode(k.public).decode() for n, k in self.keys.items()}
        Path(self.file + ".new").write_text(yaml.safe_dump({
            "nodes": {n: p for n, p in public.items() if not n.startswith("router")},
            "routers": {n: p for n, p in public.items() if n.startswith("router")},
            "revoked": sorted(revoked)}))
        os.replace(self.file + ".new", self.file)


def forge_origin(origins: OriginRegistry, claim: str) -> None:
    """Makes the server of `origins`' node sign its own blocks' manifests as if `claim` were
    their origin (a compromised node's code: every honest receiver must refuse them)."""
    cred = origins.credential

    def frame_for(namespace: bytes) -> Callable[[int, Sequence[tuple[bytes, int]]], bytes]:
        def frame(seq: int, found: Sequence[tuple[bytes, int]]) -> bytes:
            keys = [k for k, _ in found]
            sums = [s for _, s in found]
            sig = cred.key.sign(manifest_message(namespace, claim, keys, sums))
            return pp.encode(pp.Origins(seq, [pp.Manifest(claim, keys, sums, sig)],
                                        [0] * len(found)))
        return frame

    origins.frame_for = frame_for  # type: ignore[method-assign]
