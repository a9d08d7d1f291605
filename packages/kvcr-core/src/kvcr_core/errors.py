"""The kvcr exception tree. Every error says whose fault it is and, where it can, the fix.

- `ConfigError`: the user's settings are wrong (names the field, the value and the fix).
- `HintRejected`: a router hint is unusable; the caller goes on without it.
- `CapacityError`: the pool or a bounded table is full; the caller recomputes.
- `ClosedError`: *you* used an object after closing it.
- `UnknownNamespaceError`: a namespace was used before it was opened.
"""

from __future__ import annotations

import enum
from typing import Any


class KVCRError(Exception):
    """Base of every error kvcr raises on purpose."""


class ConfigError(KVCRError, ValueError):
    """A configuration value is invalid. Names the field, the value and the fix."""

    def __init__(self, field: str, value: Any, fix: str) -> None:
        self.field = field
        self.value = value
        self.fix = fix
        super().__init__(f"invalid config {field}={value!r}: {fix}")


class HintRejectReason(enum.Enum):
    """Bounded label set for rejected KV hints (used as a metrics label)."""

    BAD_JSON = "bad_json"
    TOO_LARGE = "too_large"
    NOT_A_MAPPING = "not_a_mapping"
    BAD_ACTIONS = "bad_actions"
    TOO_MANY_ACTIONS = "too_many_actions"
    NO_USABLE_ACTION = "no_usable_action"
    BAD_PAYLOAD = "bad_payload"
    BAD_ENDPOINT = "bad_endpoint"
    BAD_HASHES = "bad_hashes"
    TOO_MANY_HASHES = "too_many_hashes"
    UNSUPPORTED_MODE = "unsupported_mode"
    UNSUPPORTED_OPTION = "unsupported_option"


class HintRejected(KVCRError, ValueError):
    """A KV hint was refused. The request proceeds without it (fail open)."""

    def __init__(self, reason: HintRejectReason, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"invalid kv_hint ({reason.value}): {detail}")


class CapacityError(KVCRError):
    """A bounded resource (pool slots, reservation or lease table) is exhausted."""


class ClosedError(KVCRError):
    """The object was closed by its owner and cannot be used any more."""


class UnknownNamespaceError(KVCRError, KeyError):
    """A namespace digest was used before `Runner.open_namespace`."""
