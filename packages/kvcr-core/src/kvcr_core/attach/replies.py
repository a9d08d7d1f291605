"""Replies of the attach protocol as values: `RunnerUnavailable` (the one error an engine
adapter handles: carry on without the cache), and the conversions of one request's results
into a reservation, a lease or a count (a `Refused` raises RunnerUnavailable; anything else
unexpected is a protocol fault, raised the same way). Pure.
"""

from __future__ import annotations

import enum

from kvcr_core.attach import protocol as p
from kvcr_core.errors import KVCRError
from kvcr_core.index import Lease, Reservation
from kvcr_core.types import OpId, SlotId


class RunnerUnavailable(KVCRError):
    """The Runner cannot be reached or refused us: carry on without the cache. `reason` is a
    short bounded word: a `CloseReason` or `RefusalReason` value the server sent, or one of
    "backoff", "closed", "attach_failed", "disconnected", "protocol" seen here."""

    def __init__(self, reason: str | enum.Enum, detail: str) -> None:
        self.reason: str = reason.value if isinstance(reason, enum.Enum) else reason
        self.detail = detail
        super().__init__(f"kvcr runner unavailable ({self.reason}): {detail}")


def _single(results: list[p.Result]) -> p.Slots:
    result = results[0]
    if isinstance(result, p.Refused):
        raise RunnerUnavailable(result.reason, result.detail)
    if not isinstance(result, p.Slots):
        raise RunnerUnavailable("protocol", f"expected slots, got {type(result).__name__}")
    return result


def as_reservation(results: list[p.Result]) -> Reservation:
    r = _single(results)
    return Reservation(OpId(r.op), slots(r.slots), r.granted, r.refused)


def as_lease(results: list[p.Result]) -> Lease:
    r = _single(results)
    return Lease(OpId(r.op), slots(r.slots), r.granted, tuple(r.checksums))


def as_count(results: list[p.Result]) -> int:
    result = results[0]
    if isinstance(result, p.Refused):
        raise RunnerUnavailable(result.reason, result.detail)
    if not isinstance(result, p.Count):
        raise RunnerUnavailable("protocol", f"expected a count, got {type(result).__name__}")
    return result.n


def slots(values: list[int]) -> tuple[SlotId | None, ...]:
    return tuple(None if v == p.NO_SLOT else SlotId(v) for v in values)
