"""One peer connection's state at each end, one fetch's state at the destination, and the
destination's half of the handshake (`authenticate`).

- `FetchJob`: what a fetch asked for, where each key lands, what became of it; a transport's
  `receive` fills it in (statuses, bytes received, keys to keep), the `PeerClient` settles it.
- `DestConnection` / `SourceConnection`: an authenticated control connection and the
  transport its blocks use, as each end sees it. Transports keep no per-connection state of
  their own: it is here.
Threading: a connection (and a job) is used by one thread at a time.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvcr_core.checksums import SlotChecksums
from kvcr_core.framing import FrameError, recv_frame
from kvcr_core.logs import printable
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.auth import new_nonce
from kvcr_core.peers.fleet import Identity, PeerCredential
from kvcr_core.peers.metrics import PeerMetrics
from kvcr_core.runner import NamespaceStore
from kvcr_core.types import BlockKey, FetchStatus, OpId, OwnerId, SlotId

if TYPE_CHECKING:
    from kvcr_core.peers.transport import PeerTransport


class PeerRefused(ConnectionError):
    """The source refused us (its reason is a `PeerRefusal` value)."""

    def __init__(self, reason: pp.PeerRefusal | str, detail: str) -> None:
        self.reason = reason.value if isinstance(reason, pp.PeerRefusal) else reason
        super().__init__(f"peer refused ({self.reason}): {detail}")


@dataclasses.dataclass
class FetchJob:
    """One fetch in flight: what was asked, where it lands, what became of each key."""

    keys: Sequence[BlockKey]
    slots: list[SlotId | None]  # where each lands, once reserved (after the Fetch is sent)
    wanted: list[int]  # the keys asked of the peer (those not READY here when asked)
    statuses: list[FetchStatus]
    keep: dict[BlockKey, int]  # keys whose bytes arrived whole and verified, and their sums
    deadline: float
    cancel: threading.Event | None
    received: int = 0
    reservation: OpId | None = None
    origins: dict[BlockKey, pp.Manifest] = dataclasses.field(default_factory=dict)
    """Fleet fetches: the manifest each kept block came with (its origin's signature)."""

    def fail(self, status: FetchStatus) -> None:
        """Every key asked of the peer and not settled yet ends with `status`."""
        for i in self.wanted:
            if self.statuses[i] is FetchStatus.TIMEOUT:
                self.statuses[i] = status

    def cancelled(self) -> bool:
        if self.cancel is not None and self.cancel.is_set():
            self.fail(FetchStatus.CANCELLED)
            return True
        return False


class DestConnection:
    """The destination's end: the socket, the source's endpoint, the transport blocks travel
    by, the Fetch sequence, the source's name for the transport (e.g. its NIXL agent) and the
    features both named."""

    def __init__(self, sock: socket.socket, endpoint: str, transport: PeerTransport,
                 store: NamespaceStore, remote: str = "",
                 features: frozenset[str] = frozenset()) -> None:
        self.node = ""  # the source's fleet name, once authenticated
        self.sock = sock
        self.endpoint = endpoint
        self.transport = transport
        self.store = store
        self.remote = remote
        self.features = features
        self.seq = 0

    def time_left(self, deadline: float) -> None:
        """Bounds the next socket wait by `deadline` (TimeoutError if it passed)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self.sock.settimeout(left)


@dataclasses.dataclass
class SourceConnection:
    """The source's end: whom it serves (`owner` leases), the namespace, the transport, the
    features both named, and what the peer's last FetchDone said (`inline`)."""

    sock: socket.socket
    store: NamespaceStore
    owner: OwnerId
    transport: PeerTransport
    checksums: SlotChecksums
    metrics: PeerMetrics
    io_timeout_s: float
    features: frozenset[str] = frozenset()
    inline: bool = False
    identity: Identity = dataclasses.field(default_factory=lambda: Identity(""))
    origins: Callable[[int, Sequence[tuple[BlockKey, int]]], bytes] | None = None
    """Fleet connections: the encoded `Origins` frame to send before a fetch's blocks."""

    def origins_frame(self, seq: int, keys: Sequence[bytes],
                      slots: Sequence[SlotId | None]) -> list[bytes]:
        """[the Origins frame] for the found blocks of a fetch, or [] without a fleet."""
        if self.origins is None:
            return []
        found = [(BlockKey(k), self.checksums.of(s)) for k, s in zip(keys, slots, strict=True)
                 if s is not None]
        return [self.origins(seq, found)]


def authenticate(sock: socket.socket, secret: PeerCredential, namespace: bytes,
                 block_bytes: int, endpoint: str, transports: Sequence[str] = (),
                 features: Sequence[str] = ()) -> pp.Ready:
    """The client half of the handshake (docs/peers.md); the socket's timeout bounds it.
    An empty `namespace` asks for an inventory-only session; `transports` offers extras
    beyond TCP, `features` protocol features. Returns the source's Ready (which transport it
    chose, which features it accepted, and its fleet name, checked)."""
    nonce = new_nonce()
    sock.sendall(pp.encode(pp.Hello(pp.PEER_PROTOCOL_VERSION, nonce)))
    challenge = pp.decode_to_client(recv_frame(sock)[0])
    if isinstance(challenge, pp.Refused):
        raise PeerRefused(challenge.reason, challenge.detail)
    if not isinstance(challenge, pp.Challenge):
        raise FrameError("expected Challenge")
    sock.sendall(pp.encode(pp.Auth(secret.prove(b"client", nonce, challenge.nonce),
                                   secret.name, namespace, block_bytes, list(transports),
                                   list(features))))
    ready = pp.decode_to_client(recv_frame(sock)[0])
    if isinstance(ready, pp.Refused):
        raise PeerRefused(ready.reason, ready.detail)
    if not isinstance(ready, pp.Ready):
        raise FrameError("expected Ready")
    identity = secret.identify(b"server", ready.node, challenge.nonce, nonce, ready.mac)
    if identity is None or identity.router:
        raise PeerRefused(pp.PeerRefusal.AUTH,
                          f"{endpoint} does not know the shared peer secret" if not ready.node
                          else f"{endpoint} is not a trusted fleet node "
                          f"({printable(ready.node)!r}: unknown, revoked or a wrong key)")
    return ready

