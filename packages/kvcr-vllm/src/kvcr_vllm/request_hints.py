"""Where a vLLM request carries its KV hint, and which of its blocks a hint names.

- `raw_hint`: the hint of a request, from `Request.kv_hints` (vLLM's own `KvHintsEnvelope`,
  a msgspec Struct: how Dynamo 1.6.1 delivers hints on vLLM 0.32) or else
  `kv_transfer_params["kv_hint"]` (kvcr-router, clients). Either goes through the same
  validation, limits and counters (`kvcr_core.hints.HintIntake`); anything that is not plain
  data becomes a value the intake rejects (counted), never an exception here.
- `block_hint_hashes`: the hash a hint would use for each of the request's blocks, under the
  configured `HintHashScheme`: kvcr's router hash of the block's kvcr key (`kvcr-v1`), or
  vLLM's own prefix-cache hash of that block (`vllm-engine`: `request.block_hashes[i]` as an
  unsigned 64-bit int, the way vLLM's KV events publish it: the first 8 bytes, big endian).
  Engine hashes depend on the hash algorithm and PYTHONHASHSEED; they match whenever both
  engines agree on them (Dynamo's router only sees hashes the engines published).

Pure; thread-safe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvcr_core.keys import router_hash_kvcr_v1
from kvcr_core.types import BlockKey
from kvcr_vllm.router_tier import HintHashScheme

_U64_MASK = (1 << 64) - 1
_STRUCT_DEPTH = 4  # envelope -> actions -> action -> payload


class _Unreadable:
    """Stands for a hint that is not plain data (the intake rejects it as not a mapping)."""


def raw_hint(request: Any) -> object | None:
    """The request's hint as plain data (None: it has none)."""
    envelope = getattr(request, "kv_hints", None)
    if envelope is not None:
        return _plain(envelope, _STRUCT_DEPTH)
    params = getattr(request, "kv_transfer_params", None)
    if isinstance(params, Mapping) and "kv_hint" in params:
        hint: object = params["kv_hint"]
        return hint
    return None


def _plain(value: object, depth: int) -> object:
    """msgspec Structs (`__struct_fields__`) as dicts, lists as lists, the rest unchanged."""
    fields = getattr(type(value), "__struct_fields__", None)
    if fields is not None:
        if depth <= 0 or not isinstance(fields, tuple):
            return _Unreadable()
        return {str(name): _plain(getattr(value, str(name), None), depth - 1)
                for name in fields}
    if isinstance(value, list | tuple) and depth > 0:
        return [_plain(item, depth - 1) for item in value]
    return value


def engine_hash_u64(block_hash: object) -> int | None:
    """vLLM's block hash (bytes; int where vLLM already converted it) as its KV events' u64."""
    if isinstance(block_hash, bytes | bytearray) and block_hash:
        return int.from_bytes(block_hash, "big") & _U64_MASK
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return block_hash & _U64_MASK
    return None


def block_hint_hashes(scheme: HintHashScheme, request: Any,
                      keys: Sequence[BlockKey]) -> list[int | None]:
    """The hint hash of each block of `keys` (the request's kvcr keys, rank 0, block 0 on);
    all None unless vLLM hashed exactly these blocks (its hash block size is kvcr's block
    size: `len(request.block_hashes)` is the number of full blocks)."""
    if scheme is HintHashScheme.KVCR_V1:
        return [router_hash_kvcr_v1(key) for key in keys]
    engine = list(getattr(request, "block_hashes", None) or ())
    if len(engine) != len(keys):
        return [None] * len(keys)  # another hash block size: nothing maps block to block
    return [engine_hash_u64(h) for h in engine]
