"""vLLM KV events -> the router's device tier: translation to kvcr hashes, restarts, and the
real ZMQ wire format."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from kvcr_router.feeds import KvEventsFeed, VllmEventTranslator
from kvcr_router.hashing import PromptHasher
from kvcr_router.indexer import BlockIndexer, Tier
from kvcr_router.metrics import RouterMetrics

pytestmark = pytest.mark.unit

DIGEST = bytes(range(16))
TOKENS = [(i * 31) % 1000 + 3 for i in range(32 * 5)]
HASHES = PromptHasher(DIGEST, 32).hashes(TOKENS)


def stored(vllm_hashes: list[int], parent: int | None, first_block: int,
           **extra: Any) -> dict[str, Any]:
    tokens = TOKENS[first_block * 32:(first_block + len(vllm_hashes)) * 32]
    return {"type": "BlockStored", "block_hashes": vllm_hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": 32, "lora_id": None, "medium": "GPU", **extra}


def test_translator_chains_vllm_blocks_into_kvcr_hashes() -> None:
    """Each BlockStored continues the kvcr chain of its parent; blocks whose parent we never
    saw, or whose KV depends on more than tokens, are skipped; removals map back."""
    tr = VllmEventTranslator(DIGEST, 32)
    assert tr.stored(stored([901, 902, 903], None, 0)) == HASHES[:3]
    assert tr.stored(stored([904, 905], 903, 3)) == HASHES[3:5]
    assert tr.stored(stored([999], 777, 2)) == []  # parent unknown
    assert tr.stored(stored([906], None, 0, lora_name="adapter")) == []
    assert tr.stored(stored([906], None, 0, extra_keys=[("salt",)])) == []
    assert tr.stored(stored([906], None, 0, medium="CPU")) == []
    assert tr.stored({**stored([906], None, 0), "block_size": 16}) == []
    assert tr.removed({"type": "BlockRemoved", "block_hashes": [902, 123],
                       "medium": "GPU"}) == [HASHES[1]]
    bounded = VllmEventTranslator(DIGEST, 32, max_blocks=2)
    bounded.stored(stored([1, 2, 3], None, 0))
    assert bounded.stored(stored([4], 1, 1)) == []  # the oldest mapping was forgotten


def test_feed_applies_batches_and_survives_engine_restart_and_clears() -> None:
    """Sequence numbers from 0, a restart (numbers go back), AllBlocksCleared and a failed
    health check each leave only what the engine holds now."""
    idx = BlockIndexer()
    feed = KvEventsFeed("a", "tcp://127.0.0.1:1", VllmEventTranslator(DIGEST, 32), idx,
                        RouterMetrics(CollectorRegistry(), ["a"]))
    feed.apply(0, [stored([1, 2], None, 0)])
    feed.apply(1, [stored([3], 2, 2)])
    assert idx.prefix("a", Tier.DEVICE, HASHES) == 3
    feed.apply(0, [stored([7], None, 0)])  # restarted engine
    assert idx.prefix("a", Tier.DEVICE, HASHES) == 1
    feed.apply(1, [stored([8], 7, 1), {"type": "AllBlocksCleared"}, stored([9], None, 0)])
    assert idx.prefix("a", Tier.DEVICE, HASHES) == 1
    feed.lost()
    assert idx.prefix("a", Tier.DEVICE, HASHES) == 0


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    """vLLM 0.32's event struct (vllm/distributed/kv_events.py), fields in its order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def test_feed_reads_vllms_zmq_wire_format() -> None:
    """Multipart (topic, u64 big-endian seq, msgpack EventBatch) from a ZMQ PUB socket lands
    in the device tier."""
    zmq = pytest.importorskip("zmq")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    idx = BlockIndexer()
    feed = KvEventsFeed("a", f"tcp://127.0.0.1:{port}", VllmEventTranslator(DIGEST, 32), idx,
                        RouterMetrics(CollectorRegistry(), ["a"]))

    async def run() -> None:
        task = asyncio.create_task(feed.run())
        event = BlockStored([11, 12, 13, 14, 15], None, TOKENS, 32, None, "GPU", None,
                            group_idx=0, kv_cache_spec_kind="full_attention")
        payload = msgspec.msgpack.encode(EventBatch(time.time(), [event]))
        deadline = time.monotonic() + 10
        seq = 0
        while idx.prefix("a", Tier.DEVICE, HASHES) < 5:  # a SUB joins late: publish again
            assert time.monotonic() < deadline
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
            seq += 1
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(run())
    finally:
        pub.close(linger=0)
        ctx.term()
