"""Peers: destination-initiated block transfer between Runners on different nodes.

`PeerServer` serves a Runner's READY blocks to authenticated peers; `PeerClient` fetches
blocks from one into reserved local slots, over TCP or, when both sides have it, NIXL
(`nixl_transport`, the only module that imports nixl). Protocol and security model:
docs/peers.md.
"""

from kvcr_core.peers.auth import PeerSecret
from kvcr_core.peers.client import FetchResult, PeerClient
from kvcr_core.peers.metrics import FetchStatus, PeerMetrics
from kvcr_core.peers.server import PeerServer
from kvcr_core.peers.tls import PeerTLS

__all__ = ["FetchResult", "FetchStatus", "PeerClient", "PeerMetrics", "PeerSecret", "PeerServer",
           "PeerTLS"]
