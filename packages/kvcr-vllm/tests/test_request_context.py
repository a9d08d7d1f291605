"""Salted and LoRA requests are reused under keys rooted in their context (the salt, the
adapter's files), never across two contexts; what kvcr cannot name still bypasses. Unit
layer: the real scheduler side over an in-process Runner, vLLM's request replaced by the
attributes the scheduler reads."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the scheduler side ships vLLM's metadata and stats types")

from kvcr_core.keys import block_keys, block_keys_with, context_root
from kvcr_core.testing import pattern_block
from kvcr_vllm.request_context import LoraDigests, adapter_digest, mm_block_extras

sys.path.insert(0, os.path.dirname(__file__))
from scheduler_rig import BLOCK, BLOCK_TOKENS, FakeRequest, Node, output

pytestmark = pytest.mark.unit
TOKENS = list(range(100, 133))  # 33 tokens: 8 full blocks and one partial


def stock(node: Node, context: tuple[tuple[str, str], ...], tokens: list[int]) -> None:
    """Stores the full blocks of `tokens` under keys rooted in `context`."""
    for rank, store in enumerate(node.stores):
        root = context_root(node.specs[rank].digest(), context)
        keys = block_keys(root, tokens, BLOCK_TOKENS)
        store.store(keys, [pattern_block(k, BLOCK) for k in keys])


def hit(node: Node, request: FakeRequest) -> int:
    node.scheduler.on_new_request(request)
    return node.scheduler.get_num_new_matched_tokens(request, 0)[0] or 0


def adapter(tmp_path: Path, name: str, weights: bytes) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return str(path)


def lora(path: str, name: str = "sql") -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=path)


def test_a_salted_request_reuses_its_salt_and_never_another() -> None:
    """Risk: tenants separated by cache_salt read each other's KV (a cross-tenant leak), or a
    salted deployment gets no reuse at all."""
    node = Node()
    stock(node, (("cache_salt", "tenant-a"),), TOKENS[:24])
    assert hit(node, FakeRequest("a", TOKENS, cache_salt="tenant-a")) == 24
    assert hit(node, FakeRequest("b", TOKENS, cache_salt="tenant-b")) == 0
    assert hit(node, FakeRequest("plain", TOKENS)) == 0
    stock(node, (), TOKENS[:24])
    assert hit(node, FakeRequest("b2", TOKENS, cache_salt="tenant-b")) == 0
    taken = node.stats.take()
    assert taken is None or not taken.data["bypassed"]  # salted requests are served now


def test_a_lora_request_reuses_its_adapters_content_not_its_name(tmp_path: Path) -> None:
    """Risk: two adapters' KV shared because they have the same name (or the same path on two
    nodes), or an adapter rewritten in place serving the old one's KV."""
    node = Node()
    first = adapter(tmp_path, "sql", b"weights-1" * 1000)
    digest = adapter_digest(first)
    stock(node, (("lora", digest),), TOKENS[:24])
    assert hit(node, FakeRequest("same", TOKENS, lora_request=lora(first))) == 24
    copy = adapter(tmp_path, "copy-of-sql", b"weights-1" * 1000)
    assert node.scheduler.lora.wait(copy, 10) == digest  # same files, other path and name
    assert hit(node, FakeRequest("copy", TOKENS, lora_request=lora(copy, "other"))) == 24
    other = adapter(tmp_path, "sql-v2", b"weights-2" * 1000)
    node.scheduler.lora.wait(other, 10)
    assert hit(node, FakeRequest("other", TOKENS, lora_request=lora(other, "sql"))) == 0
    assert hit(node, FakeRequest("base", TOKENS)) == 0
    weights = Path(first) / "adapter_model.safetensors"
    weights.write_bytes(b"weights-3" * 1000)
    os.utime(weights, ns=(1, 1))  # a rewrite in place: new bytes, new mtime
    assert hit(node, FakeRequest("rewritten", TOKENS, lora_request=lora(first))) == 0
    assert node.scheduler.lora.wait(first, 10) not in (None, digest)


def test_a_request_is_never_served_before_its_adapter_is_identified(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a large adapter's first requests served under a guessed identity, or the
    scheduler stalled while the adapter is hashed (it waits 50 ms once, then bypasses)."""
    import time

    import kvcr_vllm.request_context as rc

    def slow(path: str) -> str:
        time.sleep(0.5)
        return adapter_digest(path)

    monkeypatch.setattr(rc, "adapter_digest", slow)
    node = Node()
    big = adapter(tmp_path, "big", b"weights" * 1000)
    stock(node, (("lora", adapter_digest(big)),), TOKENS[:24])
    began = time.monotonic()
    assert hit(node, FakeRequest("early", TOKENS, lora_request=lora(big))) == 0
    assert hit(node, FakeRequest("early2", TOKENS, lora_request=lora(big))) == 0
    assert time.monotonic() - began < 0.4  # one short wait, not the hash
    assert node.stats.take().data["bypassed"] == {"lora": 2}  # type: ignore[union-attr]
    assert node.scheduler.lora.wait(big, 10) == adapter_digest(big)
    assert hit(node, FakeRequest("later", TOKENS, lora_request=lora(big))) == 24


def test_an_adapter_kvcr_cannot_read_bypasses(tmp_path: Path) -> None:
    """Risk: a hub id or a missing path keyed by name alone (any node's adapter of that name
    would match)."""
    node = Node()
    for path in ("org/some-adapter", str(tmp_path / "missing")):
        assert hit(node, FakeRequest(path, TOKENS, lora_request=lora(path))) == 0
        assert node.scheduler.lora.wait(path, 1) is None
    assert node.stats.take().data["bypassed"] == {"lora": 2}  # type: ignore[union-attr]


def test_digests_are_computed_off_the_thread_and_their_table_is_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: the digest table grows with every adapter ever seen, or a digest is computed on
    the scheduler's thread (a large adapter would stall every request)."""
    monkeypatch.setattr("kvcr_vllm.request_context.MAX_ADAPTERS", 2)
    digests = LoraDigests()
    paths = [adapter(tmp_path, f"a{i}", bytes([i]) * 10) for i in range(3)]
    assert digests.get(paths[0]) is None  # queued, not computed here
    assert [digests.wait(p, 10) for p in paths] == [adapter_digest(p) for p in paths]
    assert len(digests) == 2


def test_salted_blocks_are_saved_under_their_salt_but_never_announced_to_routers() -> None:
    """Risk: a KV-aware router, which matches vLLM's events by token ids, credits a salted
    request's blocks to requests of another salt (over-credit), or the salted save is keyed
    without its salt."""
    node = Node()
    announced: list[str] = []
    node.scheduler.events = SimpleNamespace(  # type: ignore[assignment]
        planned=lambda request, *_: announced.append(request.request_id))
    sched = node.scheduler
    for rid, salt in (("salted", "tenant-a"), ("plain", None)):
        request = FakeRequest(rid, TOKENS, cache_salt=salt)
        sched.on_new_request(request)
        sched.get_num_new_matched_tokens(request, 0)
        meta = sched.build_connector_meta(output(new=[(rid, list(range(20, 29)), 0, 8)]))
        root = context_root(node.specs[0].digest(), (("cache_salt", salt),) if salt else ())
        assert list(meta.saves[0].keys_by_rank[0]) == block_keys(root, TOKENS[:8], BLOCK_TOKENS)
    assert announced == ["plain"]


def image(identifier: str | None, offset: int, length: int) -> SimpleNamespace:
    """A multimodal input as vLLM's request holds it (MultiModalFeatureSpec's fields read)."""
    return SimpleNamespace(identifier=identifier, modality="image",
                           mm_position=SimpleNamespace(offset=offset, length=length))


def test_an_image_keys_the_blocks_holding_its_placeholders_and_those_after() -> None:
    """Risk: two images behind the same placeholder tokens share KV (one image's KV answers
    a question about the other), or the text before an image stops being reused."""
    node = Node()
    extras = mm_block_extras(FakeRequest("x", TOKENS, mm_features=[image("cat", 8, 6)]),
                             0, 8, BLOCK_TOKENS)
    assert extras == {2: (("mm", "cat:0"),), 3: (("mm", "cat:-4"),)}
    for rank, store in enumerate(node.stores):
        keys = block_keys_with(node.specs[rank].digest(), TOKENS[:24], BLOCK_TOKENS, extras)
        store.store(keys, [pattern_block(k, BLOCK) for k in keys])
    assert hit(node, FakeRequest("cat", TOKENS, mm_features=[image("cat", 8, 6)])) == 24
    assert hit(node, FakeRequest("dog", TOKENS, mm_features=[image("dog", 8, 6)])) == 8
    assert hit(node, FakeRequest("moved", TOKENS, mm_features=[image("cat", 9, 6)])) == 8
    assert hit(node, FakeRequest("text", TOKENS)) == 8  # the text before the image
    assert hit(node, FakeRequest("unnamed", TOKENS, mm_features=[image(None, 8, 6)])) == 0
    assert node.stats.take().data["bypassed"] == {"multimodal": 1}  # type: ignore[union-attr]
