"""The attach protocol, version 2: framed msgpack messages over a Unix socket.

Frame: 4-byte little-endian payload length, then a msgpack payload of one tagged message.
Frames are bounded (`MAX_FRAME_BYTES`; before Hello, `MAX_HELLO_FRAME_BYTES`); a bigger
announced length is a protocol violation. Every field is typed and bounded by the decoder
(key lengths, counts, block size, namespace fields, op ids): a message that decodes is safe to
act on. Version 2 (against 1): commits carry each block's checksum, acquires may return
them, Hello's namespace is a typed structure.

Order: the client sends `Hello` first and once (or a single `Probe` for status). The server
answers `Welcome` with the pool's memfd attached by SCM_RIGHTS, or `Goodbye(reason)` and
closes. Then each `Request` carries a strictly increasing `seq` and a batch of operations
(one engine step = one round trip); the server answers one `Reply` with one result per
operation, in order. Anything else (unknown tag, wrong version, a second Hello, a request
before Hello, a seq that does not increase, too many ops or keys) closes the connection with
a counted, logged reason; the server and its other clients are unaffected.

Reasons and statuses are enums (`CloseReason`, `RefusalReason`, kvcr_core.peers'
`FetchStatus`); the message base and `PostHint` are shared with the peer protocol
(kvcr_core.wire). Pure data and codecs; thread-safe.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

import msgspec

from kvcr_core.framing import FRAME_HEADER as FRAME_HEADER
from kvcr_core.framing import MAX_FRAME_BYTES as MAX_FRAME_BYTES
from kvcr_core.framing import FrameError as FrameError
from kvcr_core.framing import recv_frame as recv_frame
from kvcr_core.types import FetchStatus
from kvcr_core.wire import Message
from kvcr_core.wire import PostHint as PostHint
from kvcr_core.wire import encode_frame as encode_frame

PROTOCOL_VERSION: Final = 2
MAX_OPS_PER_REQUEST: Final = 256
MAX_KEYS_PER_OP: Final = 8192
MAX_HEAVY_KEYS_PER_REQUEST: Final = 1024
"""Keys one request may reserve or lease, and slots it may commit, abort or release, all its
ops together (about 0.5 ms of the server's loop); beyond, the rest of such ops is refused.
`AttachClient` splits larger operations into pipelined requests (kvcr_core.attach.compound)."""
MAX_KEYS_PER_REQUEST: Final = MAX_KEYS_PER_OP
"""Keys and hashes one request may name in lookups and other cheap ops, together."""
MAX_REQUEST_FRAME_BYTES: Final = 160 << 10
"""The largest request frame of an attached client (one op of `MAX_KEYS_PER_OP` keys fits):
decoding one costs the loop about 0.3 ms. A larger frame closes the connection."""
MAX_ATTACH_HINT_BYTES: Final = 8 << 10
"""The largest KV hint one request may post (`AttachClient.post_hint` splits larger ones):
parsing and remembering one costs the loop about 0.4 ms."""
MAX_BLOCK_BYTES: Final = 1 << 30
MAX_HELLO_FRAME_BYTES: Final = 16 << 10
NO_SLOT: Final = -1

# Validated by the decoder (in C): a wrong key length or too many keys/ops is MALFORMED.
Key = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS_PER_OP)]
Checksums = Annotated[list[Annotated[int, msgspec.Meta(ge=0)]],  # u64 (msgpack bounds it)
                      msgspec.Meta(max_length=MAX_KEYS_PER_OP)]
OpRef = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
_Text = Annotated[str, msgspec.Meta(max_length=512)]
_Count = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]


class CloseReason(enum.Enum):
    """Why the server closed a connection (told in `Goodbye`; a bounded metrics label)."""

    EOF = "eof"
    OVERSIZED_FRAME = "oversized_frame"
    MALFORMED = "malformed"
    WRONG_VERSION = "wrong_version"
    OUT_OF_ORDER = "out_of_order"
    BAD_NAMESPACE = "bad_namespace"
    NOT_ALLOWED = "not_allowed"
    TOO_MANY_CLIENTS = "too_many_clients"
    CAPACITY = "capacity"
    SHUTDOWN = "shutdown"
    CLIENT_DIED = "client_died"
    HANDSHAKE_TIMEOUT = "handshake_timeout"  # no Hello in time
    QUOTA = "quota"  # the client's uid holds as many namespaces as it may
    INTERNAL = "internal_error"  # a fault of the server's own: this connection only


class RefusalReason(enum.Enum):
    """Why the server refused one operation (`Refused`); the connection stays up."""

    PEERS_OFF = "peers_off"  # this Runner fetches from no peers
    PEER_NOT_ALLOWED = "peer_not_allowed"  # the endpoint is not one of its peers
    BUSY = "busy"  # too many of this client's fetches in flight
    UNKNOWN_TICKET = "unknown_ticket"


# -- client -> server -------------------------------------------------------------------------


class NamespaceFields(msgspec.Struct, forbid_unknown_fields=True):
    """`kvcr_core.keys.NamespaceSpec` on the wire (a map), every field typed and bounded."""

    model_id: _Name
    dtype: _Name
    kv_dtype: _Name
    block_size_tokens: _Count
    num_layers: _Count
    num_kv_heads: _Count
    head_dim: _Count
    layout: _Name
    model_revision: _Text = ""
    tp_size: _Count = 1
    tp_rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    tenant: _Text = ""
    lora: _Text = ""
    extra: Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], _Text],
                     msgspec.Meta(max_length=32)] = msgspec.field(default_factory=dict)


class Hello(Message, tag="hello"):
    protocol: Annotated[int, msgspec.Meta(ge=0)]
    namespace: NamespaceFields
    block_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_BYTES)]
    identity: Annotated[str, msgspec.Meta(max_length=256)]
    pid: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]


class Probe(Message, tag="probe"):
    """An operator's status query (`kvcr status`): allowed instead of Hello, answered with
    `StatusReport`, then the server closes the connection."""

    protocol: int


class Lookup(Message, tag="lookup"):
    keys: Keys


class Contains(Message, tag="contains"):
    keys: Keys


class Reserve(Message, tag="reserve"):
    keys: Keys


class Commit(Message, tag="commit"):
    """Publishes reservation `op`; `checksums`: the xxh3-64 of each block granted, in the
    reservation's order, taken by the writer right after its copy (what peers are served and
    local loads may verify)."""

    op: OpRef
    checksums: Checksums


class Abort(Message, tag="abort"):
    op: OpRef


class Acquire(Message, tag="acquire"):
    """Leases READY blocks; `checksums`: also answer each leased block's checksum."""

    keys: Keys
    prefix_only: bool = True
    checksums: bool = False


class Release(Message, tag="release"):
    op: OpRef


class Stats(Message, tag="stats"):
    pass


class Clear(Message, tag="clear"):
    """Drop every READY, unleased block of the namespace (SGLang's storage `clear`)."""


class HintSources(Message, tag="hint_sources"):
    """Which posted hint names a source for each router hash; answered by `Sources`."""

    hashes: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]],
                      msgspec.Meta(max_length=MAX_KEYS_PER_OP)]


class RemoteRun(Message, tag="remote_run"):
    """Pull on miss: which configured peer holds the longest run of `keys` (the blocks after
    a local prefix), from the first, as their inventory feeds say; answered by `Run`."""

    keys: Keys


class PeerFetch(Message, tag="peer_fetch"):
    """Ask the Runner to fetch `keys` from a peer it is configured to trust (async: a Ticket)."""

    endpoint: Annotated[str, msgspec.Meta(max_length=300)]
    keys: Keys
    deadline_ms: Annotated[int, msgspec.Meta(ge=1, le=60_000)]


class PeerPoll(Message, tag="peer_poll"):
    ticket: OpRef


Op = (Lookup | Contains | Reserve | Commit | Abort | Acquire | Release | Stats | Clear
      | PostHint | HintSources | RemoteRun | PeerFetch | PeerPoll)


class Request(Message, tag="request"):
    seq: Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1)]
    ops: Annotated[list[Op], msgspec.Meta(max_length=MAX_OPS_PER_REQUEST)]


# -- server -> client -------------------------------------------------------------------------


class Welcome(Message, tag="welcome"):
    protocol: int
    owner: int
    namespace_digest: bytes
    slot_bytes: int
    stride_bytes: int
    capacity_slots: int
    region_bytes: int
    backed: bool = False
    """The Runner backs the pool's pages: every page (kvcr-guard --prefault) or each before
    it is handed out (--back-ahead). The engine may map them ahead of use, each once it is
    backed. Absent from an older Runner's Welcome (read as false)."""


class Goodbye(Message, tag="goodbye"):
    reason: CloseReason
    detail: str


class Count(Message, tag="count"):
    n: int


class Flags(Message, tag="flags"):
    values: list[bool]


class Slots(Message, tag="slots"):
    op: int
    slots: list[int]  # NO_SLOT where the key got none
    granted: int
    refused: int
    checksums: list[int] = msgspec.field(default_factory=list)  # Acquire(checksums=True)


class Done(Message, tag="done"):
    ok: bool


class PoolStats(Message, tag="pool_stats"):
    capacity_slots: int
    ready_blocks: int
    filling_blocks: int
    free_slots: int
    leased_slots: int
    open_reservations: int
    open_leases: int
    evictions: int


class StatusReport(Message, tag="status"):
    json: str


class Ticket(Message, tag="ticket"):
    id: int


class FetchOutcome(Message, tag="fetch_outcome"):
    done: bool
    statuses: list[FetchStatus]  # per key, once done


class Sources(Message, tag="sources"):
    """`index[i]`: position in `endpoints` of hash i's hinted source, or -1."""

    endpoints: list[str]
    index: list[int]


class Run(Message, tag="run"):
    """`RemoteRun`'s answer: the first `n` keys are held by `endpoint` ("" and 0: by no peer,
    or by none in a run worth fetching)."""

    endpoint: str
    n: int


class Refused(Message, tag="refused"):
    reason: RefusalReason
    detail: str


Result = (Count | Flags | Slots | Done | PoolStats | Ticket | FetchOutcome | Sources | Run
          | Refused)


class Reply(Message, tag="reply"):
    seq: int
    results: list[Result]


ClientMessage = Hello | Probe | Request
ServerMessage = Welcome | Goodbye | Reply | StatusReport


_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)


def decode_client(payload: bytes | bytearray | memoryview) -> Hello | Probe | Request:
    """Raises msgspec.DecodeError / ValidationError on anything that is not a client message."""
    return _client_decoder.decode(payload)


def decode_server(payload: bytes | bytearray | memoryview
                  ) -> Welcome | Goodbye | Reply | StatusReport:
    return _server_decoder.decode(payload)


def op_key_count(op: Op) -> int:
    keys = getattr(op, "keys", None) or getattr(op, "hashes", None)
    return 0 if keys is None else len(keys)
