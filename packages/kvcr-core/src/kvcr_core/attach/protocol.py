"""The attach protocol, version 3: framed msgpack messages over a Unix socket.

Frame: 4-byte little-endian payload length, then a msgpack payload of one tagged message.
Frames are bounded (`MAX_FRAME_BYTES`; before Hello, `MAX_HELLO_FRAME_BYTES`); a bigger
announced length is a protocol violation. Every field is typed and bounded by the decoder
(key lengths, counts, block size, namespace fields, op ids): a message that decodes is safe to
act on. Version 3 (against 2): a client opens a set of namespaces (one per TP rank) in one
Hello and gets one memfd each; operations name theirs by index (`ns`); `LookupAll`,
`AcquireAll` and `PeerFetch` cover several namespaces in one operation.

Order: the client sends `Hello` first and once (or a single `Probe` for status). The server
answers `Welcome` with the pools' memfds attached by SCM_RIGHTS, or `Goodbye(reason)` and
closes. Then each `Request` carries a strictly increasing `seq` and a batch of operations
(one engine step = one round trip); the server answers one `Reply` with one result per
operation, in order. Anything else (unknown tag, wrong version, a second Hello, a request
before Hello, a seq that does not increase, too many ops or keys, a namespace index the
client did not open) closes the connection with a counted, logged reason; the server and its
other clients are unaffected.

Each operation is one message here that knows the `RunnerOps` call it stands for (`apply`)
and the result message that carries its answer; the server's codec calls `apply` on its
client's `RunnerService`, and `AttachClient`'s stub of the same call sends it. Reasons and
statuses are enums (`CloseReason`, `RefusalReason`, `FetchStatus`); the message base and
`PostHint` are shared with the peer protocol (kvcr_core.wire). Pure data and codecs;
thread-safe.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Annotated, Final

import msgspec

from kvcr_core import wire
from kvcr_core.framing import FRAME_HEADER as FRAME_HEADER
from kvcr_core.framing import MAX_FRAME_BYTES as MAX_FRAME_BYTES
from kvcr_core.framing import FrameError as FrameError
from kvcr_core.framing import recv_frame as recv_frame
from kvcr_core.index import Lease, Reservation
from kvcr_core.types import FetchStatus, OpId
from kvcr_core.wire import Message
from kvcr_core.wire import encode_frame as encode_frame

if TYPE_CHECKING:
    from kvcr_core.attach.ops import RunnerOps
    from kvcr_core.types import BlockKey

PROTOCOL_VERSION: Final = 3
MAX_NAMESPACES_PER_CLIENT: Final = 32
"""Namespaces one client may open (TP ranks of one engine); one memfd each."""
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
MAX_HELLO_FRAME_BYTES: Final = 32 << 10
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
Ns = Annotated[int, msgspec.Meta(ge=0, lt=MAX_NAMESPACES_PER_CLIENT)]
KeySets = Annotated[list[Keys], msgspec.Meta(min_length=1, max_length=MAX_NAMESPACES_PER_CLIENT)]


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
    NOT_ALLOWED = "not_allowed"  # a Clear of a namespace other uids share


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
    """Opens `namespaces` (in order: the client's `ns` 0, 1, ...), every one of
    `block_bytes`-byte blocks."""

    protocol: Annotated[int, msgspec.Meta(ge=0)]
    namespaces: Annotated[list[NamespaceFields],
                          msgspec.Meta(min_length=1, max_length=MAX_NAMESPACES_PER_CLIENT)]
    block_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_BYTES)]
    identity: Annotated[str, msgspec.Meta(max_length=256)]
    pid: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]


class Probe(Message, tag="probe"):
    """An operator's status query (`kvcr status`): allowed instead of Hello, answered with
    `StatusReport`, then the server closes the connection."""

    protocol: int


def _keys(keys: list[bytes]) -> list[BlockKey]:
    return keys  # type: ignore[return-value]  # length and count checked by the decoder


class Lookup(Message, tag="lookup"):
    keys: Keys
    ns: Ns = 0

    def apply(self, ops: RunnerOps) -> Result:
        return Count(ops.lookup(_keys(self.keys), self.ns))


class LookupAll(Message, tag="lookup_all"):
    """`keys[i]`: namespace i's keys of the same blocks; answered by the READY prefix common
    to all of them (`Count`)."""

    keys: KeySets

    def apply(self, ops: RunnerOps) -> Result:
        return Count(ops.lookup_all([_keys(k) for k in self.keys]))


class Contains(Message, tag="contains"):
    keys: Keys
    ns: Ns = 0

    def apply(self, ops: RunnerOps) -> Result:
        return Flags(ops.contains(_keys(self.keys), self.ns))


class Reserve(Message, tag="reserve"):
    keys: Keys
    ns: Ns = 0

    def apply(self, ops: RunnerOps) -> Result:
        return Slots.of(ops.reserve(_keys(self.keys), self.ns))


class Commit(Message, tag="commit"):
    """Publishes reservation `op`; `checksums`: the xxh3-64 of each block granted, in the
    reservation's order, taken by the writer right after its copy (what peers are served and
    local loads may verify)."""

    op: OpRef
    checksums: Checksums
    ns: Ns = 0

    def apply(self, ops: RunnerOps) -> Result:
        return Count(ops.commit(OpId(self.op), self.checksums, self.ns))


class Abort(Message, tag="abort"):
    op: OpRef
    ns: Ns = 0

    def apply(self, ops: RunnerOps) -> Result:
        return Count(ops.abort(OpId(self.op), self.ns))


class Acquire(Message, tag="acquire"):
    """Leases READY blocks; `checksums`: also answer each leased block's checksum."""

    keys: Keys
    prefix_only: bool = True
    checksums: bool = False
    ns: Ns = 0

    def apply(self, ops: RunnerOps) -> Result:
        return Slots.of(ops.acquire(_keys(self.keys), self.ns, prefix_only=self.prefix_only,
                                    checksums=self.checksums))


class AcquireAll(Message, tag="acquire_all"):
    """Leases the READY prefix of `keys[i]` in namespace i, for every i (`Leases`)."""

    keys: KeySets
    checksums: bool = False

    def apply(self, ops: RunnerOps) -> Result:
        leases = ops.acquire_all([_keys(k) for k in self.keys], checksums=self.checksums)
        return Leases([Slots.of(lease) for lease in leases])


class Release(Message, tag="release"):
    op: OpRef
    ns: Ns = 0

    def apply(self, ops: RunnerOps) -> Result:
        return Done(ops.release(OpId(self.op), self.ns))


class Stats(Message, tag="stats"):
    ns: Ns = 0

    def apply(self, ops: RunnerOps) -> Result:
        return ops.stats(self.ns)


class Clear(Message, tag="clear"):
    """Drop every READY, unleased block of the namespace (SGLang's storage `clear`)."""

    ns: Ns = 0

    def apply(self, ops: RunnerOps) -> Result:
        return Count(ops.clear(self.ns))


class PostHint(wire.PostHint, tag="post_hint"):
    """`kvcr_core.wire.PostHint`, posted by an engine to its Runner."""

    def apply(self, ops: RunnerOps) -> Result:
        return Count(ops.post_hint(self.envelope))


class RemovedSince(Message, tag="removed_since"):
    """Which blocks of the client's namespaces left the Runner after inventory batch `since`
    (-1: from now on); answered by `Removed`."""

    since: Annotated[int, msgspec.Meta(ge=-1, le=(1 << 63) - 1)]

    def apply(self, ops: RunnerOps) -> Result:
        return ops.removed_since(self.since)


class HintSources(Message, tag="hint_sources"):
    """Which posted hint names a source for each router hash; answered by `Sources`."""

    hashes: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]],
                      msgspec.Meta(max_length=MAX_KEYS_PER_OP)]

    def apply(self, ops: RunnerOps) -> Result:
        return Sources.of(ops.hint_sources(self.hashes))


class RemoteRun(Message, tag="remote_run"):
    """Pull on miss: which configured peer holds the longest run of `keys` (the blocks after
    a local prefix), from the first, as their inventory feeds say; answered by `Run`."""

    keys: Keys
    ns: Ns = 0

    def apply(self, ops: RunnerOps) -> Result:
        found = ops.remote_run(_keys(self.keys), self.ns)
        return Run(*found) if found is not None else Run("", 0)


class PeerFetch(Message, tag="peer_fetch"):
    """Ask the Runner to fetch `keys[i]` into namespace i from a peer it is configured to
    trust (async: a Ticket covering them all)."""

    endpoint: Annotated[str, msgspec.Meta(max_length=300)]
    keys: KeySets
    deadline_ms: Annotated[int, msgspec.Meta(ge=1, le=60_000)]

    def apply(self, ops: RunnerOps) -> Result:
        return Ticket(ops.peer_fetch(self.endpoint, [_keys(k) for k in self.keys],
                                     self.deadline_ms / 1000))


class PeerPoll(Message, tag="peer_poll"):
    ticket: OpRef

    def apply(self, ops: RunnerOps) -> Result:
        return ops.peer_poll(self.ticket)


Op = (Lookup | LookupAll | Contains | Reserve | Commit | Abort | Acquire | AcquireAll
      | Release | Stats | Clear | RemovedSince | PostHint | HintSources | RemoteRun | PeerFetch
      | PeerPoll)


class Request(Message, tag="request"):
    seq: Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1)]
    ops: Annotated[list[Op], msgspec.Meta(max_length=MAX_OPS_PER_REQUEST)]


# -- server -> client -------------------------------------------------------------------------


class PoolInfo(msgspec.Struct, array_like=True):
    """One opened namespace's pool, as `Welcome` describes it (its memfd travels alongside)."""

    namespace_digest: bytes
    slot_bytes: int
    stride_bytes: int
    capacity_slots: int
    region_bytes: int
    backed: bool = False
    """The Runner backs the pool's pages: every page (kvcr-guard --prefault) or each before
    it is handed out (--back-ahead). The engine may map them ahead of use, each once it is
    backed."""
    shared: bool = False
    """Processes of other uids map this pool too (a named tenant's namespace): engines with
    `verify_loads: auto` check what they load from it."""


class Welcome(Message, tag="welcome"):
    """One `PoolInfo` and one memfd per namespace of the Hello, in its order."""

    protocol: int
    owner: int
    pools: list[PoolInfo]


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

    @classmethod
    def of(cls, taken: Reservation | Lease) -> Slots:
        slots = [NO_SLOT if s is None else s for s in taken.slots]
        if isinstance(taken, Reservation):
            return cls(taken.op, slots, taken.granted, taken.refused)
        return cls(taken.op, slots, taken.granted, 0, list(taken.checksums))


class Leases(Message, tag="leases"):
    parts: list[Slots]


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


class Removed(Message, tag="removed"):
    """Router hashes of blocks removed (evicted or dropped) from each of the client's
    namespaces (`hashes[i]`: namespace i), through inventory batch `seq`, of the Runner's
    incarnation `epoch` (a new one: it restarted, and held nothing of before). `reset`: the
    log no longer reaches back to `since`: what was held then may be gone unseen."""

    epoch: int
    seq: int
    reset: bool
    hashes: list[list[int]]


class StatusReport(Message, tag="status"):
    json: str


class Ticket(Message, tag="ticket"):
    id: int


class FetchOutcome(Message, tag="fetch_outcome"):
    """`statuses[i]`: per key of namespace i's part of the fetch, once done."""

    done: bool
    statuses: list[list[FetchStatus]]


class Sources(Message, tag="sources"):
    """`index[i]`: position in `endpoints` of hash i's hinted source, or -1."""

    endpoints: list[str]
    index: list[int]

    @classmethod
    def of(cls, sources: list[str | None]) -> Sources:
        endpoints: list[str] = []
        index: list[int] = []
        for source in sources:
            if source is None:
                index.append(-1)
                continue
            if source not in endpoints:
                endpoints.append(source)
            index.append(endpoints.index(source))
        return cls(endpoints, index)

    def each(self) -> list[str | None]:
        return [self.endpoints[i] if i >= 0 else None for i in self.index]


class Run(Message, tag="run"):
    """`RemoteRun`'s answer: the first `n` keys are held by `endpoint` ("" and 0: by no peer,
    or by none in a run worth fetching)."""

    endpoint: str
    n: int


class Refused(Message, tag="refused"):
    reason: RefusalReason
    detail: str


Result = (Count | Flags | Slots | Leases | Done | PoolStats | Removed | Ticket | FetchOutcome
          | Sources | Run | Refused)


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
    """Keys (or hashes) the op names, every namespace's together."""
    keys = getattr(op, "keys", None) or getattr(op, "hashes", None)
    if not keys:
        return 0
    return sum(map(len, keys)) if isinstance(keys[0], list) else len(keys)
