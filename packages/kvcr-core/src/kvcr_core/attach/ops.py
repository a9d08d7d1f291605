"""`RunnerOps`: the operations an engine asks of a Runner, as one typed protocol, and the one
small error tree they raise.

Two things satisfy it (mypy checks both): `RunnerService`, the one implementation, called
in-process (an engine's own embedded Runner, tests), and `AttachClient`, thin stubs that carry
each call over the attach socket to a `RunnerService` in another process. An engine adapter is
written against `RunnerOps` and does not know which it holds.

A client opens a *namespace set* (one namespace per TP rank for vLLM's scheduler, one for a
worker or an SGLang store); single-namespace operations name theirs by index (`ns`, in the
order opened), and `lookup_all`, `acquire_all` and `peer_fetch` cover every namespace given in
one call (one round trip, whatever the TP size).

Errors (`RunnerError`, under `KVCRError`): every one means "carry on without the cache".
`RunnerUnavailable`: the Runner cannot be reached (transport, backoff, protocol); `RunnerRefused`:
it refused one operation (`reason`, a `RefusalReason`); `ClientClosed`: the caller closed this
client. A call that breaks the protocol's bounds (an unknown namespace index, a wrong count of
checksums) is a caller bug and raises ValueError.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, TypeVar

from kvcr_core.attach.protocol import FetchOutcome, PoolStats, RefusalReason, Removed
from kvcr_core.errors import KVCRError
from kvcr_core.index import Lease, Reservation
from kvcr_core.memory import SlotPool
from kvcr_core.types import BlockKey, OpId

T_co = TypeVar("T_co", covariant=True)


class RunnerError(KVCRError):
    """The Runner could not do what was asked: carry on without the cache. `reason` is a
    short bounded word (a metrics label)."""

    def __init__(self, reason: str | enum.Enum, detail: str) -> None:
        self.reason: str = reason.value if isinstance(reason, enum.Enum) else reason
        self.detail = detail
        super().__init__(f"kvcr runner unavailable ({self.reason}): {detail}")


class RunnerUnavailable(RunnerError):
    """The Runner cannot be reached: `reason` is a `CloseReason` value it sent, or one of
    "backoff", "attach_failed", "disconnected", "protocol" seen here."""


class RunnerRefused(RunnerError):
    """The Runner refused one operation; the connection stays up."""

    def __init__(self, reason: RefusalReason, detail: str) -> None:
        super().__init__(reason, detail)
        self.refusal = reason


class ClientClosed(RunnerError):
    """This client was closed by its owner (a use after `close`)."""

    def __init__(self) -> None:
        super().__init__("closed", "the client was closed by its owner")


class Handle(Protocol[T_co]):
    """What `reserve_async` / `acquire_async` return: `result()` waits for the answer."""

    def result(self) -> T_co: ...


class RunnerOps(Protocol):
    """The operations of one client (one owner, one namespace set) on its Runner."""

    @property
    def namespace_count(self) -> int:
        """How many namespaces this client opened (`ns` is below it)."""
        ...

    @property
    def attach_count(self) -> int:
        """Changes when the client re-attached: slots and mappings of before are gone."""
        ...

    @property
    def shared(self) -> bool:
        """Processes of other uids map one of this client's pools too (a named tenant's):
        `verify_loads: auto` checks loads then. False while detached."""
        ...

    def pool(self, ns: int = 0) -> SlotPool:
        """Namespace `ns`'s slots, mapped in this process (attaching first if needed)."""
        ...

    def lookup(self, keys: Sequence[BlockKey], ns: int = 0) -> int:
        """How many of `keys`, from the first, are READY."""
        ...

    def lookup_all(self, keys: Sequence[Sequence[BlockKey]]) -> int:
        """How many blocks, from the first, are READY in every namespace (`keys[i]`: namespace
        i's keys of the same blocks)."""
        ...

    def contains(self, keys: Sequence[BlockKey], ns: int = 0) -> list[bool]: ...

    def reserve(self, keys: Sequence[BlockKey], ns: int = 0) -> Reservation: ...

    def reserve_async(self, keys: Sequence[BlockKey], ns: int = 0) -> Handle[Reservation]:
        """`reserve`, answered later (overlap the round trip with other work)."""
        ...

    def commit(self, op: OpId, checksums: Sequence[int], ns: int = 0) -> int:
        """Publishes reservation `op` with each granted block's checksum, in order; returns
        the blocks published."""
        ...

    def commit_nowait(self, op: OpId, checksums: Sequence[int], ns: int = 0) -> None:
        """`commit` without waiting for the answer (this client's next call sees it)."""
        ...

    def abort(self, op: OpId, ns: int = 0) -> int: ...

    def acquire(self, keys: Sequence[BlockKey], ns: int = 0, *, prefix_only: bool = True,
                checksums: bool = False) -> Lease:
        """Leases READY blocks (never evicted while leased); `checksums`: with each leased
        block's committed checksum."""
        ...

    def acquire_async(self, keys: Sequence[BlockKey], ns: int = 0, *, prefix_only: bool = True,
                      checksums: bool = False) -> Handle[Lease]: ...

    def acquire_all(self, keys: Sequence[Sequence[BlockKey]], *,
                    checksums: bool = False) -> list[Lease]:
        """Leases the READY prefix of each namespace's keys (`keys[i]` in namespace i)."""
        ...

    def release(self, op: OpId, ns: int = 0) -> bool: ...

    def release_nowait(self, op: OpId, ns: int = 0) -> None: ...

    def clear(self, ns: int = 0) -> int:
        """Drops the namespace's READY, unleased blocks; returns how many went."""
        ...

    def stats(self, ns: int = 0) -> PoolStats: ...

    def removed_since(self, since: int) -> Removed:
        """Router hashes of the client's blocks that left the Runner after inventory batch
        `since` (-1: none, and where the log stands now), a bounded part at a time."""
        ...

    def post_hint(self, envelope: str) -> int:
        """A KV hint for requests still to come; returns the block hashes remembered."""
        ...

    def hint_sources(self, hashes: Sequence[int]) -> list[str | None]:
        """The posted hint's source endpoint of each router hash (None: none)."""
        ...

    def remote_run(self, keys: Sequence[BlockKey], ns: int = 0) -> tuple[str, int] | None:
        """Pull on miss: (peer, n) if a followed peer holds the first n of `keys`."""
        ...

    def peer_fetch(self, endpoint: str, keys: Sequence[Sequence[BlockKey]],
                   deadline_s: float) -> int:
        """Starts a fetch of `keys[i]` into namespace i from a configured peer; returns a
        ticket to `peer_poll`. Raises RunnerRefused (not a peer, peers off, too many)."""
        ...

    def peer_poll(self, ticket: int) -> FetchOutcome:
        """Whether the fetch ended, and then each namespace's per-key statuses."""
        ...

    def flush(self) -> None:
        """Waits until every call sent so far took effect."""
        ...

    def close(self) -> None: ...
