"""A hybrid-attention model (a tiny local Gemma 3: sliding-window layers beside full
attention) reused across real vLLM CPU engines through kvcr-guard with vLLM's hybrid memory
manager on, outputs identical to the engine that computed the KV (e2e: real engine
processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")

from kvcr_bench.tiny_model import build_gemma3

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = [(i * 7919) % 2000 + 4 for i in range(650)]  # 20 full blocks of 32 + 10 tokens
FULL = (len(PROMPT) // 32) * 32


def test_a_hybrid_model_is_reused_across_engines_with_its_hybrid_manager_on(
        guard, run_engine, tiny_model) -> None:
    """Risk: a hybrid model started with vLLM's hybrid memory manager off (half its KV
    capacity gone), or reused with a group's KV missing or misplaced: its sliding-window
    layers would read blocks nobody wrote, and the output would change."""
    model = str(build_gemma3(Path(tiny_model).parent / "tiny-gemma3", tiny_model))
    extra = {"mode": "guarded", "socket": guard.socket}
    (written,) = run_engine("plugin", [{"tokens": PROMPT}], extra, model=model)
    (read,) = run_engine("plugin", [{"tokens": PROMPT}], extra, model=model)
    assert written["kv_groups"] == read["kv_groups"] == 2  # the hybrid manager stayed on
    assert written["cached"] == 0 and read["cached"] >= FULL - 32
    assert read["tokens"] == written["tokens"]
    metrics = read["metrics"]
    assert metrics["vllm:kvcr_loaded_blocks"] >= FULL // 32 - 1  # the full group's, at least
    assert metrics["vllm:kvcr_loaded_tokens"] == read["cached"]  # counted once per request
    assert written["metrics"]["vllm:kvcr_stored_blocks"] == 2 * (FULL // 32)  # both groups
