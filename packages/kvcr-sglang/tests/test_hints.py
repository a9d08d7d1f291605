"""KV hints for SGLang without patching it: a router posts the hint to the worker node's
kvcr-guard (peer protocol), and the SGLang backend, missing those pages, has its guard fetch
them from the hinted peer. Real guards, real SGLang controller, real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

sglang = pytest.importorskip("sglang", reason="runs in .venv-sglang (scripts/setup_sglang.sh)")

import torch  # noqa: E402

from kvcr_bench import sglang_rig as cpu_rig  # noqa: E402
from kvcr_bench.sglang_rig import KVCR_EXTRA, PoolShape  # noqa: E402
from kvcr_core.peers import PeerSecret  # noqa: E402
from kvcr_core.peers.inventory_reader import InventoryReader  # noqa: E402
from kvcr_core.testing import secret_for  # noqa: E402
from kvcr_sglang.pagestore import router_hash  # noqa: E402

SECRET = secret_for("sglang-hint-test-secret-01234567").encode()
SIDE = str(Path(__file__).with_name("sglang_side.py"))
SHAPE = PoolShape()


def peer_endpoint(guard) -> str:  # type: ignore[no-untyped-def]
    kvcr = os.path.join(os.path.dirname(sys.executable), "kvcr")
    out = subprocess.run([kvcr, "status", "--socket", guard.socket, "--json"],
                         capture_output=True, text=True, check=True).stdout
    return str(json.loads(out)["peer_endpoint"])


def hint(source: str, hashes: list[int]) -> str:
    return json.dumps({"protocol_version": "0.1", "message_id": "m1", "actions": [
        {"action_type": "kv.fetch", "action_version": "1.0",
         "payload": {"source_control_endpoint": source, "block_hashes": hashes}}]})


def test_posted_hint_lets_sglang_fetch_missing_pages_from_the_named_peer(
        harness, short_tmp: str) -> None:  # type: ignore[no-untyped-def]
    """Risk: SGLang workers can never use a router's hint (0.5.23 does not pass hints to
    storage backends), or a hint makes them serve bytes that differ from the source's."""
    secret_file = os.path.join(short_tmp, "s")
    Path(secret_file).write_bytes(SECRET)
    for name in ("a", "b"):
        os.mkdir(os.path.join(short_tmp, name))
    node_a = harness.Guard(os.path.join(short_tmp, "a"), "--peer-listen", "127.0.0.1:0",
                           "--peer-secret-file", secret_file).start()
    source = peer_endpoint(node_a)
    node_b = harness.Guard(os.path.join(short_tmp, "b"), "--peer-listen", "127.0.0.1:0",
                           "--peer", source, "--peer-secret-file", secret_file,
                           "--no-pull-on-miss").start()  # hints only (test_pull.py: pulls)
    out = subprocess.run([sys.executable, SIDE, node_a.socket, "write"], capture_output=True,
                         text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    wrote = json.loads(out.stdout.strip().splitlines()[-1])
    keys: list[str] = wrote["keys"]

    alloc, dev = cpu_rig.device_pool(SHAPE)
    host = cpu_rig.host_pool(dev, SHAPE, "page_first")
    ctrl = cpu_rig.controller(alloc, host, SHAPE, extra={
        **KVCR_EXTRA, "interface_v1": 1, "mode": "guarded", "socket": node_b.socket,
        "peers": [source], "fetch_deadline_s": 5})
    try:
        backend = ctrl.storage_backend
        assert backend.batch_exists(keys) == 0  # node B has nothing and no hint yet

        router = InventoryReader(peer_endpoint(node_b), PeerSecret(SECRET))
        assert router.post_hint("{not json") == 0  # rejected, counted, nothing remembered
        stranger = hint("tcp://127.0.0.1:9", [router_hash(k) for k in keys[:2]])
        assert router.post_hint(stranger) == 2
        assert backend.batch_exists(keys) == 0  # a source that is not a peer is never dialled
        assert router.post_hint(hint(source, [router_hash(k) for k in keys])) == len(keys)
        router.close()

        gen = torch.Generator().manual_seed(42)  # the writer's prompt (sglang_side.py)
        tokens = torch.randint(10, 30000, (len(keys) * SHAPE.page_tokens,), generator=gen)
        assert cpu_rig.page_keys(tokens.tolist(), SHAPE.page_tokens) == keys
        ctrl.prefetch("req-hinted", tokens.tolist())  # SGLang's prefetch thread asks kvcr
        op = cpu_rig.drain(ctrl.prefetch_hit_queue, 30)
        assert op.storage_hit_count == len(keys) * SHAPE.page_tokens
        filled = backend.batch_get_v1(keys, torch.arange(SHAPE.page_tokens * 3,
                                                         SHAPE.page_tokens * (3 + len(keys))))
        assert filled == [True] * len(keys)
        import hashlib

        got = hashlib.sha256(b"".join(cpu_rig.page_bytes(host, 3, len(keys)))).hexdigest()
        assert got == wrote["digest"]
        stats = backend.kvcr_stats()
        assert stats["hinted_fetched_pages"] == len(keys)
        assert node_b.metric("kvcr_hints_total", outcome="accepted") == 2
        assert node_b.metric("kvcr_hints_total", outcome="bad_json") == 1
        assert node_b.metric("kvcr_hint_board_matched_hashes_total") >= len(keys)
        assert node_a.settled_metric("kvcr_peer_served_blocks_total", len(keys)) == len(keys)
    finally:
        ctrl.detach_storage_backend()
