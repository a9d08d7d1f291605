"""`kvcr bench peer`: the TCP peer transport against a raw TCP transfer of the same bytes, in
the same run, over loopback and (as root) across two network namespaces.

A source process holds N blocks in a Runner and serves them two ways: the kvcr peer protocol
(authenticated, checksummed, into reserved slots) and a raw socket that just streams the
same slot bytes. A destination process times both, alternating, into page-aligned memory
(raw: a plain region; kvcr: its pool's reserved slots) and reports medians. Also the latency
of a one-block fetch. NIXL is reported as null when it is not installed.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry

from kvcr_core.config import KVCRConfig
from kvcr_core.framing import recv_exact_into
from kvcr_core.memory import HostRegion, RegionKind
from kvcr_core.peers import PeerClient, PeerMetrics, PeerSecret, PeerServer
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.testing import network_namespaces, pattern_block, random_keys
from kvcr_core.types import NamespaceDigest

SECRET = b"kvcr-bench-peer-secret-0123456789"
DIGEST = NamespaceDigest(b"kvcr-bench-peer!")
TARGETS = {"tcp_ratio_vs_raw_256k": (">=", 0.80)}
BATCH = 64
_REQ = struct.Struct("<II")  # first block, block count


def _source(host: str, blocks: int, block_bytes: int) -> None:
    runner = Runner(KVCRConfig(pool_bytes=(blocks + 8) * block_bytes))
    store = runner.open_namespace(DIGEST, block_bytes, prefault=True)
    keys = random_keys(blocks, seed=5)
    for i in range(0, blocks, 256):
        batch = keys[i:i + 256]
        store.store(batch, [pattern_block(k, block_bytes) for k in batch])
    server = PeerServer(runner, PeerSecret(SECRET), PeerMetrics(CollectorRegistry()), host=host)
    slots = [store.index.slot_of(k) for k in keys]
    raw = socket.create_server((host, 0))

    def serve_raw(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            view = store.pool.view
            while len(request := conn.recv(_REQ.size, socket.MSG_WAITALL)) == _REQ.size:
                first, count = _REQ.unpack(request)
                for slot in slots[first:first + count]:
                    assert slot is not None
                    conn.sendall(view(slot))

    def accept_raw() -> None:
        while True:
            conn, _ = raw.accept()
            threading.Thread(target=serve_raw, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_raw, daemon=True).start()
    print(json.dumps({"peer": server.endpoint, "raw": list(raw.getsockname()[:2])}), flush=True)
    time.sleep(3600)


def _destination(peer: str, raw_host: str, raw_port: int, blocks: int, block_bytes: int,
                 reps: int) -> dict[str, Any]:
    registry = CollectorRegistry()
    runner = Runner(KVCRConfig(pool_bytes=(blocks + 8) * block_bytes), registry=registry)
    store = runner.open_namespace(DIGEST, block_bytes, prefault=True)
    client = PeerClient(store, PeerSecret(SECRET), PeerMetrics(registry))
    keys = random_keys(blocks, seed=5)
    region = HostRegion.create(blocks * block_bytes, RegionKind.ANONYMOUS)
    region.prefault()
    raw = socket.create_connection((raw_host, raw_port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def raw_run() -> None:
        for first in range(0, blocks, BATCH):
            count = min(BATCH, blocks - first)
            raw.sendall(_REQ.pack(first, count))
            recv_exact_into(raw, region.view[first * block_bytes:(first + count) * block_bytes])

    def kvcr_run() -> None:
        for first in range(0, blocks, BATCH):
            result = client.fetch(peer, keys[first:first + BATCH], deadline_s=60)
            if result.fetched != len(result.statuses):
                raise RuntimeError(f"fetch incomplete: {result.detail or result.statuses[:3]}")

    def clear(_: NamespaceStore = store) -> None:
        with store.lock:
            store.index.discard(keys)

    t_raw, t_kvcr = [], []
    for _ in range(reps):
        start = time.perf_counter()
        raw_run()
        t_raw.append(time.perf_counter() - start)
        clear()
        start = time.perf_counter()
        kvcr_run()
        t_kvcr.append(time.perf_counter() - start)
    small = []
    for key in keys[:200]:
        start = time.perf_counter()
        client.fetch(peer, [key], deadline_s=10)
        small.append(time.perf_counter() - start)
    gb = blocks * block_bytes / 1e9
    raw_s, kvcr_s = statistics.median(t_raw), statistics.median(t_kvcr)
    return {"block_bytes": block_bytes, "blocks": blocks, "raw_gbps": gb / raw_s,
            "kvcr_gbps": gb / kvcr_s, "ratio": raw_s / kvcr_s,
            "small_fetch_p50_us": statistics.median(small) * 1e6}


def _run_pair(block_bytes: int, blocks: int, reps: int, netns: tuple[str, str] | None,
              host: str) -> dict[str, Any]:
    prefix_a = ["ip", "netns", "exec", netns[0]] if netns else []
    prefix_b = ["ip", "netns", "exec", netns[1]] if netns else []
    me = [sys.executable, "-m", "kvcr_core.cli.bench_peer"]
    source = subprocess.Popen([*prefix_a, *me, "--role", "source", "--host", host, "--blocks",
                               str(blocks), "--block-bytes", str(block_bytes)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert source.stdout is not None
        line = source.stdout.readline()
        if not line:
            err = source.stderr.read() if source.stderr else ""
            raise RuntimeError(f"peer source failed: {err}")
        where = json.loads(line)
        out = subprocess.run([*prefix_b, *me, "--role", "destination", "--peer", where["peer"],
                              "--raw", json.dumps(where["raw"]), "--blocks", str(blocks),
                              "--block-bytes", str(block_bytes), "--reps", str(reps)],
                             capture_output=True, text=True, timeout=600, check=True)
        return dict(json.loads(out.stdout))
    finally:
        source.kill()
        source.wait()


def run_peer_bench(*, quick: bool, as_json: bool) -> int:
    total = (64 << 20) if quick else (256 << 20)
    reps = 3 if quick else 5
    rows = []
    for block_bytes in (64 << 10, 256 << 10, 2 << 20):
        row = _run_pair(block_bytes, total // block_bytes, reps, None, "127.0.0.1")
        rows.append({"path": "loopback", **row})
    with network_namespaces("bp", 9) as netns:
        if netns is not None:
            row = _run_pair(256 << 10, total // (256 << 10), reps, netns[:2], netns[2])
            rows.append({"path": "network namespaces", **row})
    ratio_256k = min(r["ratio"] for r in rows if r["block_bytes"] == 256 << 10)
    summary = {"tcp_ratio_vs_raw_256k": ratio_256k,
               "nixl_ratio_vs_raw_256k": None,  # NIXL transport: not built yet
               "small_fetch_p50_us": statistics.median(r["small_fetch_p50_us"] for r in rows)}
    result = {"bench": "peer", "quick": quick, "bytes_per_size": total, "rows": rows,
              "summary": summary, "targets": {k: f"{op} {v:g}" for k, (op, v) in TARGETS.items()},
              "meets_targets": {"tcp_ratio_vs_raw_256k": ratio_256k >= 0.80}}
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"kvcr bench peer{' --quick' if quick else ''}: {total >> 20} MiB per size, "
          f"fetches of {BATCH} blocks, median of {reps}")
    print(f"{'path':>19} {'block':>9} | {'raw GB/s':>8} {'kvcr GB/s':>9} {'ratio':>6} | "
          f"{'1-block fetch p50':>17}")
    for r in rows:
        print(f"{r['path']:>19} {r['block_bytes'] >> 10:>5} KiB | {r['raw_gbps']:>8.2f} "
              f"{r['kvcr_gbps']:>9.2f} {r['ratio']:>6.2f} | {r['small_fetch_p50_us']:>14.0f} us")
    print(f"\ntcp_ratio_vs_raw_256k {ratio_256k:.2f} (target >= 0.80), nixl_ratio_vs_raw_256k "
          "null (NIXL transport not built yet)")
    return 0


def _main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["source", "destination"], required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--peer")
    ap.add_argument("--raw")
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--block-bytes", type=int, required=True)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if args.role == "source":
        _source(args.host, args.blocks, args.block_bytes)
        return 0
    raw_host, raw_port = json.loads(args.raw)
    print(json.dumps(_destination(args.peer, raw_host, raw_port, args.blocks,
                                  args.block_bytes, args.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
