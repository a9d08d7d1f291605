"""Large reservations and leases, split so no request is heavy for the server's loop.

The attach server serves every client on one thread and bounds what one request may make it
do (`protocol.MAX_HEAVY_KEYS_PER_REQUEST`: keys reserved or leased, slots committed, aborted
or released), so one client's big request never delays the others by more than about half a
millisecond. A client that needs more (a load of a long prompt) sends several requests, each
within the bound, pipelined: the server serves other clients between them. `CompoundOps`
hands the caller one op id for the parts (and ends all of them by it); `Pending` is the
handle (kvcr_core.attach.ops' `Handle`) of one request in flight, `Gathered` that of the
pipelined parts, answered as one reservation or lease.

Threading: used under the owning client's lock (`CompoundOps`), or by one caller (`Gathered`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from kvcr_core.attach.protocol import MAX_HEAVY_KEYS_PER_REQUEST, Result
from kvcr_core.index import NO_OP, Lease, Reservation
from kvcr_core.types import OpId

T = TypeVar("T")
_FIRST_ID = 1 << 62  # above any id a server hands out


def chunks(items: Sequence[T], step: int = MAX_HEAVY_KEYS_PER_REQUEST) -> list[Sequence[T]]:
    """`items` in parts of at most `step` (by default the per-request bound of heavy keys;
    one part when it fits)."""
    return [items[i:i + step] for i in range(0, len(items), step)] or [items]


class Pending(Generic[T]):
    """Handle of a request in flight. `result()` waits for (and converts) its reply
    (`wait(seq)` raises RunnerUnavailable if the connection failed meanwhile, or after the
    client's `timeout_s` without an answer)."""

    __slots__ = ("_convert", "_value", "_wait", "seq")

    def __init__(self, wait: Callable[[int], list[Result]], seq: int,
                 convert: Callable[[list[Result]], T]) -> None:
        self._wait = wait
        self._convert = convert
        self._value: T | None = None
        self.seq = seq

    def result(self) -> T:
        if self._value is None:
            self._value = self._convert(self._wait(self.seq))
        return self._value


class Gathered(Generic[T]):
    """The result of several pipelined requests, combined once all are in."""

    def __init__(self, parts: Sequence[Callable[[], T]],
                 combine: Callable[[list[T]], T]) -> None:
        self._parts = parts
        self._combine = combine
        self._value: T | None = None

    def result(self) -> T:
        if self._value is None:
            self._value = self._combine([part() for part in self._parts])
        return self._value


class CompoundOps:
    """Client-side ids that stand for several server ops: (op, blocks granted) each."""

    def __init__(self, limit: int = 4096) -> None:
        self._parts: dict[OpId, list[tuple[OpId, int]]] = {}
        self._ids = itertools.count(_FIRST_ID)
        self._limit = limit

    def reservation(self, parts: list[Reservation]) -> Reservation:
        op = self._record([(r.op, r.granted) for r in parts if r.op != NO_OP])
        return Reservation(op, tuple(s for r in parts for s in r.slots),
                           sum(r.granted for r in parts), sum(r.refused for r in parts))

    def lease(self, parts: list[Lease]) -> Lease:
        """Leases of consecutive parts; with prefix semantics, a part after one that stopped
        short holds nothing the caller may use, so it is released at once by the caller."""
        op = self._record([(r.op, r.granted) for r in parts if r.op != NO_OP])
        return Lease(op, tuple(s for r in parts for s in r.slots),
                     sum(r.granted for r in parts),
                     tuple(c for r in parts for c in r.checksums))

    def _record(self, parts: list[tuple[OpId, int]]) -> OpId:
        if not parts:
            return NO_OP
        if len(parts) == 1:
            return parts[0][0]
        if len(self._parts) >= self._limit:  # a caller that never ends its ops: forget
            self._parts.clear()               # the oldest (the server ends them with us)
        op = OpId(next(self._ids))
        self._parts[op] = parts
        return op

    def take(self, op: OpId) -> list[tuple[OpId, int]]:
        """The server ops `op` stands for (itself, if it is one), forgotten here."""
        return self._parts.pop(op, None) or [(op, -1)]
