"""vLLM's own `Request.kv_hints` (how NVIDIA Dynamo delivers hints) with the real vLLM CPU
engine and kvcr, without Dynamo: malformed envelopes of the kinds a faulty router could send,
and a well-formed one naming a non-peer, each counted and served by recompute, with the same
output as a plain engine. Dynamo's own (well-formed) hints are in tests/dynamo."""

from __future__ import annotations

from typing import Any

import pytest

from kvcr_core.testing import secret_for

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = [(i * 7919) % 2000 + 4 for i in range(700)]  # 21 full blocks of 32 + 28 tokens


def envelope(payload: Any, **fields: Any) -> dict[str, Any]:
    action = {"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
              "payload": payload}
    return {"protocol_version": "0.1", "message_id": "m1", "actions": [action], **fields}


def test_malformed_or_stranger_kv_hints_are_counted_and_recomputed(
        run_engine, monkeypatch) -> None:
    """Risk: a malformed Request.kv_hints (bad hashes, a payload that is no mapping, a
    mistyped envelope) or one naming a non-peer fails or hangs the request in the real engine,
    or passes uncounted."""
    monkeypatch.setenv("KVCR_PEER_SECRET", secret_for("kv-hints-e2e-secret-0123456789abcdef"))
    peer = "tcp://127.0.0.1:9"
    hints = [
        envelope({"source_control_endpoint": peer, "block_hashes": ["x", 1]}),
        envelope(["not", "a", "mapping"]),
        envelope({"source_control_endpoint": peer, "block_hashes": [1]}, protocol_version=7),
        envelope({"source_control_endpoint": "tcp://127.0.0.1:10", "block_hashes": [1, 2]}),
    ]
    (plain,) = run_engine("none", [{"tokens": PROMPT}])
    outs = run_engine("plugin", [{"tokens": PROMPT, "kv_hints": h, "reset_prefix_cache": True}
                                 for h in hints],
                      {"peers": [peer], "pull_on_miss": False, "save": False})
    assert [o["tokens"] for o in outs] == [plain["tokens"]] * len(hints)
    assert all(o["cached"] == 0 and o["seconds"] < 60 for o in outs)
    last = outs[-1]["metrics"]
    assert last["vllm:kvcr_hints{outcome=bad_hashes}"] == 1
    assert last["vllm:kvcr_hints{outcome=bad_payload}"] == 1
    assert last["vllm:kvcr_hints{outcome=not_a_mapping}"] == 1
    assert last["vllm:kvcr_hints{outcome=accepted}"] == 1
    assert last["vllm:kvcr_failures{reason=peer_not_allowed}"] == 1
