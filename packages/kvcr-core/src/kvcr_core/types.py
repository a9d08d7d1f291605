"""Vocabulary shared by every kvcr module: ids as NewTypes, states as Enums.

Owns no behaviour. Everything here is immutable and cheap to import.
"""

from __future__ import annotations

import enum
from typing import NewType

BlockKey = NewType("BlockKey", bytes)
"""128-bit chained block key (16 bytes); see docs/keys.md."""

NamespaceDigest = NewType("NamespaceDigest", bytes)
"""16-byte digest of everything that makes KV bytes incompatible."""

RouterHash = NewType("RouterHash", int)
"""Unsigned 64-bit projection of a block key, as carried in KV hints."""

SlotId = NewType("SlotId", int)
"""Index of a fixed-size slot inside one namespace's pool."""

OpId = NewType("OpId", int)
"""Handle of a reservation (write) or a lease (read)."""

OwnerId = NewType("OwnerId", int)
"""Who holds reservations and leases (0 = the local process; guard clients get their own)."""

KEY_BYTES = 16
LOCAL_OWNER = OwnerId(0)


class SlotState(enum.IntEnum):
    """Life of a pool slot. Only READY slots are ever read or looked up."""

    FREE = 0
    FILLING = 1
    READY = 2


class FetchStatus(enum.Enum):
    """Per-key outcome of a fetch (bounded metrics label)."""

    OK = "ok"
    PRESENT = "present"  # already READY locally: nothing to fetch
    MISSING = "missing"  # the source does not hold it
    CHECKSUM = "checksum"  # bytes arrived but did not match: dropped, never published
    TIMEOUT = "timeout"  # the deadline passed first
    CANCELLED = "cancelled"
    CAPACITY = "capacity"  # no local slot could be reserved
    UNREACHABLE = "unreachable"  # no connection, or it broke
    REFUSED = "refused"  # authentication, namespace or version refused
    PROTOCOL = "protocol"  # the source sent something malformed
    UNTRUSTED = "untrusted"  # no trusted origin signed these bytes (a fleet): dropped
