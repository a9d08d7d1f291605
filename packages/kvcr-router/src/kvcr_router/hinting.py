"""KV hints on the way through the router: strip what clients sent, attach the router's own.

A client must not steer a worker's fetches (a hint names an endpoint to dial and blocks to
trust), so `strip_client_hints` removes every place a hint can hide in an OpenAI request body
(`kv_transfer_params.kv_hint`, top-level `kv_hint` / `kv_hints`, and the same two inside
`vllm_xargs`) and says which it found. `attach_hint` writes the router's envelope
(docs/hints.md: protocol 0.1, one `kv.fetch@1.0` action) into
`kv_transfer_params["kv_hint"]`, where kvcr-vllm reads it. Pure functions on the parsed body.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcr_core.hints import DEFAULT_LIMITS, FETCH_ACTION_VERSION, PROTOCOL_VERSION
from kvcr_router.cost import Decision
from kvcr_router.indexer import BlockIndexer, Tier

# (container, key): container "" is the body itself. Bounded label set for metrics.
HINT_FIELDS = (("kv_transfer_params", "kv_hint"), ("", "kv_hint"), ("", "kv_hints"),
               ("vllm_xargs", "kv_hint"), ("vllm_xargs", "kv_hints"))


def field_label(container: str, key: str) -> str:
    return f"{container}.{key}" if container else key


def strip_client_hints(body: dict[str, Any]) -> list[str]:
    """Removes client-supplied hints in place; returns the fields that held one."""
    found = []
    for container, key in HINT_FIELDS:
        holder = body.get(container) if container else body
        if isinstance(holder, dict) and key in holder:
            del holder[key]
            found.append(field_label(container, key))
    return found


def attach_hint(body: dict[str, Any], envelope: dict[str, Any]) -> None:
    """Sets `kv_transfer_params.kv_hint` on a new params dict (the body may be a shallow copy
    of one that a retry reuses: its nested dict must not keep this attempt's hint)."""
    params = body.get("kv_transfer_params")
    body["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}),
                                  "kv_hint": envelope}


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
