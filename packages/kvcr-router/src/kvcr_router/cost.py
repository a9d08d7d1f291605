"""The routing cost model and the fetch-source choice, in one pass over the workers.

Per worker:
  local  = max(device prefix, pool prefix)                 (blocks it can use without a fetch)
  fetch  = blocks a peer holds contiguously right after `local` (never across a hole),
           from the peer with the longest such run (ties: the lexically first worker)
  credit = device_w * device + pool_w * (local - device) + fetch_w * fetch
  cost   = prefill_scale * max(0, prompt_blocks - credit)
           + decode_w * decode_blocks + active_w * active_requests
The chosen worker is the cheapest (ties: the lexically first; with temperature > 0, a
softmax over -cost/temperature, seeded). A hint names the source only when its fetch lead is
at least `min_fetch_blocks` (the pull-versus-recompute crossover). Defaults follow the
reference router (device 1.0, host 0.75) with fetch credit below the pool's (0.5). Pure.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence

from kvcr_core.errors import ConfigError
from kvcr_router.indexer import BlockIndexer, Tier


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostWeights:
    device_w: float = 1.0
    pool_w: float = 0.75
    fetch_w: float = 0.5
    prefill_scale: float = 1.0
    decode_w: float = 1.0
    active_w: float = 0.0
    temperature: float = 0.0
    min_fetch_blocks: int = 4

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int | float) or isinstance(value, bool) or (
                    not math.isfinite(value)) or value < 0:
                raise ConfigError(field.name, value, "give a finite number >= 0")


# `reference`: the reference router's defaults. `tuned`: the weights `kvcr-router simulate
# --sweep` recommends (docs/router-simulator.md): full pool credit, balance by requests in
# flight instead of decode blocks (which pushes requests away from their prefix).
WEIGHT_PRESETS = {
    "reference": CostWeights(),
    "tuned": CostWeights(pool_w=1.0, decode_w=0.0, active_w=16.0),
}


@dataclasses.dataclass(frozen=True)
class WorkerLoad:
    decode_blocks: int = 0
    active_requests: int = 0


@dataclasses.dataclass(frozen=True)
class Candidate:
    worker: str
    cost: float
    device: int
    local: int
    fetch: int
    source: str | None  # the peer to fetch `fetch` blocks from, if any


@dataclasses.dataclass(frozen=True)
class Decision:
    worker: str
    candidates: tuple[Candidate, ...]
    hint_source: str | None  # name the source in a KV hint (lead beats the crossover)
    hint_range: tuple[int, int]  # block range the hint covers: [local, local + fetch)


def evaluate(indexer: BlockIndexer, hashes: Sequence[int], workers: Sequence[str],
             loads: Mapping[str, WorkerLoad], weights: CostWeights) -> list[Candidate]:
    n = len(hashes)
    peers = sorted(indexer.workers())
    names = {*peers, *workers}
    # Each (worker, tier) prefix is scanned once per decision. A peer's run from `local` in a
    # tier whose prefix reaches `local` ends exactly at that prefix, so only runs that start
    # past a hole need a scan (this keeps a 16-worker, 512-block decision well under 2 ms).
    on_device = {w: indexer.prefix(w, Tier.DEVICE, hashes) for w in names}
    in_pool = {w: indexer.prefix(w, Tier.POOL, hashes) for w in names}
    held = {w: max(on_device[w], in_pool[w]) for w in names}
    out = []
    for worker in workers:
        device = on_device[worker]
        local = held[worker]
        best_end, source = local, None
        for peer in peers:
            if peer == worker or held[peer] <= best_end:
                continue
            end = max(_run(indexer, peer, Tier.DEVICE, on_device[peer], hashes, local),
                      _run(indexer, peer, Tier.POOL, in_pool[peer], hashes, local))
            if end > best_end:
                best_end, source = end, peer
        fetch = best_end - local
        credit = (weights.device_w * device + weights.pool_w * (local - device)
                  + weights.fetch_w * fetch)
        load = loads.get(worker, WorkerLoad())
        cost = (weights.prefill_scale * max(0.0, n - credit)
                + weights.decode_w * load.decode_blocks
                + weights.active_w * load.active_requests)
        out.append(Candidate(worker, cost, device, local, fetch, source))
    return out


def _run(indexer: BlockIndexer, peer: str, tier: Tier, prefix: int, hashes: Sequence[int],
         start: int) -> int:
    return prefix if prefix >= start else indexer.run_from(peer, tier, hashes, start)


def choose(indexer: BlockIndexer, hashes: Sequence[int], workers: Sequence[str],
           loads: Mapping[str, WorkerLoad], weights: CostWeights,
           rng: random.Random | None = None) -> Decision:
    if not workers:
        raise ValueError("no workers to route to")
    candidates = sorted(evaluate(indexer, hashes, workers, loads, weights),
                        key=lambda c: (c.cost, c.worker))
    pick = candidates[0]
    if weights.temperature > 0:
        rng = rng or random.Random(0)
        low = pick.cost
        scale = max(1.0, len(hashes)) * weights.temperature
        probs = [math.exp(-(c.cost - low) / scale) for c in candidates]
        pick = rng.choices(candidates, weights=probs)[0]
    hint = pick.source if pick.fetch >= weights.min_fetch_blocks else None
    return Decision(pick.worker, tuple(candidates), hint,
                    (pick.local, pick.local + (pick.fetch if hint else 0)))
