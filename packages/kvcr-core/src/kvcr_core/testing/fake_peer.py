"""In-process peer doubles: `LoopbackTransport` (a read transport whose READs are memmoves
within this process: two Runners of one test, no NIXL needed) and `FakePeerSource` (a source
that misbehaves as told, over TCP or a read transport).

`FakePeerSource` owns a listening socket and one thread, ended by `close`; the loopback
engine is thread-safe (one lock over its table of exposed regions).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvcr_core.checksums import block_checksum
from kvcr_core.framing import recv_frame
from kvcr_core.memory import HostRegion, RegionKind
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.auth import PeerSecret
from kvcr_core.peers.lanes import ReadLanes
from kvcr_core.peers.protocol import TransportKind
from kvcr_core.peers.reads import ReadTransport
from kvcr_core.peers.transport import ReadRefused, TransportError
from kvcr_core.testing.blocks import pattern_block


class _Copy:
    """One READ: memmoves of `nbytes` from each source address to each slot address."""

    def __init__(self, pairs: list[tuple[int, int]], nbytes: int) -> None:
        self.pairs, self.nbytes, self.state = pairs, nbytes, "INIT"

    def start(self, deadline: float) -> None:
        if time.monotonic() >= deadline:
            raise TimeoutError("deadline passed before a loopback read")
        for destination, source in self.pairs:
            ctypes.memmove(destination, source, self.nbytes)
        self.state = "DONE"

    def wait(self, deadline: float) -> None:
        return None  # copied within start

    def release(self) -> None:
        return None


class _Reads:
    def __init__(self, slots: tuple[int, int, int, int], remote: list[int], nbytes: int) -> None:
        self.slots, self.remote, self.nbytes = slots, remote, nbytes

    def make(self, local: Sequence[int], first: int) -> _Copy:
        address, stride, _, count = self.slots
        if any(not 0 <= i < count for i in local) or first + len(local) > len(self.remote):
            raise ReadRefused("a read beyond the prepared slots or addresses")
        return _Copy([(address + i * stride, self.remote[first + n])
                      for n, i in enumerate(local)], self.nbytes)

    def release(self) -> None:
        return None


class LoopbackEngine:
    """The read engine of `LoopbackTransport` (kvcr_core.peers.reads.ReadEngine): regions
    exposed here may be read by this process's own loopback clients, nothing else; a read
    naming memory outside them is refused before anything moves."""

    def __init__(self) -> None:
        self.name = f"loopback-{os.getpid()}-{secrets.token_hex(4)}"
        self.read_lanes = ReadLanes(0)
        self._lock = threading.Lock()
        self._regions: dict[tuple[int, int], int] = {}  # (address, bytes) -> users

    def start(self, *, wait: bool = False) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def register(self, address: int, nbytes: int) -> bytes:
        with self._lock:
            self._regions[address, nbytes] = self._regions.get((address, nbytes), 0) + 1
        return self.name.encode()

    def deregister(self, address: int, nbytes: int) -> None:
        with self._lock:
            users = self._regions.pop((address, nbytes), 0)
            if users > 1:
                self._regions[address, nbytes] = users - 1

    def add_peer(self, metadata: bytes) -> str:
        if metadata != self.name.encode():
            raise TransportError("a loopback source in another process or transport")
        return self.name

    def drop_peer(self, name: str) -> None:
        return None

    def progress(self) -> None:
        return None

    def slot_list(self, address: int, stride: int, nbytes: int, count: int) -> Any:
        return (address, stride, nbytes, count)

    def prepare_reads(self, peer: str, slots: Any, remote: Sequence[int],
                      nbytes: int) -> _Reads:
        with self._lock:
            regions = list(self._regions)
        for at in remote:
            if not any(base <= at and at + nbytes <= base + size for base, size in regions):
                raise ReadRefused(f"{nbytes} bytes at {at:#x} lie outside what was exposed")
        return _Reads(slots, list(remote), nbytes)


class LoopbackTransport(ReadTransport):
    """Reads by memmove between pools of this process: the same protocol and checks as NIXL
    (addresses, late checksums, FetchDone, verdicts) with no NIXL, for tests of peers and of
    what uses them. Give the same instance to the `PeerServer` and the `PeerClient`."""

    kind = TransportKind.LOOPBACK
    drives_progress = False

    def __init__(self, **options: Any) -> None:
        super().__init__(LoopbackEngine(), **options)


class FakePeerSource:
    """A peer source that authenticates with `secret`, then misbehaves as `behaviour` says:
    "ok", "wrong_bytes" (block 1's bytes are zeros under the right checksum), "stall" (TCP:
    falls silent inside block 1; reads: answers nothing until `release`), "die" (TCP: closes
    inside block 1; reads: closes before answering), "outside" (reads: names an address nobody
    registered), "sums_out_of_order" (reads with late checksums: sends them from the second
    block on). `transport`: None for TCP, or a `ReadTransport` (NIXL, loopback) whose engine
    holds its blocks (the client reads them from this process); it sends the checksums late
    (after NixlBlocks) when the client offered late_checksums. Serves one connection and one
    fetch."""

    def __init__(self, secret: PeerSecret, block_bytes: int, behaviour: str,
                 transport: ReadTransport | None = None, max_blocks: int = 16) -> None:
        self.secret = secret
        self.block_bytes = block_bytes
        self.behaviour = behaviour
        self.transport = transport
        self.nixl = transport is not None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.release = threading.Event()
        self.late = False  # NIXL: sends checksums after NixlBlocks (the client offered it)
        self.done: object = None  # NIXL: the FetchDone the client sent
        self.region = HostRegion.create(max_blocks * block_bytes, RegionKind.ANONYMOUS)
        self.metadata = (transport.engine.register(self.region.address, self.region.size_bytes)
                         if transport is not None else b"")
        threading.Thread(target=self._run, name="kvcr-fake-peer", daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.listener.close()
        if self.transport is not None:
            self.transport.engine.deregister(self.region.address, self.region.size_bytes)

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        with conn, contextlib.suppress(OSError):
            hello = pp.decode_to_server(recv_frame(conn)[0])
            assert isinstance(hello, pp.Hello)
            nonce = os.urandom(32)
            conn.sendall(pp.encode(pp.Challenge(pp.PEER_PROTOCOL_VERSION, nonce)))
            auth = pp.decode_to_server(recv_frame(conn)[0])
            assert isinstance(auth, pp.Auth)
            self.late = self.nixl and pp.LATE_CHECKSUMS in auth.features
            proof = self.secret.prove(b"server", nonce, hello.nonce)
            conn.sendall(pp.encode(pp.Ready(proof, "", self.transport.kind, self.metadata,
                                            [pp.LATE_CHECKSUMS] if self.late else [])
                                   if self.transport is not None else pp.Ready(proof, "")))
            fetch = pp.decode_to_server(recv_frame(conn)[0])
            assert isinstance(fetch, pp.Fetch)
            blocks = [pattern_block(k, self.block_bytes) for k in fetch.keys]
            sums = [block_checksum(b) for b in blocks]
            if self.behaviour == "wrong_bytes":
                blocks[1] = bytes(self.block_bytes)  # claims the checksum of the right bytes
            if self.nixl:
                self._serve_nixl(conn, fetch.seq, blocks, sums)
            else:
                self._serve_tcp(conn, fetch.seq, blocks, sums)
            self.release.wait(30)

    def _serve_tcp(self, conn: socket.socket, seq: int, blocks: list[bytes],
                   sums: list[int]) -> None:
        conn.sendall(pp.encode(pp.Blocks(seq, [True] * len(blocks))))
        if self.behaviour in ("stall", "die"):
            conn.sendall(blocks[0] + pp.CHECKSUM.pack(sums[0]) + blocks[1][:100])
            if self.behaviour == "die":
                conn.shutdown(socket.SHUT_RDWR)
            return
        for block, value in zip(blocks, sums, strict=True):
            conn.sendall(block + pp.CHECKSUM.pack(value))

    def _serve_nixl(self, conn: socket.socket, seq: int, blocks: list[bytes],
                    sums: list[int]) -> None:
        if self.behaviour == "die":
            conn.shutdown(socket.SHUT_RDWR)  # gone before saying where the blocks are
            return
        if self.behaviour == "stall":
            self.release.wait(30)  # says nothing until released
        size = self.block_bytes
        for i, block in enumerate(blocks):
            self.region.view[i * size:(i + 1) * size] = block
        addresses = [self.region.address + i * size for i in range(len(blocks))]
        if self.behaviour == "outside":
            addresses[1] = 1 << 12  # the second page of the address space: never registered
        if not self.late:
            conn.sendall(pp.encode(pp.NixlBlocks(seq, [True] * len(blocks), addresses, sums)))
        else:  # the first checksum with the addresses, the others after
            skip = 1 if self.behaviour == "sums_out_of_order" else 0
            conn.sendall(pp.encode(pp.NixlBlocks(seq, [True] * len(blocks), addresses,
                                                 sums[:1])))
            conn.sendall(pp.encode(pp.NixlChecksums(seq, 1 + skip, sums[1 + skip:])))
        self.done = pp.decode_to_server(recv_frame(conn)[0])  # FetchDone
