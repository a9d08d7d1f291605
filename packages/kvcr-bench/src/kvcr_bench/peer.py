"""`kvcr bench peer`: the peer transports against raw transfers of the same bytes, in the
same run: the TCP transport against a raw TCP stream, and (when nixl is installed) the NIXL
transport against a plain NIXL read, over loopback and (as root) across two network
namespaces.

Each row runs a source and a destination process (kvcr_bench.peer_node). Ratios are
medians of per-repetition ratios (raw and kvcr run back to back), because the machine may be
shared. "warm" fetches reuse the source's per-slot checksums (a block served before), "cold"
ones follow a re-store of every block, so the source hashes each one again. "tcp+fleet"
rows run the TCP transport with fleet identities: every reply carries its blocks' signed
origin manifest, checked while the bytes arrive (the cost of origin tags). Across namespaces
NIXL runs with `UCX_TLS=tcp` and the veth device (else UCX would still copy with cma, as on
one host). Also the one-block fetch latency, against a raw one-block transfer, and, for
reference, the raw transfer followed by xxh3 of each block in line ("raw+xxh3": what the
plainest reader that verifies every block, as kvcr must, reaches on this host), and, with
NIXL, the raw READ split between two threads ("raw x2": kvcr READs and checks a fetch on two
lanes, so this is what NIXL itself gives with the same two cores copying; the target ratio
is against the plain READ).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from kvcr_bench.peer_node import BATCH
from kvcr_core.peers.nixl_engine import nixl_installed
from kvcr_core.testing import network_namespaces
from kvcr_core.testing.fleet import TestFleet

TARGETS = {"tcp_ratio_vs_raw_256k": 0.80, "nixl_ratio_vs_raw_256k": 0.80,
           "tcp_fleet_ratio_vs_raw_256k": 0.90}  # origin tags may cost a tenth at most
_NS_TAG, _NS_SUBNET = "bp", 9


def _run_pair(transport: str, block_bytes: int, blocks: int, reps: int,
              netns: tuple[str, str] | None, host: str, fleet: str = "") -> dict[str, Any]:
    prefix_a = ["ip", "netns", "exec", netns[0]] if netns else []
    prefix_b = ["ip", "netns", "exec", netns[1]] if netns else []
    me = [sys.executable, "-m", "kvcr_bench.peer_node"]
    nixl = ["--nixl"] if transport == "nixl" else []
    identity = ["--fleet", fleet] if fleet else []
    env_a, env_b = dict(os.environ), dict(os.environ)
    if netns and nixl:  # force UCX onto the veth (between namespaces of one host UCX would
        # otherwise copy with cma, as on one host)
        env_a.update(UCX_TLS="tcp", UCX_NET_DEVICES=f"kvcr{_NS_TAG}va")
        env_b.update(UCX_TLS="tcp", UCX_NET_DEVICES=f"kvcr{_NS_TAG}vb")
    source = subprocess.Popen([*prefix_a, *me, "--role", "source", "--host", host, "--blocks",
                               str(blocks), "--block-bytes", str(block_bytes), *nixl,
                               *identity],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env_a)
    try:
        assert source.stdout is not None
        line = source.stdout.readline()
        if not line:
            err = source.stderr.read() if source.stderr else ""
            raise RuntimeError(f"peer source failed: {err[-2000:]}")
        where = json.loads(line)
        if "error" in where:
            return dict(where)
        out = subprocess.run([*prefix_b, *me, "--role", "destination", "--peer", where["peer"],
                              "--raw", json.dumps(where["raw"]), "--nixl-agent", where["nixl"],
                              "--blocks", str(blocks), "--block-bytes", str(block_bytes),
                              "--reps", str(reps), *identity],
                             capture_output=True, text=True, timeout=900, check=False, env=env_b)
        if out.returncode != 0:
            raise RuntimeError(f"peer destination failed: {out.stderr[-2000:]}")
        return dict(json.loads(out.stdout.splitlines()[-1]))
    finally:
        source.kill()
        source.wait()


def _rows(quick: bool) -> list[dict[str, Any]]:
    total = (64 << 20) if quick else (256 << 20)
    reps = 5 if quick else 7
    transports = ["tcp", "nixl"] if nixl_installed() else ["tcp"]
    rows = []
    for transport in transports:
        for block_bytes in (64 << 10, 256 << 10, 2 << 20):
            row = _run_pair(transport, block_bytes, total // block_bytes, reps, None,
                            "127.0.0.1")
            rows.append({"path": "loopback", "transport": transport, **row})
    with tempfile.TemporaryDirectory(prefix="kvcr-bench-fleet-") as fleet:
        TestFleet(fleet, ("source", "destination"))
        for block_bytes in (256 << 10, 2 << 20):  # the same TCP rows with origin tags
            row = _run_pair("tcp", block_bytes, total // block_bytes, reps, None, "127.0.0.1",
                            fleet)
            rows.append({"path": "loopback", "transport": "tcp+fleet", **row})
    with network_namespaces(_NS_TAG, _NS_SUBNET) as netns:
        if netns is not None:
            for transport in transports:
                row = _run_pair(transport, 256 << 10, total // (256 << 10), reps, netns[:2],
                                netns[2])
                rows.append({"path": "network namespaces", "transport": transport, **row})
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def pick(transport: str, key: str) -> float | None:
        values = [r[key] for r in rows if r["transport"] == transport
                  and r.get("block_bytes") == 256 << 10 and key in r]
        return min(values) if values else None

    def small(transport: str) -> float | None:
        values = [r["small_fetch_p50_us"] for r in rows if r["transport"] == transport
                  and r.get("block_bytes") == 64 << 10 and r["path"] == "loopback"]
        return values[0] if values else None

    fleet, plain = pick("tcp+fleet", "ratio"), pick("tcp", "ratio")
    return {"tcp_ratio_vs_raw_256k": plain,
            "tcp_fleet_ratio_vs_raw_256k": fleet,
            "fleet_vs_secret_256k": fleet / plain if fleet and plain else None,
            "nixl_ratio_vs_raw_256k": pick("nixl", "ratio"),
            "small_fetch_p50_us": small("tcp"),
            "tcp_ratio_vs_raw_256k_cold": pick("tcp", "ratio_cold"),
            "nixl_ratio_vs_raw_256k_cold": pick("nixl", "ratio_cold"),
            "nixl_ratio_vs_raw_two_threads_256k": pick("nixl", "ratio_raw2"),
            "nixl_small_fetch_p50_us": small("nixl")}


def run_peer_bench(*, quick: bool, as_json: bool) -> int:
    rows = _rows(quick)
    summary = _summary(rows)
    meets = {k: None if summary[k] is None else summary[k] >= v for k, v in TARGETS.items()}
    result = {"bench": "peer", "quick": quick, "bytes_per_size": rows[0].get("blocks", 0)
              * rows[0].get("block_bytes", 0), "blocks_per_fetch": BATCH, "rows": rows,
              "summary": summary, "targets": {k: f">= {v:g}" for k, v in TARGETS.items()},
              "meets_targets": meets}
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"kvcr bench peer{' --quick' if quick else ''}: {result['bytes_per_size'] >> 20} MiB "
          f"per row, fetches of {BATCH} blocks; ratio = median over repetitions of raw/kvcr; "
          "raw+xxh3 = raw/(raw then xxh3 of each block in line); raw x2 = raw NIXL GB/s with "
          "the READ split between two threads (kvcr uses two lanes)")
    print(f"{'path':>18} {'via':>9} {'block':>9} | {'raw GB/s':>8} {'kvcr GB/s':>9} "
          f"{'ratio':>5} {'cold':>5} {'raw+xxh3':>8} {'raw x2':>6} | "
          f"{'1-block p50 raw/kvcr':>20}")
    for r in rows:
        if "error" in r:
            print(f"{r['path']:>18} {r['transport']:>9}  {r['error']}")
            continue
        raw2 = "-" if r.get("raw2_gbps") is None else f"{r['raw2_gbps']:.2f}"
        print(f"{r['path']:>18} {r['transport']:>9} {r['block_bytes'] >> 10:>5} KiB | "
              f"{r['raw_gbps']:>8.2f} {r['kvcr_gbps']:>9.2f} {r['ratio']:>5.2f} "
              f"{r['ratio_cold']:>5.2f} {r['raw_checked_ratio']:>8.2f} {raw2:>6} | "
              f"{r['raw_small_p50_us']:>9.0f} / "
              f"{r['small_fetch_p50_us']:>5.0f} us")
    print()
    for key, value in summary.items():
        shown = "null" if value is None else f"{value:.2f}"
        target = f" (target >= {TARGETS[key]:g})" if key in TARGETS else ""
        print(f"{key} {shown}{target}")
    return 0
