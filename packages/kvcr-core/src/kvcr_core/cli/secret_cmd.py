"""`kvcr secret generate [--out FILE]`: a strong shared peer secret (32 random bytes, base64
URL-safe, 43 characters) on stdout, or written to a new file readable by its owner only (what
`--peer-secret-file` and a Kubernetes Secret take; the environment form works the same).
`kvcr fleet keygen --name NAME --out FILE`: a node's (or router's) Ed25519 key in a new file
(mode 0600), and the line to add to the fleet file on stdout."""

from __future__ import annotations

import base64
import os
import secrets
import sys

from kvcr_core.peers.auth import weakness


def generate_secret() -> str:
    while True:  # a random draw that looks weak is astronomically rare: draw again
        value = secrets.token_urlsafe(32)
        if weakness(value.encode()) is None:
            return value


def _create_private(out: str, text: str, what: str) -> bool:
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        print(f"kvcr: cannot create {out}: {exc.strerror} (it must not exist yet)",
              file=sys.stderr)
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    print(f"wrote a new {what} to {out} (mode 0600)", file=sys.stderr)
    return True


def run_fleet_keygen(out: str, name: str) -> int:
    from kvcr_core.peers.fleet import NodeKey

    key, text = NodeKey.generate()
    if not _create_private(out, text, "fleet key"):
        return 1
    public = base64.b64encode(key.public).decode()
    print(f"# add under `nodes:` (or `routers:`) of the fleet file:\n  {name}: {public}")
    return 0


def run_secret_generate(out: str | None) -> int:
    value = generate_secret()
    if out is None:
        print(value)
        return 0
    return 0 if _create_private(out, value + "\n", "peer secret") else 1
