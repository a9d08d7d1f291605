"""kvcr-router with fleet identities: `kvcr-router serve --peer-node-key --peer-fleet` (a real
process) reads the inventory of a real kvcr-guard that authenticates peers by node key, and a
router whose key the fleet does not list reads nothing. Integration layer (processes and
sockets, no engine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvcr_bench.processes import Process
from kvcr_core.attach import AttachClient
from kvcr_core.keys import NamespaceSpec
from kvcr_core.testing import pattern_block, random_keys
from kvcr_core.testing.fleet import TestFleet
from kvcr_core.testing.ports import free_port

pytest.importorskip("cryptography", reason="fleet identities need the cryptography package")
pytestmark = pytest.mark.integration

BLOCK = 8192
SPEC = NamespaceSpec(model_id="router-fleet", dtype="float32", kv_dtype="float32",
                     block_size_tokens=16, num_layers=1, num_kv_heads=1, head_dim=64,
                     layout="test")


def _router(where: Path, name: str, endpoint: str, key: str, fleet: str) -> tuple[Process, str]:
    port = free_port()
    kvcr_router = str(Path(sys.executable).parent / "kvcr-router")
    proc = Process([kvcr_router, "serve", "--listen", f"127.0.0.1:{port}",
                    "--worker", f"a=http://127.0.0.1:{free_port()},peer={endpoint}",
                    "--namespace-digest", SPEC.digest().hex(), "--block-size", "16",
                    "--inventory-interval-s", "0.1", "--health-interval-s", "0.5",
                    "--peer-node-key", key, "--peer-fleet", fleet], where / f"{name}.log")
    return proc, f"http://127.0.0.1:{port}"


def _inventory_up(proc: Process, url: str, timeout_s: float) -> bool | None:
    """The router's word on worker a's inventory feed once it is up, or at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    up = None
    while time.monotonic() < deadline:
        assert proc.alive(), proc.tail()
        try:
            up = httpx.get(f"{url}/health", timeout=2).json()["workers"]["a"]["inventory"]
        except (httpx.HTTPError, ValueError):
            up = None
        if up:
            return True
        time.sleep(0.2)
    return up


def _inventory_blocks(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvcr_router_feed_blocks_total{")
               and 'feed="inventory"' in line and 'event="stored"' in line)


def test_a_router_with_a_fleet_key_reads_inventories_and_a_stranger_reads_none(
        short_tmp: str, harness) -> None:
    """Risk: the router's fleet flags are parsed but not used (it cannot read any node's
    inventory, so routing loses its fetch credit), or any key at all is let in."""
    root = Path(short_tmp)
    fleet = TestFleet(root, ("node-a", "router-r"))
    stranger = root / "stranger"
    stranger.mkdir()
    TestFleet(stranger, ("router-x",))  # a well-formed key this fleet does not list
    (root / "g").mkdir()
    guard = harness.Guard(str(root / "g"), "--peer-listen", "127.0.0.1:0", "--peer-node-key",
                          fleet.key_file("node-a"), "--peer-fleet", fleet.file).start()
    kvcr = os.path.join(os.path.dirname(sys.executable), "kvcr")
    endpoint = json.loads(subprocess.run(
        [kvcr, "status", "--socket", guard.socket, "--json"], capture_output=True, text=True,
        check=True).stdout)["peer_endpoint"]
    engine = AttachClient(guard.socket, SPEC, BLOCK, identity="engine")
    keys = random_keys(6, seed=5)
    assert engine.store(keys, [pattern_block(k, BLOCK) for k in keys]) == 6
    trusted, url = _router(root, "router-r", endpoint, fleet.key_file("router-r"), fleet.file)
    # a router with a key of its own, in a fleet file of its own that lists it
    intruder, bad_url = _router(root, "router-x", endpoint, str(stranger / "router-x.key"),
                                str(stranger / "fleet.yaml"))
    try:
        assert _inventory_up(trusted, url, 30) is True
        deadline = time.monotonic() + 10
        while _inventory_blocks(url) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _inventory_blocks(url) == 6
        assert _inventory_up(intruder, bad_url, 3) is False
        assert _inventory_blocks(bad_url) == 0
    finally:
        trusted.stop()
        intruder.stop()
        engine.close()
    # and a router given a key its fleet file does not list says so at start
    unlisted, _ = _router(root, "unlisted", endpoint, str(stranger / "router-x.key"), fleet.file)
    assert unlisted.proc.wait(timeout=60) != 0
    assert "list this node's public key" in unlisted.tail()
