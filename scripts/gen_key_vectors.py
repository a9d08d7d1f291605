"""Writes docs/key-vectors.json: namespaces, token lists and the keys kvcr derives from them.

Run after a deliberate change of the key algorithm (which must also change its version):
    .venv/bin/python scripts/gen_key_vectors.py
"""

from __future__ import annotations

import json
from pathlib import Path

from kvcr_core.keys import KEY_SCHEME, NamespaceSpec, router_hashes, sequence_keys

BASE = {"model_id": "meta-llama/Llama-3.1-8B-Instruct", "model_revision": "0e9e39f",
        "dtype": "bfloat16", "kv_dtype": "bfloat16", "block_size_tokens": 16,
        "num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "layout": "vllm/NHD"}

NAMESPACES = [
    BASE,
    {**BASE, "tp_size": 2, "tp_rank": 1, "tenant": "team-a", "lora": "sql-adapter"},
    {**BASE, "model_id": "tiny-llama-local", "model_revision": "", "dtype": "float32",
     "kv_dtype": "float32", "block_size_tokens": 32, "num_layers": 2, "num_kv_heads": 4,
     "layout": "vllm-cpu/avx2", "extra": {"pp_rank": "0", "mla": "false"}},
]

TOKEN_LISTS = [
    [],
    list(range(1, 11)),
    list(range(100, 116)),
    [*list(range(1000, 1064)), 7],
    [0, 4294967295, 1, 65535, 65536, 128000, 2, 3] * 8,
]


def main() -> None:
    vectors = []
    for ns in NAMESPACES:
        spec = NamespaceSpec.from_mapping(ns)
        cases = []
        for tokens in TOKEN_LISTS:
            keys = sequence_keys(spec, tokens)
            cases.append({"tokens": tokens, "keys": [k.hex() for k in keys],
                          "router_hashes": router_hashes(keys)})
        vectors.append({"namespace": ns, "canonical_json": spec.canonical_bytes().decode(),
                        "digest": spec.digest().hex(), "cases": cases})
    out = {"scheme": KEY_SCHEME, "router_hash_scheme": "kvcr-v1", "vectors": vectors}
    path = Path(__file__).resolve().parents[1] / "docs" / "key-vectors.json"
    path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
