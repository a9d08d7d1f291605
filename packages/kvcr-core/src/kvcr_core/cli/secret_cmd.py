"""`kvcr secret generate [--out FILE]`: a strong shared peer secret (32 random bytes, base64
URL-safe, 43 characters) on stdout, or written to a new file readable by its owner only (what
`--peer-secret-file` and a Kubernetes Secret take; the environment form works the same)."""

from __future__ import annotations

import os
import secrets
import sys

from kvcr_core.peers.auth import weakness


def generate_secret() -> str:
    while True:  # a random draw that looks weak is astronomically rare: draw again
        value = secrets.token_urlsafe(32)
        if weakness(value.encode()) is None:
            return value


def run_secret_generate(out: str | None) -> int:
    value = generate_secret()
    if out is None:
        print(value)
        return 0
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        print(f"kvcr secret generate: cannot create {out}: {exc.strerror} (it must not exist "
              "yet)", file=sys.stderr)
        return 1
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    print(f"wrote a new peer secret to {out} (mode 0600)", file=sys.stderr)
    return 0
