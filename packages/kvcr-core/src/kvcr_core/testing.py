"""Test doubles and helpers shipped with the product (the `trio.testing` pattern).

- `pattern_block(key, nbytes)`: deterministic bytes derived from a block key, so any reader
  can check that a slot holds exactly the bytes written for that key.
- `random_keys(n, seed)`: distinct 16-byte keys without hashing token ids.
- `RaisingPolicy`: an eviction policy whose every hook raises, to prove the index survives.
- `network_namespaces`: two throwaway network namespaces joined by a veth pair (root only),
  the "two hosts" of peer tests and benchmarks.
- `FakePeerSource`: a peer source that authenticates correctly, then misbehaves as told
  (wrong bytes, silence, death, NIXL addresses it never registered), over TCP or NIXL.
Pure and thread-safe, except `network_namespaces` (creates and removes system state) and
`FakePeerSource` (a listening socket and one thread, ended by `close`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator

from kvcr_core.framing import recv_frame
from kvcr_core.memory import HostRegion, RegionKind
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.auth import PeerSecret
from kvcr_core.peers.nixl_transport import NixlEngine
from kvcr_core.peers.protocol import Transport
from kvcr_core.types import KEY_BYTES, BlockKey, SlotId


def pattern_block(key: bytes, nbytes: int) -> bytes:
    """`nbytes` of content that only `key` produces (BLAKE2b-512 of the key, repeated)."""
    unit = hashlib.blake2b(key, digest_size=64).digest()
    reps, rest = divmod(nbytes, len(unit))
    return unit * reps + unit[:rest]


def random_keys(n: int, seed: int = 0) -> list[BlockKey]:
    rng = random.Random(seed)
    return [BlockKey(rng.getrandbits(8 * KEY_BYTES).to_bytes(KEY_BYTES, "little"))
            for _ in range(n)]


class RaisingPolicy:
    """An eviction policy plug-in that fails at every call."""

    name = "raising"

    def __init__(self, capacity_slots: int) -> None:
        self.capacity_slots = capacity_slots

    def on_ready(self, slot: SlotId, key: BlockKey) -> None:
        raise RuntimeError("policy on_ready failed")

    def on_access(self, slot: SlotId, key: BlockKey) -> None:
        raise RuntimeError("policy on_access failed")

    def on_remove(self, slot: SlotId, key: BlockKey, evicted: bool) -> None:
        raise RuntimeError("policy on_remove failed")

    def victims(self) -> Iterator[SlotId]:
        raise RuntimeError("policy victims failed")


@contextlib.contextmanager
def network_namespaces(tag: str, subnet: int) -> Iterator[tuple[str, str, str] | None]:
    """Namespaces `kvcr<tag>a` (10.201.<subnet>.1) and `kvcr<tag>b` (.2) joined by a veth
    pair; yields (a, b, address of a), or None when they cannot be made (not root, no
    iproute2). Removed on exit, and before creation in case a crashed run left them."""
    names = (f"kvcr{tag}a", f"kvcr{tag}b")

    def remove() -> None:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30,
                           check=False)

    if os.geteuid() != 0 or shutil.which("ip") is None:
        yield None
        return
    a, b = names
    va, vb = f"kvcr{tag}va", f"kvcr{tag}vb"
    steps = [("netns", "add", a), ("netns", "add", b),
             ("link", "add", va, "type", "veth", "peer", "name", vb),
             ("link", "set", va, "netns", a), ("link", "set", vb, "netns", b),
             ("-n", a, "addr", "add", f"10.201.{subnet}.1/24", "dev", va),
             ("-n", b, "addr", "add", f"10.201.{subnet}.2/24", "dev", vb),
             ("-n", a, "link", "set", va, "up"), ("-n", b, "link", "set", vb, "up"),
             ("-n", a, "link", "set", "lo", "up"), ("-n", b, "link", "set", "lo", "up")]
    remove()
    try:
        for step in steps:
            subprocess.run(["ip", *step], check=True, capture_output=True, timeout=30)
    except subprocess.CalledProcessError:
        remove()
        yield None
        return
    try:
        yield a, b, f"10.201.{subnet}.1"
    finally:
        remove()


class FakePeerSource:
    """A peer source that authenticates with `secret`, then misbehaves as `behaviour` says:
    "ok", "wrong_bytes" (block 1's bytes are zeros under the right checksum), "stall" (TCP:
    falls silent inside block 1; NIXL: answers nothing until `release`), "die" (TCP: closes
    inside block 1; NIXL: closes before answering), "outside" (NIXL: names an address nobody
    registered), "sums_out_of_order" (NIXL with late checksums: sends them from the second
    block on). Over NIXL its blocks lie in a region of this process's agent (the client reads
    them as loopback), and it sends the checksums late (after NixlBlocks) when the client
    offered late_checksums. Serves one connection and one fetch."""

    def __init__(self, secret: PeerSecret, block_bytes: int, behaviour: str,
                 transport: Transport = Transport.TCP, max_blocks: int = 16) -> None:
        self.secret = secret
        self.block_bytes = block_bytes
        self.behaviour = behaviour
        self.nixl = transport is Transport.NIXL
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.release = threading.Event()
        self.late = False  # NIXL: sends checksums after NixlBlocks (the client offered it)
        self.done: object = None  # NIXL: the FetchDone the client sent
        self.region = HostRegion.create(max_blocks * block_bytes, RegionKind.ANONYMOUS)
        self.metadata = (NixlEngine.shared().register(self.region.address, self.region.size_bytes)
                         if self.nixl else b"")
        threading.Thread(target=self._run, name="kvcr-fake-peer", daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.listener.close()
        if self.nixl:
            NixlEngine.shared().deregister(self.region.address, self.region.size_bytes)

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        with conn, contextlib.suppress(OSError):
            hello = pp.decode_to_server(recv_frame(conn)[0])
            assert isinstance(hello, pp.Hello)
            nonce = os.urandom(32)
            conn.sendall(pp.encode(pp.Challenge(1, nonce, self.secret.prove(b"server", nonce,
                                                                             hello.nonce))))
            auth = pp.decode_to_server(recv_frame(conn)[0])
            assert isinstance(auth, pp.Auth)
            self.late = self.nixl and pp.LATE_CHECKSUMS in auth.features
            conn.sendall(pp.encode(pp.Ready(Transport.NIXL.value, self.metadata,
                                            [pp.LATE_CHECKSUMS] if self.late else [])
                                   if self.nixl else pp.Ready()))
            fetch = pp.decode_to_server(recv_frame(conn)[0])
            assert isinstance(fetch, pp.Fetch)
            blocks = [pattern_block(k, self.block_bytes) for k in fetch.keys]
            sums = [pp.checksum(b) for b in blocks]
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
