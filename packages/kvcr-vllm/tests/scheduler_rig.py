"""The scheduler side's test rig: a fake of the vLLM request attributes the scheduler reads,
a SchedulerOutput builder and `Node`, a real scheduler over one in-process Runner (shared by
the scheduler unit tests; imported, never collected)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from kvcr_core.config import KVCRConfig
from kvcr_core.keys import NamespaceSpec, block_keys
from kvcr_core.runner import Runner
from kvcr_core.testing import LoopbackPeers, ManualClock, ObservedRunner, in_process, pattern_block
from kvcr_vllm.scheduler import KVCRConnectorScheduler
from kvcr_vllm.settings import ConnectorSettings, KVGroup, rank_namespaces
from kvcr_vllm.stats import StatsRecorder

BLOCK_TOKENS = 4
BLOCK = 4096
PEER = "tcp://10.0.0.2:7500"


def spec(rank: int, tp: int) -> NamespaceSpec:
    return NamespaceSpec(model_id="m", dtype="float32", kv_dtype="float32",
                         block_size_tokens=BLOCK_TOKENS, num_layers=2, num_kv_heads=2,
                         head_dim=64, layout="test/v1", tp_size=tp, tp_rank=rank)


@dataclasses.dataclass
class FakeRequest:
    """The attributes of vLLM's Request that the scheduler side reads."""

    request_id: str
    all_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    mm_features: list[Any] | None = None
    prompt_embeds: Any = None
    lora_request: Any = None
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class Blocks:
    """vLLM's KVCacheBlocks: one list of block ids, or one per KV cache group."""

    def __init__(self, ids: list[int], *more_groups: list[int]) -> None:
        self.ids = (ids, *more_groups)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


def grouped(ids: list[int] | tuple[list[int], ...]) -> tuple[list[int], ...]:
    return ids if isinstance(ids, tuple) else (ids,)


def output(new: list[tuple[str, list[int], int, int]] = (),  # type: ignore[assignment]
           cached: list[tuple[str, list[int], int, int, bool]] = ()  # type: ignore[assignment]
           ) -> SimpleNamespace:
    """A SchedulerOutput: new requests (id, block ids, computed, scheduled) and cached ones
    (id, new block ids, computed, scheduled, resumed); block ids are a list, or a tuple of one
    list per KV cache group."""
    return SimpleNamespace(
        num_scheduled_tokens={r[0]: r[3] for r in [*new, *cached]},
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=grouped(ids),
                                            num_computed_tokens=c) for r, ids, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r[0] for r in cached], new_block_ids=[grouped(r[1]) for r in cached],
            resumed_req_ids={r[0] for r in cached if r[4]},
            num_computed_tokens=[r[2] for r in cached]))


class Node:
    """A scheduler over `tp` ranks of one in-process Runner, optionally with peers;
    `attention`: a hybrid model's KV cache groups (one namespace per rank and group, one
    for all ranks of an "mla" group, as the connector makes them; `stores` and `keys` then
    index namespaces, not ranks)."""

    def __init__(self, tp: int = 1, *, sources: dict[str, Runner | None] | None = None,
                 answer_after_polls: int = 1, extra: dict[str, Any] | None = None,
                 synchronous_loads: bool = False, attention: tuple[str, ...] = ("full",)
                 ) -> None:
        self.runner = Runner(KVCRConfig(pool_bytes=256 * BLOCK, namespace_pool_bytes=64 * BLOCK),
                             registry=CollectorRegistry())
        groups = [KVGroup(("layer",), kind, BLOCK) for kind in attention]
        self.namespaces = rank_namespaces([spec(r, tp) for r in range(tp)], groups)
        self.specs = list(self.namespaces.specs)
        self.peers = LoopbackPeers(sources, answer_after_polls=answer_after_polls)
        self.ops = ObservedRunner(in_process(self.runner, self.specs, BLOCK, peers=self.peers))
        self.stores = self.ops.ops.stores  # per rank
        self.clock = ManualClock()
        self.stats = StatsRecorder()
        settings = ConnectorSettings.from_extra_config(
            {"mode": "guarded", "socket": "/run/kvcr/unused.sock",
             "peers": list(sources or {}), "fetch_deadline_s": 2, "fetch_wait_s": 0,
             **(extra or {})}, "e")
        self.scheduler = KVCRConnectorScheduler(settings, self.specs, BLOCK, self.stats, "e",
                                                runner=self.ops, clock=self.clock,
                                                sleep=self.clock.advance,
                                                synchronous_loads=synchronous_loads,
                                                namespaces=self.namespaces)

    def keys(self, tokens: list[int], rank: int = 0) -> list[bytes]:
        return list(block_keys(self.specs[rank].digest(), tokens, BLOCK_TOKENS))

    def stock(self, tokens: list[int], namespaces: list[int] | None = None) -> None:
        """Stores the full blocks of `tokens` on every rank (or in these namespaces)."""
        for rank, store in enumerate(self.stores):
            if namespaces is not None and rank not in namespaces:
                continue
            keys = self.keys(tokens, rank)
            store.store(keys, [pattern_block(k, BLOCK) for k in keys])

    def counters(self) -> dict[str, int | float]:
        taken = self.stats.take()
        return {} if taken is None else taken.reduce()
