"""Block keys, namespace digests and router hashes: the wire contract routers rely on."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcr_core.errors import ConfigError
from kvcr_core.keys import (
    NamespaceSpec,
    block_keys,
    block_keys_with,
    context_root,
    encode_tokens,
    router_hash_kvcr_v1,
    router_hash_scheme,
    router_hashes,
    sequence_keys,
)

pytestmark = pytest.mark.unit

VECTORS = Path(__file__).resolve().parents[3] / "docs" / "key-vectors.json"
SPEC = NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32", block_size_tokens=4,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/v1")


def reference_digest(canonical_json: str) -> bytes:
    """docs/keys.md §1, written independently of kvcr_core.keys."""
    return hashlib.blake2b(b"kvcr-namespace-v1\x00" + canonical_json.encode(),
                           digest_size=16).digest()


def reference_keys(digest: bytes, tokens: list[int], block: int) -> list[bytes]:
    """docs/keys.md §2, written independently of kvcr_core.keys."""
    out, prev = [], digest
    for i in range(len(tokens) // block):
        chunk = tokens[i * block:(i + 1) * block]
        prev = hashlib.blake2b(prev + struct.pack(f"<{block}I", *chunk), digest_size=16).digest()
        out.append(prev)
    return out


def test_checked_in_vectors_match_implementation_and_spec() -> None:
    """The JSON vectors, the documented algorithm and the code agree (cross-language contract)."""
    data = json.loads(VECTORS.read_text())
    assert data["scheme"] == "blake2b-128-chain-v1"
    assert len(data["vectors"]) >= 3
    for vec in data["vectors"]:
        spec = NamespaceSpec.from_mapping(vec["namespace"])
        assert spec.canonical_bytes().decode() == vec["canonical_json"]
        assert spec.digest().hex() == vec["digest"] == reference_digest(vec["canonical_json"]).hex()
        for case in vec["cases"]:
            keys = sequence_keys(spec, case["tokens"])
            assert [k.hex() for k in keys] == case["keys"]
            ref = reference_keys(spec.digest(), case["tokens"], spec.block_size_tokens)
            assert [k.hex() for k in ref] == case["keys"]
            assert router_hashes(keys) == case["router_hashes"]
            assert case["router_hashes"] == [int.from_bytes(bytes.fromhex(k)[:8], "little")
                                             for k in case["keys"]]


@pytest.mark.parametrize("field,value", [
    ("model_id", "other"), ("model_revision", "r2"), ("dtype", "bfloat16"),
    ("kv_dtype", "fp8"), ("block_size_tokens", 8), ("num_layers", 3), ("num_kv_heads", 4),
    ("head_dim", 128), ("layout", "test/v2"), ("tp_size", 2), ("tenant", "t"), ("lora", "x"),
    ("extra", {"pp_rank": "1"}),
])
def test_every_namespace_field_changes_the_digest(field: str, value: object) -> None:
    """Blocks of engines that differ in any compatibility field never share a namespace."""
    fields = {**SPEC.__dict__, field: value}
    assert NamespaceSpec(**fields).digest() != SPEC.digest()


def test_extra_order_does_not_change_digest() -> None:
    """Engine extras are canonicalised (sorted), so dict order cannot split a namespace."""
    a = NamespaceSpec(**{**SPEC.__dict__, "extra": {"a": "1", "b": "2"}})
    b = NamespaceSpec(**{**SPEC.__dict__, "extra": {"b": "2", "a": "1"}})
    assert a.digest() == b.digest()


def test_partial_last_block_gets_no_key_and_chain_continues() -> None:
    """Only full blocks are keyed; continuing from a parent equals keying the whole prompt."""
    tokens = list(range(10))
    keys = sequence_keys(SPEC, tokens)
    assert len(keys) == 2
    continued = block_keys(keys[0], tokens[4:], 4)
    assert continued == keys[1:]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(0, 2**32 - 1))
def test_key_commits_to_every_earlier_token(tokens: list[int], replacement: int) -> None:
    """Changing any token changes the key of its block and of every later block."""
    keys = sequence_keys(SPEC, tokens)
    for pos in range(min(len(tokens), 12)):
        if tokens[pos] == replacement:
            continue
        changed = sequence_keys(SPEC, [*tokens[:pos], replacement, *tokens[pos + 1:]])
        first = pos // 4
        assert changed[:first] == keys[:first]
        assert all(a != b for a, b in zip(changed[first:], keys[first:], strict=True))


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", None])
def test_out_of_range_token_ids_are_refused(bad: object) -> None:
    """Token ids outside u32 cannot be encoded silently (they would alias other prompts)."""
    with pytest.raises(ValueError, match="token id"):
        encode_tokens([1, bad])  # type: ignore[list-item]


def test_namespace_validation_names_the_field() -> None:
    """A bad namespace field fails at construction with the field name and a fix."""
    with pytest.raises(ConfigError) as err:
        NamespaceSpec(**{**SPEC.__dict__, "tp_rank": 2})
    assert err.value.field == "namespace.tp_rank"
    with pytest.raises(ConfigError, match="unknown field"):
        NamespaceSpec.from_mapping({**SPEC.__dict__, "blocksize": 16})
    with pytest.raises(ConfigError, match="positive integer"):
        NamespaceSpec(**{**SPEC.__dict__, "num_layers": 0})


def test_router_projection_is_first_8_bytes_little_endian() -> None:
    """The documented kvcr-v1 projection; unknown schemes are a config error."""
    key = bytes(range(16))
    assert router_hash_kvcr_v1(key) == 0x0706050403020100
    assert router_hash_scheme("kvcr-v1") is router_hash_kvcr_v1
    with pytest.raises(ConfigError, match="kvcr-v1"):
        router_hash_scheme("xxh3")


def test_context_root_follows_the_spec_and_separates_contexts() -> None:
    """Risk: two tenants' salts (or two adapters) root the same chain and share KV, or the
    root drifts from docs/keys.md and other routers compute other keys."""
    ns = bytes(range(16))
    assert context_root(ns, ()) == ns  # no context: the namespace digest itself
    context = (("lora", "ab" * 16), ("cache_salt", "tenant-\u00e9"))
    want = hashlib.blake2b(b"kvcr-request-context-v1\x00" + ns
                           + '[["lora","abababababababababababababababab"],'
                             '["cache_salt","tenant-\u00e9"]]'.encode(),
                           digest_size=16).digest()
    assert context_root(ns, context) == want
    roots = {context_root(ns, c) for c in [(), (("cache_salt", "a"),), (("cache_salt", "b"),),
                                           (("lora", "a"),), (("cache_salt", "a"), ("lora", "a")),
                                           (("lora", "a"), ("cache_salt", "a"))]}
    assert len(roots) == 6
    with pytest.raises(ValueError, match="16 bytes"):
        context_root(b"short", (("cache_salt", "a"),))


def test_a_blocks_extras_change_its_key_and_every_later_one_only() -> None:
    """Risk: two images behind the same placeholder tokens get one key (one image's KV served
    for the other), or the text before the image stops sharing with text-only prompts."""
    root, tokens = bytes(range(16)), list(range(1, 41))  # 10 blocks of 4
    plain = block_keys(root, tokens, 4)
    assert block_keys_with(root, tokens, 4, {}) == plain
    cat = block_keys_with(root, tokens, 4, {3: (("mm", "cat:0"),), 4: (("mm", "cat:-4"),)})
    dog = block_keys_with(root, tokens, 4, {3: (("mm", "dog:0"),), 4: (("mm", "dog:-4"),)})
    assert cat[:3] == dog[:3] == plain[:3]
    assert all(c != d and c != p for c, d, p in zip(cat[3:], dog[3:], plain[3:], strict=True))
    assert cat[3] == block_keys(context_root(plain[2], (("mm", "cat:0"),)), tokens[12:16], 4)[0]
    again = block_keys_with(root, tokens[:20], 4, {3: (("mm", "cat:0"),), 4: (("mm", "cat:-4"),)})
    assert again == cat[:5]  # the same image: the same keys
    first = block_keys_with(root, tokens, 4, {0: (("mm", "cat:0"),), 99: (("mm", "x:0"),)})
    assert first[0] == block_keys(context_root(root, (("mm", "cat:0"),)), tokens[:4], 4)[0]
