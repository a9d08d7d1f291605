"""KV hints on the way through the router: strip what clients sent, attach the router's own.

A client must not steer a worker's fetches (a hint names an endpoint to dial and blocks to
trust), and no client of the router has a use for `kv_transfer_params` at all, so
`strip_client_hints` removes every place one can hide in an OpenAI request body, whatever
its type: top-level `kv_transfer_params`, `kv_hint` and `kv_hints`, and the same three
inside `vllm_xargs` (vLLM merges `vllm_xargs` into the sampling params' `extra_args`, where
the engine reads `kv_transfer_params` too); it says which it found. `attach_hint` writes
the router's envelope (docs/hints.md: protocol 0.1, one `kv.fetch@1.0` action) into a fresh
`kv_transfer_params["kv_hint"]`, where kvcr-vllm reads it. On the way back,
`strip_response_params` drops the `kv_transfer_params` a worker returns in a whole JSON
answer (kvcr-vllm reports there the tokens it loaded for the request: a cache detail).
Pure functions on the parsed body or the answer's bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvcr_core.hints import DEFAULT_LIMITS, FETCH_ACTION_VERSION, PROTOCOL_VERSION
from kvcr_router.cost import Decision
from kvcr_router.indexer import BlockIndexer, Tier

# (container, key): container "" is the body itself. Bounded label set for metrics.
HINT_FIELDS = (("", "kv_transfer_params"), ("", "kv_hint"), ("", "kv_hints"),
               ("vllm_xargs", "kv_transfer_params"), ("vllm_xargs", "kv_hint"),
               ("vllm_xargs", "kv_hints"))


def field_label(container: str, key: str) -> str:
    return f"{container}.{key}" if container else key


def strip_client_hints(body: dict[str, Any]) -> list[str]:
    """Removes client-supplied hints and transfer params (any value, null included) in
    place; returns the fields that held one."""
    found = []
    for container, key in HINT_FIELDS:
        holder = body.get(container) if container else body
        if isinstance(holder, dict) and key in holder:
            del holder[key]
            found.append(field_label(container, key))
    return found


def attach_hint(body: dict[str, Any], envelope: dict[str, Any]) -> None:
    """Sets `kv_transfer_params` to a new dict holding only the router's hint (the body is a
    shallow copy of one that a retry reuses: nothing nested may keep this attempt's hint)."""
    body["kv_transfer_params"] = {"kv_hint": envelope}


def strip_response_params(answer: bytes) -> bytes:
    """A worker's JSON answer without its top-level `kv_transfer_params`; other bytes, and
    answers without that field, unchanged."""
    if b'"kv_transfer_params"' not in answer:
        return answer
    try:
        parsed = json.loads(answer)
    except ValueError:  # not JSON after all (includes UnicodeDecodeError)
        return answer
    if not isinstance(parsed, dict) or "kv_transfer_params" not in parsed:
        return answer
    del parsed["kv_transfer_params"]
    return json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode()


def build_envelope(message_id: str, source_endpoint: str,
                   block_hashes: Sequence[int]) -> dict[str, Any]:
    return {"protocol_version": PROTOCOL_VERSION, "message_id": message_id,
            "actions": [{"action_id": "fetch-0", "action_type": "kv.fetch",
                         "action_version": FETCH_ACTION_VERSION,
                         "payload": {"source_control_endpoint": source_endpoint,
                                     "block_hashes": list(block_hashes), "mode": "copy"}}]}


def hinted_hashes(indexer: BlockIndexer, decision: Decision, hashes: Sequence[int]) -> list[int]:
    """The hashes to name: the source's run the decision credited, widened back to the
    destination's pool prefix when the source holds that stretch too. The connector extends
    its *pool* prefix with hinted blocks, and the router's `local` may also count blocks only
    in the destination's engine cache."""
    low, high = decision.hint_range
    source = decision.hint_source
    if source is None:
        return []
    pool = indexer.prefix(decision.worker, Tier.POOL, hashes)
    if pool < low and max(indexer.run_from(source, tier, hashes, pool) for tier in Tier) >= low:
        low = pool
    # Workers refuse larger hints; the run's start is what extends the worker's prefix.
    return list(hashes[low:min(high, low + DEFAULT_LIMITS.max_hashes)])
