"""`InventoryReader`: what a router uses to follow one runner's stored/removed blocks (and to
post it KV hints ahead of requests, `post_hint`).

Connects to the runner's peer endpoint with the shared secret (as an inventory-only peer;
over TLS when given the peer channel's `PeerTLS`),
then `poll()` returns the batches after the last one seen, and whether the reader fell
behind (`reset`: forget this runner's blocks and rebuild from what follows). Blocking, with a
deadline per call; not thread-safe (one reader per thread).
"""

from __future__ import annotations

import array
import socket
from typing import TypeVar

from kvcr_core.endpoint import Endpoint
from kvcr_core.framing import FrameError, recv_frame
from kvcr_core.inventory import InventoryBatch
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.connection import PeerRefused, authenticate
from kvcr_core.peers.fleet import PeerCredential
from kvcr_core.peers.tls import PeerTLS

R = TypeVar("R", pp.InventoryReply, pp.HintPosted)

class InventoryReader:
    def __init__(self, endpoint: str, secret: PeerCredential, timeout_s: float = 5.0, *,
                 tls: PeerTLS | None = None) -> None:
        self.endpoint = Endpoint.parse(endpoint, where="inventory endpoint")
        self.secret = secret
        self.timeout_s = timeout_s
        self._tls = tls.client_context() if tls is not None else None
        self.since = 0
        self.epoch: int | None = None
        self._sock: socket.socket | None = None

    def poll(self) -> tuple[bool, list[InventoryBatch]]:
        """(reset, new batches): reset means forget this runner's blocks first."""
        reply = self._exchange(pp.Inventory(self.since, pp.MAX_INVENTORY_BATCHES),
                               pp.InventoryReply)
        if self.epoch is not None and reply.epoch != self.epoch:  # the runner restarted
            self.epoch, self.since = reply.epoch, 0
            return True, self.poll()[1]
        self.epoch = reply.epoch
        batches = [InventoryBatch(b.seq, b.namespace, array.array("Q", b.stored),
                                  array.array("Q", b.removed)) for b in reply.batches]
        if batches:
            self.since = batches[-1].seq
        elif reply.reset:
            self.since = reply.last_seq
        return reply.reset, batches

    def post_hint(self, envelope: str) -> int:
        """Posts a KV hint to the runner (its `HintBoard`, for engines such as SGLang that do not
        pass hints to their cache plug-in); returns the block hashes it remembered."""
        return self._exchange(pp.PostHint(envelope), pp.HintPosted).hashes

    def _exchange(self, request: pp.Inventory | pp.PostHint, expected: type[R]) -> R:
        """One request, one reply of the `expected` type; any failure closes the connection."""
        sock = self._sock or self._connect()
        try:
            sock.sendall(pp.encode(request))
            reply = pp.decode_to_client(recv_frame(sock)[0])
            if isinstance(reply, pp.Refused):
                raise PeerRefused(reply.reason, reply.detail)
            if not isinstance(reply, expected):
                raise FrameError(f"expected {expected.__name__}")
        except BaseException:
            self.close()
            raise
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.endpoint.host, self.endpoint.port),
                                        timeout=self.timeout_s)
        try:
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.endpoint.host)
            authenticate(sock, self.secret, b"", 0, str(self.endpoint))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        return sock
