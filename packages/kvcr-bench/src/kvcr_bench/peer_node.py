"""The two processes of `kvcr bench peer` (`python -m kvcr_bench.peer_node`).

source: holds N pattern blocks in a Runner and serves them with a `PeerServer` (TCP only, or
  NIXL), plus a raw control socket for the baselines: `R first count` streams the slot bytes
  of those blocks, gathered 1 MiB per `sendmsg` as the server does (the raw TCP baseline);
  `S` stores every block again (new slot generations, so the next kvcr fetch recomputes every
  source checksum: "cold") and answers with the blocks' addresses (the raw NIXL baseline
  reads them). With NIXL its main thread drives NIXL progress every 0.1 ms for the raw reads
  (the progress thread is off; UCX over TCP needs the source's), until `P 0` says they copy
  within the post (cma), as the server stops when a peer's FetchDone says so.
destination: times, alternating within each repetition, the raw baseline into a plain page-
  aligned region, with NIXL that READ split in two on the engine's two read lanes ("raw x2",
  for reference: kvcr READs a fetch on those lanes), the raw transfer followed by xxh3 of
  each block (the cost of verifying in line, for reference), a cold kvcr fetch and a warm
  one into its pool's reserved slots (64 blocks per fetch), then one-block operations;
  prints one JSON row. Single-threaded apart from the servers' own threads and the read
  lanes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from kvcr_core.checksums import block_checksum as checksum
from kvcr_core.config import KVCRConfig
from kvcr_core.framing import recv_exact_into, send_all
from kvcr_core.memory import HostRegion, RegionKind
from kvcr_core.peers import (
    FleetCredential,
    NodeKey,
    PeerClient,
    PeerCredential,
    PeerMetrics,
    PeerSecret,
    PeerServer,
)
from kvcr_core.peers.lanes import LaneJob
from kvcr_core.peers.nixl_engine import NixlEngine
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.testing import pattern_block, random_keys, secret_for
from kvcr_core.types import BlockKey, NamespaceDigest

SECRET = secret_for("kvcr-bench-peer-secret-0123456789").encode()
DIGEST = NamespaceDigest(b"kvcr-bench-peer!")
BATCH = 64
SMALL_OPS = 200
_REQ = struct.Struct("<cII")  # op, first block, block count
_LEN = struct.Struct("<I")


def _store_all(store: NamespaceStore, keys: list[BlockKey]) -> None:
    with store.lock:
        store.index.discard(keys)
    for i in range(0, len(keys), 256):
        batch = keys[i:i + 256]
        store.store(batch, [pattern_block(k, store.block_bytes) for k in batch])


def _addresses(store: NamespaceStore, keys: list[BlockKey]) -> list[int]:
    base, offset, slot_of = store.pool.region.address, store.pool.offset, store.index.slot_of
    slots = [slot_of(k) for k in keys]
    return [base + offset(s) for s in slots if s is not None]


def _credential(fleet: str, name: str) -> PeerCredential:
    """The fleet identity `name` of the bench's fleet directory, else the shared secret."""
    if not fleet:
        return PeerSecret(SECRET)
    return FleetCredential(NodeKey.from_file(os.path.join(fleet, f"{name}.key")),
                           os.path.join(fleet, "fleet.yaml"))


def source(host: str, blocks: int, block_bytes: int, nixl: bool, fleet: str = "") -> None:
    runner = Runner(KVCRConfig(pool_bytes=(blocks + 8) * block_bytes))
    store = runner.open_namespace(DIGEST, block_bytes, prefault=True)
    keys = random_keys(blocks, seed=5)
    _store_all(store, keys)
    engine = NixlEngine.shared() if nixl else None
    metadata = b""
    if engine is not None:
        if not engine.wait_ready(120):
            print(json.dumps({"error": f"NIXL did not start: {engine.failure}"}), flush=True)
            return
        metadata = engine.register(store.pool.region.address, store.pool.region.size_bytes)
    server = PeerServer(runner, _credential(fleet, "source"), PeerMetrics(CollectorRegistry()),
                        host=host, nixl=nixl)
    raw = socket.create_server((host, 0))
    polling = threading.Event()  # drive NIXL progress for the raw reads (op P)
    polling.set()

    def serve_raw(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            view = store.pool.view
            while len(request := conn.recv(_REQ.size, socket.MSG_WAITALL)) == _REQ.size:
                op, first, count = _REQ.unpack(request)
                if op == b"P":  # first: 1 drive progress for the raw reads, 0 not
                    if first:
                        polling.set()
                    else:
                        polling.clear()
                    continue
                if op == b"S":
                    _store_all(store, keys)
                    reply = json.dumps(_addresses(store, keys)).encode()
                    conn.sendall(_LEN.pack(len(reply)) + reply)
                    continue
                slots = [store.index.slot_of(k) for k in keys[first:first + count]]
                per_send = max(1, (1 << 20) // block_bytes)  # gathered like the kvcr server's
                for start in range(0, count, per_send):
                    send_all(conn, [view(s) for s in slots[start:start + per_send]
                                    if s is not None])

    def accept_raw() -> None:
        while True:
            conn, _ = raw.accept()
            threading.Thread(target=serve_raw, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_raw, daemon=True).start()
    print(json.dumps({"peer": server.endpoint, "raw": list(raw.getsockname()[:2]),
                      "nixl": metadata.hex()}), flush=True)
    while True:  # as often as the server does while a peer reads, if the raw reads need it
        if engine is not None and polling.is_set():
            engine.progress()
            time.sleep(0.0001)
        else:
            time.sleep(0.01)


def _median_ratio(raw: list[float], kvcr: list[float]) -> float:
    """Median of per-repetition ratios: each pair ran back to back, so slow drifts in the load
    of a shared machine cancel out."""
    return statistics.median(r / k for r, k in zip(raw, kvcr, strict=True))


def destination(peer: str, raw_at: tuple[str, int], nixl_hex: str, blocks: int,
                block_bytes: int, reps: int, fleet: str = "") -> dict[str, Any]:
    registry = CollectorRegistry()
    runner = Runner(KVCRConfig(pool_bytes=(blocks + 8) * block_bytes), registry=registry)
    store = runner.open_namespace(DIGEST, block_bytes, prefault=True)
    engine = NixlEngine.shared() if nixl_hex else None
    if engine is not None and not engine.wait_ready(120):
        return {"error": f"NIXL did not start: {engine.failure}"}
    client = PeerClient(store, _credential(fleet, "destination"), PeerMetrics(registry),
                        nixl=bool(nixl_hex))
    keys = random_keys(blocks, seed=5)
    region = HostRegion.create(blocks * block_bytes, RegionKind.ANONYMOUS)
    region.prefault()
    raw = socket.create_connection(raw_at)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    remote: list[int] = []

    def restore() -> None:  # the source stores everything again: next kvcr fetch is cold
        raw.sendall(_REQ.pack(b"S", 0, 0))
        size = bytearray(_LEN.size)
        recv_exact_into(raw, memoryview(size))
        reply = bytearray(_LEN.unpack(size)[0])
        recv_exact_into(raw, memoryview(reply))
        remote[:] = json.loads(reply)

    if engine is not None:
        engine.register(region.address, region.size_bytes)
        source_agent = engine.add_peer(bytes.fromhex(nixl_hex))

        def needs_progress() -> bool:
            """Whether a raw READ needs the source to drive progress: not where it copies
            within the post (cma), as the kvcr server learns from FetchDone."""
            request = engine.post_read(source_agent, [region.address], remote[:1], block_bytes,
                                       time.monotonic() + 60)
            try:
                inline = request.state == "DONE"
                request.wait(time.monotonic() + 60)
            finally:
                request.release()
            return not inline

        def raw_run(first: int, count: int) -> None:
            engine.read(source_agent, [region.address + i * block_bytes
                                       for i in range(first, first + count)],
                        remote[first:first + count], block_bytes, time.monotonic() + 60)

        def raw2_run(first: int, count: int) -> None:
            """The raw READ split in two, one half on each of the engine's read lanes (each
            on a UCX worker of its own), as kvcr splits a fetch: what NIXL itself reaches with
            two cores copying."""
            halves = [(first, count // 2), (first + count // 2, count - count // 2)]

            def half(n: int) -> list[int]:
                raw_run(*halves[n])
                return []

            engine.read_lanes.run(LaneJob(2, half), time.monotonic() + 60)
    else:
        def raw_run(first: int, count: int) -> None:
            raw.sendall(_REQ.pack(b"R", first, count))
            recv_exact_into(raw, region.view[first * block_bytes:(first + count) * block_bytes])

    def raw_checked_run(first: int, count: int) -> None:
        """The raw transfer, then xxh3 of each block in line: what the simplest reader that
        verifies (as kvcr must) costs here."""
        raw_run(first, count)
        for i in range(first, first + count):
            checksum(region.view[i * block_bytes:(i + 1) * block_bytes])

    def kvcr_run(first: int, count: int) -> None:
        result = client.fetch(peer, keys[first:first + count], deadline_s=60)
        if result.fetched != count:
            raise RuntimeError(f"fetch incomplete: {result.detail or result.statuses[:3]}")
        if result.transport is None or result.transport.value != ("nixl" if engine else "tcp"):
            raise RuntimeError(f"fetch went over {result.transport}")

    def clear() -> None:
        with store.lock:
            store.index.discard(keys)

    def timed(step: Callable[[int, int], None]) -> float:
        start = time.perf_counter()
        for first in range(0, blocks, BATCH):
            step(first, min(BATCH, blocks - first))
        return time.perf_counter() - start

    restore()
    timed(raw_run)  # warm-up: connections, page tables, NIXL wire-up
    if engine is not None and not needs_progress():
        raw.sendall(_REQ.pack(b"P", 0, 0))
    clear()
    timed(kvcr_run)
    t_raw, t_raw2, t_checked, t_cold, t_warm = [], [], [], [], []
    for _ in range(reps):
        t_raw.append(timed(raw_run))
        if engine is not None:
            t_raw2.append(timed(raw2_run))
        t_checked.append(timed(raw_checked_run))
        restore()
        clear()
        t_cold.append(timed(kvcr_run))
        clear()
        t_warm.append(timed(kvcr_run))
    small, raw_small = [], []
    clear()
    for i in range(min(SMALL_OPS, blocks)):
        start = time.perf_counter()
        raw_run(i, 1)
        raw_small.append(time.perf_counter() - start)
        start = time.perf_counter()
        kvcr_run(i, 1)
        small.append(time.perf_counter() - start)
    gb = blocks * block_bytes / 1e9
    return {"block_bytes": block_bytes, "blocks": blocks,
            "raw_gbps": gb / statistics.median(t_raw),
            "kvcr_gbps": gb / statistics.median(t_warm),
            "kvcr_cold_gbps": gb / statistics.median(t_cold),
            "ratio": _median_ratio(t_raw, t_warm), "ratio_cold": _median_ratio(t_raw, t_cold),
            "raw_checked_ratio": _median_ratio(t_raw, t_checked),
            "raw2_gbps": gb / statistics.median(t_raw2) if t_raw2 else None,
            "ratio_raw2": _median_ratio(t_raw2, t_warm) if t_raw2 else None,
            "small_fetch_p50_us": statistics.median(small) * 1e6,
            "raw_small_p50_us": statistics.median(raw_small) * 1e6}


def _main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["source", "destination"], required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--nixl", action="store_true")
    ap.add_argument("--peer")
    ap.add_argument("--raw")
    ap.add_argument("--nixl-agent", default="")
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--block-bytes", type=int, required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fleet", default="", help="a directory with source.key, "
                    "destination.key and fleet.yaml: fleet identities and origin tags")
    args = ap.parse_args()
    if args.role == "source":
        source(args.host, args.blocks, args.block_bytes, args.nixl, args.fleet)
        return 0
    raw_host, raw_port = json.loads(args.raw)
    print(json.dumps(destination(args.peer, (raw_host, raw_port), args.nixl_agent, args.blocks,
                                 args.block_bytes, args.reps, args.fleet)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
