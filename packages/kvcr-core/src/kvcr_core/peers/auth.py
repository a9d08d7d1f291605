"""The shared peer secret and the HMAC challenge-response both sides run.

The secret comes from a file or an environment variable (what a Kubernetes Secret provides),
is never logged, and must hold at least 16 bytes. Each side proves it knows the secret by a
HMAC-SHA256 over both nonces and its role, so a recorded exchange cannot be replayed and a
server answer cannot be reflected as a client one. Pure; thread-safe.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Final

from kvcr_core.errors import ConfigError

MIN_SECRET_BYTES: Final = 16
NONCE_BYTES: Final = 32


class PeerSecret:
    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ConfigError("peer_secret", f"<{len(key)} bytes>",
                              f"use a secret of at least {MIN_SECRET_BYTES} random bytes, e.g. "
                              "`head -c 32 /dev/urandom | base64`")
        self._key = key

    @classmethod
    def from_file(cls, path: str) -> PeerSecret:
        try:
            with open(path, "rb") as f:
                data = f.read().strip()
        except OSError as exc:
            raise ConfigError("peer_secret_file", path, f"cannot read it ({exc.strerror}); "
                              "mount the secret there or fix the path") from None
        return cls(data)

    @classmethod
    def from_env(cls, variable: str) -> PeerSecret:
        value = os.environ.get(variable)
        if not value:
            raise ConfigError("peer_secret_env", variable,
                              f"set {variable} to the shared peer secret")
        return cls(value.encode())

    def prove(self, role: bytes, mine: bytes, theirs: bytes) -> bytes:
        return hmac.new(self._key, b"kvcr-peer-v1|" + role + b"|" + mine + theirs,
                        hashlib.sha256).digest()

    def check(self, role: bytes, mine: bytes, theirs: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(self.prove(role, mine, theirs), mac)

    def __repr__(self) -> str:
        return "PeerSecret(<hidden>)"


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)
