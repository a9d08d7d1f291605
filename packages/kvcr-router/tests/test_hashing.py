"""Router hashing: kvcr-core's key vectors, the connector's own key chain, prompt tokenizing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcr_core.keys import NamespaceSpec, router_hashes, sequence_keys
from kvcr_router.hashing import HfTokenizer, PromptHasher

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
SPEC = NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32", block_size_tokens=32,
                     num_layers=4, num_kv_heads=2, head_dim=64, layout="vllm-0.32.0/cpu/AVX2")


def test_hashes_reproduce_every_key_vector() -> None:
    """The router's hashes equal docs/key-vectors.json (the wire contract with runners)."""
    vectors = json.loads((REPO / "docs" / "key-vectors.json").read_text())
    cases = 0
    for vector in vectors["vectors"]:
        spec = NamespaceSpec.from_mapping(vector["namespace"])
        hasher = PromptHasher(bytes.fromhex(vector["digest"]), spec.block_size_tokens)
        for case in vector["cases"]:
            assert hasher.hashes(case["tokens"]) == case["router_hashes"]
            cases += 1
    assert cases >= 5


@pytest.mark.slow  # imports vLLM (~20 s on 2 cores)
def test_hashes_equal_the_vllm_connectors_chain() -> None:
    """The scheduler side of kvcr-vllm keys a request's tokens to the same router hashes
    (the worker matches hint hashes against exactly these)."""
    pytest.importorskip("vllm", reason="vLLM is installed by scripts/setup.sh")
    from kvcr_core.keys import router_hash_kvcr_v1
    from kvcr_vllm.fetches import RequestState
    from kvcr_vllm.scheduler import KVCRConnectorScheduler
    from kvcr_vllm.settings import ConnectorSettings
    from kvcr_vllm.stats import StatsRecorder

    settings = ConnectorSettings.from_extra_config(
        {"mode": "guarded", "socket": "/nonexistent/guard.sock"}, "engine-0")
    scheduler = KVCRConnectorScheduler(settings, [SPEC], 4096, StatsRecorder(), "engine-0")
    tokens = [(i * 7919) % 2000 + 4 for i in range(1000)]

    class Request:
        request_id = "r1"
        all_token_ids = tokens

    state = RequestState(Request(), None)  # type: ignore[arg-type]
    (keys,) = scheduler._keys(state, len(tokens) // 32)
    expected = [router_hash_kvcr_v1(k) for k in keys]
    assert len(expected) == 31
    assert PromptHasher(SPEC.digest(), 32).hashes(tokens) == expected
    assert expected == router_hashes(sequence_keys(SPEC, tokens))


class FakeTokenizer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        self.calls.append(("encode", add_special_tokens))
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> str:
        self.calls.append(("chat", options))
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if options["add_generation_prompt"] else "")


def test_completion_prompts_follow_vllms_rules() -> None:
    """Text gets BOS unless add_special_tokens is false; token ids pass as given; a batch is
    routed by its first prompt; truncation keeps the end; salted or unknown prompts: None."""
    tok = FakeTokenizer()
    hasher = PromptHasher(SPEC.digest(), 32, tok)
    assert hasher.tokens("completions", {"prompt": "ab"}) == [1, 97, 98]
    assert hasher.tokens("completions", {"prompt": "ab", "add_special_tokens": False}) == [97, 98]
    assert hasher.tokens("completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert hasher.tokens("completions", {"prompt": [[5, 6], [8]]}) == [5, 6]
    assert hasher.tokens("completions", {"prompt": ["ab", "cd"]}) == [1, 97, 98]
    assert hasher.tokens("completions", {"prompt": [1, 2, 3, 4],
                                         "truncate_prompt_tokens": 2}) == [3, 4]
    assert hasher.tokens("completions", {"prompt": "ab", "cache_salt": "t1"}) is None
    assert hasher.tokens("completions", {"prompt": [-1, 2]}) is None
    assert PromptHasher(SPEC.digest(), 32).tokens("completions", {"prompt": "ab"}) is None


def test_chat_renders_the_template_then_encodes_without_special_tokens() -> None:
    """Chat: template with the generation prompt, text parts joined by newlines, encoded
    without BOS (the template's job); images make the prompt unknowable (None)."""
    tok = FakeTokenizer()
    hasher = PromptHasher(SPEC.digest(), 32, tok)
    body = {"messages": [{"role": "system", "content": "s"},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}],
            "chat_template_kwargs": {"enable_thinking": False}}
    assert hasher.tokens("chat", body) == [ord(c) for c in "<system>s<user>a\nb<assistant>"]
    assert tok.calls[-2] == ("chat", {"add_generation_prompt": True,
                                      "continue_final_message": False,
                                      "enable_thinking": False})
    assert tok.calls[-1] == ("encode", False)
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert hasher.tokens("chat", image) is None


def test_real_tokenizer_and_template_of_the_tiny_model(tiny_model: str) -> None:
    """The Hugging Face seam loads the model folder vLLM serves and applies its template
    (the model comes from the shared fixture: this test used to skip when it ran first)."""
    tok = HfTokenizer(tiny_model)
    hasher = PromptHasher(SPEC.digest(), 32, tok)
    chat = hasher.tokens("chat", {"messages": [{"role": "user", "content": "hello there"}]})
    assert chat == tok.encode("<|user|>hello there\n<|assistant|>", add_special_tokens=False)
    text = hasher.tokens("completions", {"prompt": "hello there"})
    assert text is not None and text[0] == tok.encode("", add_special_tokens=True)[0]
