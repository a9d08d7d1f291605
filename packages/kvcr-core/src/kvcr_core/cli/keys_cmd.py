"""`kvcr keys`: block keys and router hashes of a token list, for router authors to compare
their implementation with kvcr's (docs/keys.md)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from kvcr_core.errors import ConfigError
from kvcr_core.keys import NamespaceSpec, router_hash_scheme, sequence_keys


def _read_text(ref: str) -> str:
    if ref == "-":
        return sys.stdin.read()
    return Path(ref).read_text(encoding="utf-8")


def parse_tokens(text: str) -> list[int]:
    text = text.strip()
    if text.startswith("["):
        data = json.loads(text)
        if not isinstance(data, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in data):
            raise ValueError("the JSON token list must hold integers only")
        return data
    parts = [p for p in re.split(r"[\s,]+", text) if p]
    try:
        return [int(p) for p in parts]
    except ValueError as exc:
        raise ValueError(f"token ids must be integers: {exc}") from None


def run_keys(namespace_ref: str, tokens_ref: str, *, scheme: str, as_json: bool) -> int:
    try:
        spec = NamespaceSpec.from_reference(namespace_ref)
        project = router_hash_scheme(scheme)
        tokens = parse_tokens(_read_text(tokens_ref))
        keys = sequence_keys(spec, tokens)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"kvcr keys: {exc}", file=sys.stderr)
        return 2
    rows = [{"block": i, "key": k.hex(), "router_hash": project(k)} for i, k in enumerate(keys)]
    if as_json:
        print(json.dumps({"namespace": spec.digest().hex(), "scheme": scheme,
                          "block_size_tokens": spec.block_size_tokens,
                          "tokens": len(tokens), "blocks": rows}, indent=2))
        return 0
    print(f"namespace {spec.digest().hex()}  block_size {spec.block_size_tokens}  "
          f"tokens {len(tokens)}  full blocks {len(keys)}  scheme {scheme}")
    print(f"{'block':>5}  {'key (hex)':32}  router_hash (u64)")
    for row in rows:
        print(f"{row['block']:>5}  {row['key']}  {row['router_hash']}")
    return 0
