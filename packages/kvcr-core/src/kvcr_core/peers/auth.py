"""The shared peer secret and the HMAC challenge-response both sides run.

The secret comes from a file or an environment variable (what a Kubernetes Secret provides;
both forms follow one rule: leading and trailing whitespace, a final newline included, is not
part of it), is never logged, and must be strong: at least 32 bytes, not a repetition of a
shorter string, with enough distinct characters (`kvcr secret generate` makes one). A weak
secret is refused with an error that says so, because an authenticated peer may read the
whole pool. Each side proves it knows the secret by a HMAC-SHA256 over both nonces and its
role, so a recorded exchange cannot be replayed and a server answer cannot be reflected as a
client one. Pure; thread-safe.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Final

from kvcr_core.errors import ConfigError

MIN_SECRET_BYTES: Final = 32
MIN_DISTINCT_BYTES: Final = 12
NONCE_BYTES: Final = 32
_FIX = "make one with `kvcr secret generate` (32 random bytes, base64)"


def weakness(key: bytes) -> str | None:
    """Why `key` is too weak to be a peer secret, or None."""
    if len(key) < MIN_SECRET_BYTES:
        return f"it has {len(key)} bytes, fewer than {MIN_SECRET_BYTES}"
    if len(set(key)) < MIN_DISTINCT_BYTES:
        return f"it uses {len(set(key))} distinct characters, fewer than {MIN_DISTINCT_BYTES}"
    for period in range(1, len(key) // 2 + 1):
        if len(key) % period == 0 and key == key[:period] * (len(key) // period):
            return f"it repeats a {period}-byte string"
    return None


class PeerSecret:
    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        why = weakness(key)
        if why is not None:
            raise ConfigError("peer_secret", f"<{len(key)} bytes>",
                              f"the peer secret is weak ({why}); {_FIX}")
        self._key = key

    @classmethod
    def from_file(cls, path: str) -> PeerSecret:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ConfigError("peer_secret_file", path, f"cannot read it ({exc.strerror}); "
                              "mount the secret there or fix the path") from None
        return cls(data.strip())

    @classmethod
    def from_env(cls, variable: str) -> PeerSecret:
        value = os.environ.get(variable, "").encode().strip()
        if not value:
            raise ConfigError("peer_secret_env", variable,
                              f"set {variable} to the shared peer secret ({_FIX})")
        return cls(value)

    def prove(self, role: bytes, mine: bytes, theirs: bytes) -> bytes:
        return hmac.new(self._key, b"kvcr-peer-v1|" + role + b"|" + mine + theirs,
                        hashlib.sha256).digest()

    def check(self, role: bytes, mine: bytes, theirs: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(self.prove(role, mine, theirs), mac)

    def __repr__(self) -> str:
        return "PeerSecret(<hidden>)"


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)
