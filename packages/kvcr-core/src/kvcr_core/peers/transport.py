"""The peer transport seam: how a fetch's block bytes travel once the control messages
(kvcr_core.peers.protocol, always on the authenticated TCP connection) have said which blocks.

A `PeerTransport` has a half for each end of a connection:
- source (`PeerServer`): `expose` makes a namespace's pool reachable this way (returning what
  a peer needs to reach it, sent in Ready), `send` answers one Fetch, `next_frame` waits for
  the peer's next message (a transport may have work to do meanwhile: NIXL drives progress);
- destination (`PeerClient`): `usable` says whether to offer it to an endpoint now, `open`
  binds a connection the source agreed to use it on, `receive` lands one Fetch reply's blocks
  in the reserved slots and verifies them, `declined` notes a source that answered TCP,
  `drop` forgets a connection.
Implementations: `TcpTransport` (kvcr_core.peers.tcp: bytes streamed on the connection; what
every source answers unless both agree on another), `NixlTransport` (kvcr_core.peers.reads:
NIXL READs from the source's leased slots) and `kvcr_core.testing.LoopbackTransport` (the same
reads by memmove, both ends in one process). One contract test suite runs against each.

Contract for `receive`: every key it reports OK arrived whole and matched its checksum (it
appends it to `job.keep`, which the client publishes); it never leaves the transport writing
into a slot after it returns; it returns False when the connection may be out of step (the
client then drops it). Transports hold no per-connection state (kvcr_core.peers.connection
does). Thread-safe: many connections use one transport at once.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

from kvcr_core.errors import KVCRError
from kvcr_core.framing import recv_frame
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.connection import DestConnection, FetchJob, SourceConnection
from kvcr_core.runner import NamespaceStore


class TransportError(KVCRError):
    """A transport could not start, register memory or complete a transfer: the peer falls
    back to TCP, or the blocks of the failed transfer are dropped unpublished."""


class ReadRefused(TransportError):
    """A read was refused before anything moved: the source named memory it did not expose
    (the source's fault), or its transport end is unknown here."""


class PeerTransport(abc.ABC):
    kind: ClassVar[pp.TransportKind]
    features: tuple[str, ...] = ()
    """Protocol features this transport offers (destination) and accepts (source)."""

    # -- source half -------------------------------------------------------------------------

    def expose(self, store: NamespaceStore) -> bytes | None:
        """Makes `store`'s pool reachable this way (once per namespace; `unexpose` undoes
        it). Returns what a peer needs to reach it (sent in Ready), or None: not now."""
        return b""

    def unexpose(self, store: NamespaceStore) -> None:
        """Undoes one `expose` (before the pool is unmapped)."""
        return None

    @abc.abstractmethod
    def send(self, conn: SourceConnection, fetch: pp.Fetch) -> None:
        """Answers `fetch` with the blocks `conn.store` holds, leased while they travel."""

    def next_frame(self, conn: SourceConnection, *, reading: bool = False) -> bytearray:
        """The peer's next message (`reading`: it is reading blocks meanwhile). Raises
        TimeoutError when it stays silent past the I/O deadline."""
        return recv_frame(conn.sock)[0]

    # -- destination half --------------------------------------------------------------------

    def usable(self, endpoint: str, store: NamespaceStore) -> bool:
        """Whether to offer this transport to `endpoint` now, landing blocks in `store`."""
        return True

    def release(self, store: NamespaceStore) -> None:
        """`store` is no longer a destination of this transport (its client closed)."""
        return None

    def open(self, conn: DestConnection, ready: pp.Ready) -> None:
        """The source chose this transport: bind `conn` (raises TransportError if it cannot
        be used with this source; the client then connects again offering TCP only)."""
        return None

    def declined(self, endpoint: str) -> None:
        """`endpoint` answered an offer of this transport with TCP."""
        return None

    @abc.abstractmethod
    def receive(self, conn: DestConnection, reply: pp.ToClient, job: FetchJob) -> bool:
        """Lands the blocks `reply` names in `job`'s slots (see the module contract)."""

    def drop(self, conn: DestConnection) -> None:
        """`conn` is closed."""
        return None


def offered(transport: PeerTransport | None) -> tuple[Sequence[str], Sequence[str]]:
    """What a destination offers in Auth for `transport` (None: TCP only): the transports
    beyond TCP and the features."""
    if transport is None:
        return (), ()
    return (transport.kind.value,), transport.features
