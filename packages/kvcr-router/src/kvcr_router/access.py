"""Who may see what the fleet's caches hold: `/kvcr/explain` and the `x-kvcr-*` headers.

Those answers say which blocks of a prompt some worker holds, so anyone who may ask them can
test a guessed prompt (another tenant's document, say) against the cache. `CacheDetailsGate`
allows them for every request when `expose_cache_details` is set, and otherwise only for a
request whose `X-KVCR-Operator-Token` header equals the operator token (compared in constant
time). The token comes from `operator_token_file`, or else from the environment variable
`operator_token_env` when it is set and not empty; with neither, nobody sees details. A
wrong or missing token is treated as no token. The front never forwards the header (it
forwards only the headers it names).
Thread-safe (immutable after construction); reading the token is a start-up step.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

from kvcr_core.errors import ConfigError
from kvcr_router.config import RouterConfig

OPERATOR_TOKEN_HEADER = "X-KVCR-Operator-Token"
MIN_TOKEN_CHARS = 16
_FIX = "use at least 16 visible ASCII characters, e.g. `openssl rand -hex 32`"


class CacheDetailsGate:
    def __init__(self, expose: bool, token: bytes | None) -> None:
        self.expose = expose
        self._token = token

    @classmethod
    def from_config(cls, config: RouterConfig,
                    environ: Mapping[str, str] | None = None) -> CacheDetailsGate:
        """Reads the operator token (file first, then the environment); a `ConfigError` if
        the file cannot be read or the token is weak or not a valid header value."""
        environ = os.environ if environ is None else environ
        if config.operator_token_file is not None:
            try:
                with open(config.operator_token_file, "rb") as f:
                    raw = f.read()
            except OSError as exc:
                raise ConfigError("operator_token_file", config.operator_token_file,
                                  f"cannot read it ({exc.strerror}); fix the path") from None
            return cls(config.expose_cache_details, _token("operator_token_file", raw))
        value = environ.get(config.operator_token_env, "").strip()
        if not value:  # unset (or empty): no operator token
            return cls(config.expose_cache_details, None)
        raw = value.encode("utf-8", "replace")
        return cls(config.expose_cache_details, _token("operator_token_env", raw))

    @property
    def closed(self) -> bool:
        """True when no request can see details (explain then answers as if absent)."""
        return not self.expose and self._token is None

    def allows(self, headers: Mapping[str, str]) -> bool:
        if self.expose:
            return True
        given = headers.get(OPERATOR_TOKEN_HEADER)
        if self._token is None or given is None:
            return False
        return hmac.compare_digest(given.encode("utf-8", "replace"), self._token)

    def __repr__(self) -> str:
        return f"CacheDetailsGate(expose={self.expose}, token={self._token is not None})"


def _token(field: str, raw: bytes) -> bytes:
    token = raw.strip()
    if len(token) < MIN_TOKEN_CHARS or not all(0x21 <= b <= 0x7E for b in token):
        raise ConfigError(field, f"<{len(token)} bytes>", f"the operator token is unusable; "
                          f"{_FIX}")
    return token
