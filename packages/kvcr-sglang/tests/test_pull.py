"""Pull on miss for SGLang: two kvcr-guards follow each other's inventory (no router, no
hint); an SGLang process's pages stored through one are found and restored byte-exactly by
an SGLang process on the other. Real guards, real HiCache controllers, real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcr_core.testing import secret_for
from kvcr_core.testing.ports import free_port

pytestmark = pytest.mark.integration

sglang = pytest.importorskip("sglang", reason="runs in .venv-sglang (scripts/setup_sglang.sh)")

SECRET = secret_for("sglang-pull-test-secret-0123456789").encode()
SIDE = str(Path(__file__).with_name("sglang_side.py"))


def side(socket_path: str, role: str, **more: Any) -> dict[str, Any]:
    out = subprocess.run([sys.executable, SIDE, socket_path, role, json.dumps(more)],
                         capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_pages_stored_on_one_node_are_pulled_by_sglang_on_the_other(
        harness, short_tmp: str) -> None:  # type: ignore[no-untyped-def]
    """Risk: SGLang workers without a router never reuse another node's pages (SGLang
    0.5.23 passes request hints to no storage backend), restore other bytes than stored,
    or fail a request when the source dropped the pages in the meantime (a miss only)."""
    secret_file = os.path.join(short_tmp, "s")
    Path(secret_file).write_bytes(SECRET)
    port_a, port_b = free_port(), free_port()
    ep_a, ep_b = f"tcp://127.0.0.1:{port_a}", f"tcp://127.0.0.1:{port_b}"
    nodes = {}
    for name, port, peer in (("a", port_a, ep_b), ("b", port_b, ep_a)):
        os.mkdir(os.path.join(short_tmp, name))
        nodes[name] = harness.Guard(os.path.join(short_tmp, name), "--peer-listen",
                                    f"127.0.0.1:{port}", "--peer", peer,
                                    "--peer-secret-file", secret_file).start()
    wrote = side(nodes["a"].socket, "write")
    assert wrote["stored"] == 8
    # node B follows node A's inventory: wait until it knows the 8 pages
    assert nodes["b"].settled_metric("kvcr_peer_feed_blocks", 8, 10, peer=ep_a) == 8
    read = side(nodes["b"].socket, "read", peers=[ep_a], fetch_deadline_s=5)
    assert read["hits"] == 8 and read["filled"] == 8
    assert read["digest"] == wrote["digest"]
    assert read["stats"]["pulls"] == 1 and read["stats"]["pulled_pages"] == 8
    assert read["stats"]["failures"] == 0
    assert nodes["b"].metric("kvcr_pull_lookups_total", outcome="remote_run") >= 1
    assert nodes["b"].metric("kvcr_peer_feed_blocks", peer=ep_a) == 8

    side(nodes["b"].socket, "clear")
    side(nodes["a"].socket, "clear")  # gone at the source; B's follower may still list them
    gone = side(nodes["b"].socket, "read", peers=[ep_a], fetch_deadline_s=5)
    assert gone["hits"] == 0 and gone["filled"] == 0 and gone["stats"]["failures"] == 0
    for node in nodes.values():
        assert node.proc is not None and node.proc.poll() is None
        assert node.stop() == 0
