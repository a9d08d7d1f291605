"""The shared peer secret and the HMAC challenge-response both sides run.

The secret comes from a file or an environment variable (what a Kubernetes Secret provides;
both forms follow one rule: leading and trailing whitespace, a final newline included, is not
part of it), is never logged, and must be strong: at least 32 bytes, not a repetition of a
shorter string, and at least 128 bits by a conservative estimate that sees through words,
years and separators (`estimated_bits`; `kvcr secret generate` makes one). A weak
secret is refused with an error that says so, because an authenticated peer may read the
whole pool. Each side proves it knows the secret by a HMAC-SHA256 over both nonces and its
role, so a recorded exchange cannot be replayed and a server answer cannot be reflected as a
client one. Pure; thread-safe.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import re
import string
from typing import Final

from kvcr_core.errors import ConfigError
from kvcr_core.peers.fleet import Identity

MIN_SECRET_BYTES: Final = 32
MIN_SECRET_BITS: Final = 128
_BASE64 = frozenset(string.ascii_letters + string.digits + "+/=-_")
NONCE_BYTES: Final = 32
_FIX = "make one with `kvcr secret generate` (32 random bytes, base64)"


def estimated_bits(key: bytes) -> float:
    """A conservative estimate of how many bits an attacker must guess: each character is
    worth what its alphabet gives (hex 4 bits, base64 6, other printable 6.5), but a run of
    4+ letters counts as one dictionary word (at most 16 bits), a run of digits as digits
    (3+ of them: 3.3 bits each, 0 for an ascending or descending sequence), and a separator
    after a word or number as 2 bits. Random secrets (`kvcr secret generate`) score close
    to their length times their alphabet (a word is all lower case, capitalised or all upper
    case: mixed-case runs of random base64 are not words); passphrases and names with a year
    score far lower."""
    text = key.decode("latin-1")
    if all(c in string.hexdigits for c in text):
        per_char = 4.0
    elif all(c in _BASE64 for c in text):
        per_char = 6.0
    else:
        per_char = 6.5
    bits = 0.0
    after_word = False
    for run in re.finditer(r"[A-Z]?[a-z]{3,}|[A-Z]{4,}|[0-9]{3,}|[-_ .,:;/]|.", text):
        token = run.group()
        if len(token) >= 4 and token.isalpha():
            bits += min(len(token) * per_char, 16.0)
        elif len(token) >= 3 and token.isdigit():
            steps = {ord(b) - ord(a) for a, b in itertools.pairwise(token)}
            bits += 0.0 if steps in ({1}, {-1}) else len(token) * 3.3
        elif after_word and token in "-_ .,:;/":
            bits += 2.0
        else:
            bits += per_char
        after_word = len(token) >= 3
    return bits


def weakness(key: bytes) -> str | None:
    """Why `key` is too weak to be a peer secret, or None."""
    if len(key) < MIN_SECRET_BYTES:
        return f"it has {len(key)} bytes, fewer than {MIN_SECRET_BYTES}"
    for period in range(1, len(key) // 2 + 1):
        if len(key) % period == 0 and key == key[:period] * (len(key) // period):
            return f"it repeats a {period}-byte string"
    bits = estimated_bits(key)
    if bits < MIN_SECRET_BITS:
        return (f"it looks like words, names or numbers (about {bits:.0f} bits to guess, "
                f"fewer than {MIN_SECRET_BITS})")
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

    @property
    def name(self) -> str:
        return ""  # a shared secret names nobody

    def identify(self, role: bytes, node: str, mine: bytes, theirs: bytes,
                 proof: bytes) -> Identity | None:
        """`PeerCredential.identify`: whoever knows the secret, unnamed."""
        if node or not self.check(role, mine, theirs, proof):
            return None
        return Identity("")

    def identify_again(self, identity: Identity) -> bool:
        return True  # a shared secret cannot revoke anyone

    def __repr__(self) -> str:
        return "PeerSecret(<hidden>)"


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)
