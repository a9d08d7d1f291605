"""`ClientSession`: the attach protocol's codec for one connection, in front of a
`RunnerService`.

A session starts NEW. A valid `Hello` asks the host (`RunnerHost.attach`: admission, then the
namespaces opened in order) for the client's service; the session is then ATTACHED and its
`Welcome` carries each namespace's pool and memfd. Each `Request` is decoded, budgeted (the
service's `RequestBudget` spans the request), each op applied to the service (`Op.apply`) and
the results encoded in order; a refusal of one op (`RunnerRefused`) is its `Refused` result.
A protocol violation (a malformed message, a second Hello, a seq that does not increase, a
namespace index or a checksum count that does not fit) raises `SessionClosed` with a bounded
reason: the server closes this connection and nothing else is affected. `close` detaches the
service (its writes aborted, its reads released).

Threading: used by one thread at a time (the server's loop thread).
"""

from __future__ import annotations

import enum
import time

import msgspec

from kvcr_core.attach import protocol as p
from kvcr_core.attach.admission import AttachRefused
from kvcr_core.attach.host import RunnerHost
from kvcr_core.attach.ops import RunnerRefused
from kvcr_core.attach.protocol import CloseReason
from kvcr_core.attach.service import RunnerService
from kvcr_core.errors import ConfigError
from kvcr_core.keys import NamespaceSpec
from kvcr_core.types import OwnerId


class SessionClosed(Exception):
    """Close the connection; `goodbye` tells the client why first (when it is worth it)."""

    def __init__(self, reason: CloseReason, detail: str, *, goodbye: bool = True) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.goodbye = goodbye


class _State(enum.Enum):
    NEW = "new"
    ATTACHED = "attached"


class ClientSession:
    def __init__(self, owner: OwnerId, peer_pid: int, uid: int, host: RunnerHost,
                 socket_path: str) -> None:
        self.owner = owner
        self.peer_pid = peer_pid
        self.uid = uid
        self.identity = ""
        self.service: RunnerService | None = None
        self._host = host
        self._socket_path = socket_path
        self._state = _State.NEW
        self._seq = 0

    @property
    def attached(self) -> bool:
        return self._state is _State.ATTACHED

    def handle(self, payload: bytes | bytearray) -> tuple[bytes, list[int], bool]:
        """One client frame -> (reply frame, fds to pass, close after sending)."""
        try:
            message = p.decode_client(payload)
        except msgspec.MsgspecError as exc:
            raise SessionClosed(CloseReason.MALFORMED, str(exc)) from None
        if isinstance(message, p.Probe):
            if self._state is not _State.NEW:
                raise SessionClosed(CloseReason.OUT_OF_ORDER, "Probe after Hello")
            report = self._host.status(self._socket_path, self.uid)
            return p.encode_frame(p.StatusReport(report)), [], True
        if isinstance(message, p.Hello):
            return self._hello(message)
        return p.encode_frame(self._request(message)), [], False

    def _hello(self, hello: p.Hello) -> tuple[bytes, list[int], bool]:
        if self._state is not _State.NEW:
            raise SessionClosed(CloseReason.OUT_OF_ORDER, "a second Hello")
        if hello.protocol != p.PROTOCOL_VERSION:
            raise SessionClosed(CloseReason.WRONG_VERSION,
                                f"client speaks protocol {hello.protocol}, this runner "
                                f"{p.PROTOCOL_VERSION}; install matching kvcr versions")
        try:
            specs = [NamespaceSpec.from_mapping(msgspec.structs.asdict(ns))
                     for ns in hello.namespaces]
        except ConfigError as exc:
            raise SessionClosed(CloseReason.BAD_NAMESPACE, str(exc)) from None
        try:
            service = self._host.attach(self.owner, self.uid, specs, hello.block_bytes,
                                        hello.identity)
        except AttachRefused as exc:
            raise SessionClosed(exc.reason, exc.detail) from None
        self.service = service
        self.identity = hello.identity[:128]
        self._state = _State.ATTACHED
        pools = [store.pool for store in service.stores]
        welcome = p.Welcome(p.PROTOCOL_VERSION, self.owner, [
            p.PoolInfo(store.digest, pool.slot_bytes, pool.stride_bytes, pool.capacity_slots,
                       pool.region.size_bytes, pool.region.backs_pages,
                       grant.shared)
            for store, pool, grant in zip(service.stores, pools, service.grants,
                                          strict=True)])
        return p.encode_frame(welcome), [pool.region.fd for pool in pools], False

    def _request(self, request: p.Request) -> p.Reply:
        service = self.service
        if self._state is not _State.ATTACHED or service is None:
            raise SessionClosed(CloseReason.OUT_OF_ORDER, "a Request before Hello")
        if request.seq <= self._seq:
            raise SessionClosed(CloseReason.OUT_OF_ORDER,
                                f"seq {request.seq} after {self._seq}: must increase")
        self._seq = request.seq
        start = time.perf_counter()
        service.begin_request()
        try:
            results = [self._apply(op, service) for op in request.ops]
        finally:
            refused = service.end_request()
        self._host.metrics.on_request(time.perf_counter() - start, len(request.ops), refused)
        return p.Reply(request.seq, results)

    @staticmethod
    def _apply(op: p.Op, service: RunnerService) -> p.Result:
        try:
            return op.apply(service)
        except RunnerRefused as exc:
            return p.Refused(exc.refusal, exc.detail)
        except ValueError as exc:  # a namespace index or a count that does not fit
            raise SessionClosed(CloseReason.MALFORMED, str(exc)) from None

    def close(self) -> tuple[int, int]:
        """The client is gone: abort its writes, release its reads. READY blocks stay."""
        service, self.service = self.service, None
        return (0, 0) if service is None else self._host.detach(service)
