"""The peer wire protocol, version 2 (docs/peers.md): framed msgpack control messages, and
raw block bytes streamed after a fetch reply.

Handshake (destination = client, source = server):
  C -> S  Hello(version, nonce_c)
  S -> C  Challenge(version, nonce_s)
  C -> S  Auth(HMAC(secret, "client", nonce_c, nonce_s), namespace digest, block_bytes,
               transports offered beyond TCP, features offered)
  S -> C  Ready(HMAC(secret, "server", nonce_s, nonce_c), transport, NIXL agent metadata if
                "nixl", features accepted)
          |  Refused(reason, detail)
The client proves it knows the secret first, and the source answers with its own proof only
then: an unauthenticated connection learns nothing it could test guesses of the secret
against offline (version 1 sent the source's MAC in the Challenge). Both sides check the
other's MAC; the namespace is checked only after authentication. Before authentication a
source takes frames of at most `MAX_HANDSHAKE_FRAME_BYTES`. The
source picks NIXL only when the destination offered it and it has NIXL running itself;
otherwise (and always with TLS) blocks travel over this TCP connection. Then, any number of
times, on a TCP connection:
  C -> S  Fetch(seq, keys)
  S -> C  Blocks(seq, found), then per found key: block_bytes raw bytes followed by its
          8-byte little-endian xxh3-64 checksum
and on a NIXL connection (the control messages stay on this connection):
  C -> S  Fetch(seq, keys)
  S -> C  NixlBlocks(seq, found, addresses, checksums)   (found blocks leased until...)
  S -> C  NixlChecksums(seq, start, checksums)  ...       (with "late_checksums", see below)
  C -> S  FetchDone(seq, inline)                          (...the destination has read them)
Feature "late_checksums" (NIXL connections, when both sides name it): NixlBlocks may carry
the checksums of only its first k found blocks (those the source had already computed), so
the destination starts reading at once; the rest follow, in order, in NixlChecksums messages
(`start` = how many were given before) sent while it reads, all before the source reads
FetchDone. FetchDone's `inline` (optional, default false) says every READ of that fetch
copied within the reader's own call (UCX cma), so the source may drive NIXL progress lazily
while this peer reads, until a FetchDone says otherwise.
The destination verifies every block against the source's checksum and publishes only blocks
that match; a transfer cut short keeps the blocks that arrived whole and verified. Optional
trailing fields keep version-1 peers without NIXL compatible both ways.
How block bytes travel is each transport's (kvcr_core.peers.transport): TCP streams them on
this connection; NIXL and the in-process loopback transport of kvcr_core.testing read them
from the addresses in NixlBlocks. Refusal reasons and the chosen transport are enums; the
message base and `PostHint` are shared with the attach protocol (kvcr_core.wire).
Pure data and codecs; thread-safe.
"""

from __future__ import annotations

import enum
import struct
from typing import Annotated, Final

import msgspec

from kvcr_core.checksums import block_checksum as checksum  # noqa: F401 (the wire's checksum)
from kvcr_core.wire import Message, encode_frame
from kvcr_core.wire import PostHint as PostHint

PEER_PROTOCOL_VERSION: Final = 3
MAX_HANDSHAKE_FRAME_BYTES: Final = 4096
MAX_KEYS_PER_FETCH: Final = 4096
MAX_INVENTORY_BATCHES: Final = 16  # asked for at most; a reply carries what fits a frame
INVENTORY_REPLY_BYTES: Final = 960 << 10  # a reply's batches stop short of this (1 MiB frames)
MAX_AGENT_METADATA_BYTES: Final = 64 << 10  # a UCX agent's is about 0.5 KiB
LATE_CHECKSUMS: Final = "late_checksums"  # the one feature so far (see the module docstring)

Key = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Mac = Annotated[bytes, msgspec.Meta(min_length=32, max_length=64)]  # HMAC, or Ed25519 sig
NodeName = Annotated[str, msgspec.Meta(max_length=128)]
MAX_MANIFESTS: Final = 64  # origin manifests per reply


class Hello(Message, tag="hello"):
    version: int
    nonce: Nonce


class Challenge(Message, tag="challenge"):
    version: int
    nonce: Nonce


class TransportKind(enum.Enum):
    """How block bytes travel on a connection (bounded metrics label)."""

    TCP = "tcp"
    NIXL = "nixl"
    LOOPBACK = "loopback"  # both ends in one process (kvcr_core.testing.LoopbackTransport)


class PeerRefusal(enum.Enum):
    """Why a peer connection was refused (bounded metrics label)."""

    VERSION = "version"
    AUTH = "auth"
    NAMESPACE = "namespace"
    MALFORMED = "malformed"
    BUSY = "busy"
    TIMEOUT = "timeout"  # the handshake did not finish within its deadline
    THROTTLED = "throttled"  # too many failed authentications from this address lately


class Auth(Message, tag="auth"):
    mac: Mac  # the HMAC of the shared secret, or the node key's signature
    node: NodeName  # the client's fleet name ("" with a shared secret)
    namespace: Annotated[bytes, msgspec.Meta(max_length=16)]  # empty: inventory reader only
    block_bytes: int
    # offered beyond TCP, and protocol features offered
    transports: Annotated[list[str], msgspec.Meta(max_length=8)] = msgspec.field(
        default_factory=list)
    features: Annotated[list[str], msgspec.Meta(max_length=8)] = msgspec.field(
        default_factory=list)


class Ready(Message, tag="ready"):
    mac: Mac  # the source's proof, given only to a client that proved its own
    node: NodeName  # the source's fleet name ("" with a shared secret)
    transport: TransportKind = TransportKind.TCP
    nixl_agent: Annotated[bytes, msgspec.Meta(max_length=MAX_AGENT_METADATA_BYTES)] = b""
    features: Annotated[list[str], msgspec.Meta(max_length=8)] = msgspec.field(
        default_factory=list)  # of those offered


class Refused(Message, tag="refused"):
    reason: PeerRefusal
    detail: str


class Fetch(Message, tag="fetch"):
    seq: int
    keys: Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS_PER_FETCH)]


class Manifest(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Blocks as their origin node committed them: its name, their keys and checksums, and
    its signature over them and the namespace (kvcr_core.peers.origins)."""

    origin: NodeName
    keys: Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS_PER_FETCH)]
    checksums: Annotated[list[int], msgspec.Meta(max_length=MAX_KEYS_PER_FETCH)]
    signature: Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]


class Origins(Message, tag="origins"):
    """Sent before Blocks / NixlBlocks on a fleet connection: where each found block comes
    from (`of_found`: the index of its manifest, in found order)."""

    seq: int
    manifests: Annotated[list[Manifest], msgspec.Meta(max_length=MAX_MANIFESTS)]
    of_found: Annotated[list[int], msgspec.Meta(max_length=MAX_KEYS_PER_FETCH)]


class Blocks(Message, tag="blocks"):
    seq: int
    found: list[bool]


class NixlBlocks(Message, tag="nixl_blocks"):
    """The answer to a Fetch on a NIXL connection: for each found key, in order, where its
    bytes lie in the source's registered pool and their checksum (with late_checksums, those
    of the first found keys only). Leased until FetchDone."""

    seq: int
    found: Annotated[list[bool], msgspec.Meta(max_length=MAX_KEYS_PER_FETCH)]
    addresses: Annotated[list[int], msgspec.Meta(max_length=MAX_KEYS_PER_FETCH)]
    checksums: Annotated[list[int], msgspec.Meta(max_length=MAX_KEYS_PER_FETCH)]


class NixlChecksums(Message, tag="nixl_checksums"):
    """More checksums for NixlBlocks `seq` (late_checksums): of its found blocks `start`,
    `start + 1`, ..."""

    seq: int
    start: int
    checksums: Annotated[list[int], msgspec.Meta(max_length=MAX_KEYS_PER_FETCH)]


class FetchDone(Message, tag="fetch_done"):
    """The destination no longer reads the blocks of NixlBlocks `seq`: the source releases.
    `inline`: each of its READs was done when posted (the copy ran in the reader's own call,
    as UCX's cma does), so the source need not drive progress while this peer reads."""

    seq: int
    inline: bool = False


class Inventory(Message, tag="inventory"):
    """Inventory batches after `since` (a router polling what this runner stored/removed)."""

    since: int
    max_batches: Annotated[int, msgspec.Meta(ge=1, le=MAX_INVENTORY_BATCHES)]


class InventoryBatchMsg(Message, tag="batch"):
    seq: int
    namespace: bytes
    stored: list[int]
    removed: list[int]


class InventoryReply(Message, tag="inventory_reply"):
    reset: bool  # the reader fell behind the log: forget this runner's blocks, then rebuild
    epoch: int  # changes when the runner restarts (then sequence numbers start over)
    last_seq: int
    batches: list[InventoryBatchMsg]


class HintPosted(Message, tag="hint_posted"):
    hashes: int  # block hashes remembered (0: rejected; counted in kvcr_hints_total)


encode = encode_frame
ToServer = Hello | Auth | Fetch | FetchDone | Inventory | PostHint
ToClient = (Challenge | Ready | Refused | Blocks | NixlBlocks | NixlChecksums | InventoryReply
            | HintPosted | Origins)

_server_decoder = msgspec.msgpack.Decoder(ToServer)
_client_decoder = msgspec.msgpack.Decoder(ToClient)


def decode_to_server(payload: bytes | bytearray) -> ToServer:
    return _server_decoder.decode(payload)


def decode_to_client(payload: bytes | bytearray) -> ToClient:
    return _client_decoder.decode(payload)


CHECKSUM = struct.Struct("<Q")
