"""Peers: destination-initiated block transfer between Runners on different nodes.

`PeerServer` serves a Runner's READY blocks to authenticated peers; `PeerClient` fetches
blocks from one into reserved local slots. How block bytes travel is a `PeerTransport`'s:
`TcpTransport` (always), `NixlTransport` (opt-in; kvcr_core.peers.nixl_engine is the only
module that imports nixl), or kvcr_core.testing's in-process `LoopbackTransport`. Protocol and
security model: docs/peers.md.

This is the package's public API; its submodules are internals.
"""

from kvcr_core.inventory import InventoryBatch
from kvcr_core.peers.auth import PeerSecret
from kvcr_core.peers.client import FetchHandle, FetchResult, PeerClient
from kvcr_core.peers.connection import PeerRefused
from kvcr_core.peers.directory import InventorySource
from kvcr_core.peers.fleet import FleetCredential, Identity, NodeKey, PeerCredential
from kvcr_core.peers.inventory_reader import InventoryReader
from kvcr_core.peers.metrics import PeerMetrics
from kvcr_core.peers.protocol import TransportKind
from kvcr_core.peers.reads import NixlTransport, ReadTransport
from kvcr_core.peers.server import PeerServer
from kvcr_core.peers.tcp import TcpTransport
from kvcr_core.peers.tls import PeerTLS
from kvcr_core.peers.transport import PeerTransport, ReadRefused, TransportError
from kvcr_core.types import FetchStatus

__all__ = [
    "FetchHandle",
    "FetchResult",
    "FetchStatus",
    "FleetCredential",
    "Identity",
    "InventoryBatch",
    "InventoryReader",
    "InventorySource",
    "NixlTransport",
    "NodeKey",
    "PeerClient",
    "PeerCredential",
    "PeerMetrics",
    "PeerRefused",
    "PeerSecret",
    "PeerServer",
    "PeerTLS",
    "PeerTransport",
    "ReadRefused",
    "ReadTransport",
    "TcpTransport",
    "TransportError",
    "TransportKind",
]
