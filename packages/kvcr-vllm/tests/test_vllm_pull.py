"""Pull on miss with real vLLM CPU engines: two embedded engines list each other as peers,
with no router and no hint; a prompt served by one is reused by the other."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")

from vllm.engine.arg_utils import EngineArgs

from kvcr_core.attach import AttachClient
from kvcr_core.cli.status_cmd import embedded_sockets, fetch_status
from kvcr_core.keys import sequence_keys
from kvcr_core.testing import secret_for
from kvcr_core.testing.ports import free_port
from kvcr_vllm.settings import namespace_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECRET = secret_for("e2e-pull-secret-0123456789abcdefghij")
PROMPT = [(i * 7919) % 2000 + 4 for i in range(2100)]  # 65 full blocks of 32 + 20 tokens


def next_json(proc) -> dict:  # type: ignore[no-untyped-def]
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]
    raise AssertionError(f"engine exited: {proc.stderr.read()[-3000:] if proc.stderr else ''}")


def scribble(model: str, socket_path: str, tokens: list[int]) -> int:
    """Writes noise over the engine's stored blocks of `tokens` in its pool (after their
    commit: what a hostile or buggy process attached to the pool could do)."""
    config = EngineArgs(model=model, dtype="float32", max_model_len=4096, block_size=32,
                        enforce_eager=True).create_engine_config()
    spec = namespace_for(config, 0)
    (ns,) = [n for n in fetch_status(socket_path)["namespaces"]
             if n["namespace"] == spec.digest().hex()]
    client = AttachClient(socket_path, spec, int(ns["block_bytes"]))
    lease = client.acquire(sequence_keys(spec, tokens), prefix_only=False)
    for slot in lease.slots:
        if slot is not None:
            client.pool().write(slot, bytes(client.pool().slot_bytes))
    client.release(lease.op)
    client.close()
    return lease.granted


def test_an_engine_pulls_a_prompt_its_peer_served_without_router_or_hint(
        start_engine, run_engine, tiny_model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Risk: without a router, KV never crosses engines; or what crosses is wrong (output
    must equal a recompute), or bytes changed in the source's pool after their commit are
    used (they must fail the checksum and be recomputed); or a dead peer stalls requests."""
    monkeypatch.setenv("KVCR_PEER_SECRET", SECRET)
    port_a, port_b = free_port(), free_port()
    ep_a, ep_b = f"tcp://127.0.0.1:{port_a}", f"tcp://127.0.0.1:{port_b}"
    socket_a = f"\0kvcr-pull-a-{os.getpid()}"
    a = start_engine("plugin", [{"tokens": PROMPT}],
                     {"socket": socket_a, "peer_listen": f"127.0.0.1:{port_a}", "peers": [ep_b]},
                     hold=True)
    b_extra = {"peer_listen": f"127.0.0.1:{port_b}", "peers": [ep_a], "fetch_deadline_s": 5}
    try:
        served = next_json(a)
        assert next_json(a) == {"holding": True}
        (b,) = run_engine("plugin", [{"tokens": PROMPT}], b_extra)
        assert b["cached"] >= 0.95 * len(PROMPT), b
        assert b["metrics"]["vllm:kvcr_pulled_blocks"] >= len(PROMPT) // 32 - 1, b
        assert b["metrics"]["vllm:kvcr_pull_lookups"] == 1
        assert b["tokens"] == served["tokens"]  # A computed it from scratch
        served_at = [s for s in embedded_sockets() if s.startswith("@" + socket_a[1:] + "-")]
        assert len(served_at) == 1  # the embedded name ends in a random part
        assert scribble(tiny_model, "\0" + served_at[0][1:], PROMPT) == len(PROMPT) // 32
        (c,) = run_engine("plugin", [{"tokens": PROMPT}], b_extra)
        assert c["cached"] < 32 and c["metrics"].get("vllm:kvcr_pulled_blocks", 0) == 0, c
        assert c["metrics"]["vllm:kvcr_failures{reason=peer_fetch}"] >= 1
        assert c["tokens"] == served["tokens"]  # the scribbled KV was refused, recomputed
    finally:
        a.kill()
        a.wait(timeout=30)
    (d,) = run_engine("plugin", [{"tokens": PROMPT}], {**b_extra, "fetch_deadline_s": 2})
    assert d["tokens"] == served["tokens"] and d["cached"] < 32
    assert d["seconds"] < 30  # no stall on the dead peer beyond the fetch deadline
