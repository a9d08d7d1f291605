"""Replies of the attach protocol as values: the result of one operation checked for its kind
(a `Refused` raises `RunnerRefused`; anything else unexpected is a protocol fault, raised as
`RunnerUnavailable`), and the conversions into a reservation, a lease or a count. Pure.
"""

from __future__ import annotations

from typing import TypeVar

from kvcr_core.attach import protocol as p
from kvcr_core.attach.ops import RunnerRefused, RunnerUnavailable
from kvcr_core.index import Lease, Reservation
from kvcr_core.types import OpId, SlotId

R = TypeVar("R", bound=p.Result)


def result(results: list[p.Result], kind: type[R]) -> R:
    """The first result, which must be a `kind`."""
    answer = results[0]
    if isinstance(answer, kind):
        return answer
    if isinstance(answer, p.Refused):
        raise RunnerRefused(answer.reason, answer.detail)
    raise RunnerUnavailable("protocol", f"expected {kind.__name__}, got "
                            f"{type(answer).__name__}")


def as_reservation(results: list[p.Result]) -> Reservation:
    r = result(results, p.Slots)
    return Reservation(OpId(r.op), slots(r.slots), r.granted, r.refused)


def as_lease(results: list[p.Result]) -> Lease:
    r = result(results, p.Slots)
    return Lease(OpId(r.op), slots(r.slots), r.granted, tuple(r.checksums))


def as_count(results: list[p.Result]) -> int:
    return result(results, p.Count).n


def slots(values: list[int]) -> tuple[SlotId | None, ...]:
    return tuple(None if v == p.NO_SLOT else SlotId(v) for v in values)
