"""Salted, LoRA and image requests reused across real vLLM CPU engines through kvcr-guard
under their context, never across two contexts, with the outputs the engine that computed
the KV produced (e2e: real engine processes, tiny local models and LoRA adapters)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")

from kvcr_bench.tiny_model import build_idefics3, build_lora

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = [(i * 7919) % 2000 + 4 for i in range(650)]  # 20 full blocks of 32 + 10 tokens
FULL = (len(PROMPT) // 32) * 32


def lora(path: Path, name: str, ident: int) -> dict[str, object]:
    return {"name": name, "id": ident, "path": str(path)}


def test_salted_and_lora_requests_are_reused_only_within_their_context(
        guard, run_engine, tmp_path: Path) -> None:
    """Risk: a tenant's salted KV, or one adapter's KV, served to another salt or adapter
    (wrong tokens for them, and a leak), or such requests never reused at all."""
    sql = build_lora(tmp_path / "sql", seed=1)
    copy = tmp_path / "sql-copy"  # the same files under another path and name
    shutil.copytree(sql, copy)
    chat = build_lora(tmp_path / "chat", seed=2)
    extra = {"mode": "guarded", "socket": guard.socket}
    writes = [{"tokens": PROMPT, "cache_salt": "tenant-a"},
              {"tokens": PROMPT, "lora": lora(sql, "sql", 1)}]
    reads = [{"tokens": PROMPT, "cache_salt": "tenant-a"},
             {"tokens": PROMPT, "cache_salt": "tenant-b"},
             {"tokens": PROMPT, "lora": lora(copy, "sql-copy", 1)},
             {"tokens": PROMPT, "lora": lora(chat, "chat", 2)},
             {"tokens": PROMPT}]
    written = run_engine("plugin", writes, extra, enable_lora=True)  # computed: the reference
    salted_a, salted_b, same_adapter, other_adapter, base = run_engine(
        "plugin", reads, extra, enable_lora=True)
    assert salted_a["cached"] >= FULL - 32 and same_adapter["cached"] >= FULL - 32
    assert salted_b["cached"] == other_adapter["cached"] == base["cached"] == 0
    assert [salted_a["tokens"], same_adapter["tokens"]] == [r["tokens"] for r in written]
    assert same_adapter["tokens"] != base["tokens"]  # the adapter changes the output
    assert base["metrics"]["vllm:kvcr_loaded_blocks"] >= 2 * (len(PROMPT) // 32) - 2


def test_an_image_is_reused_only_with_the_same_image(guard, run_engine, tiny_model) -> None:
    """Risk: a vision-language deployment gets another image's KV for the same placeholder
    tokens (an answer about the wrong picture), or no reuse at all. (This tiny model's greedy
    output hardly depends on the image, so the blocks reused are what is checked.)"""
    model = str(build_idefics3(Path(tiny_model).parent / "tiny-idefics3", tiny_model))
    before = " ".join(f"word{i % 37}" for i in range(160))  # text ahead of the image
    text = before + " <image> " + " ".join(f"tail{i % 23}" for i in range(20))
    red, blue = ([200, 10, 10], [10, 10, 200])
    job = {"model": model, "images": True}
    extra = {"mode": "guarded", "socket": guard.socket}
    reads = [{"text": text, "image_rgb": red}, {"text": text, "image_rgb": blue}]
    (written,) = run_engine("plugin", [{"text": text, "image_rgb": red}], extra, **job)
    same, other = run_engine("plugin", reads, extra, **job)
    assert written["metrics"]["vllm:kvcr_stored_blocks"] >= 8 and written["cached"] == 0
    assert same["cached"] >= written["metrics"]["vllm:kvcr_stored_blocks"] * 32 - 32
    assert 0 < other["cached"] < same["cached"]  # only the blocks before the image
    assert same["tokens"] == written["tokens"]  # reused KV: the computed output
