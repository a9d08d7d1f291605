"""Synthetic request streams for the router simulator: what a request is and how to make many.

A `SimRequest` is what the router sees of a request, as in a Mooncake trace: an arrival time,
a prompt length, an output length and one router hash per full prompt block. Hashes form
prefix chains: two prompts share block i's hash exactly when they share the whole prefix up to
and including block i, so shared system prompts and earlier conversation turns share ids.

Three shapes (`WorkloadKind`), each deterministic for a seed:
- multi-turn: one tenant, one shared system prompt; conversations whose turn k+1 prompt is
  turn k's prompt + its answer + a new user message, after a think time.
- multi-tenant: many tenants with their own long system prompt, Zipf-popular, each request
  = the tenant's system prompt + a fresh user message; Poisson arrivals.
- bursty: the multi-tenant prompts, but arriving in bursts of one tenant (a batch job or an
  agent fan-out) on top of a quiet background.
Pure functions; no I/O (traces on disk: `trace.py`).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import random
from collections.abc import Callable, Iterator

from kvcr_core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SimRequest:
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    hashes: tuple[int, ...]  # one router hash per full prompt block, a prefix chain


class WorkloadKind(enum.Enum):
    MULTI_TURN = "multi-turn"
    MULTI_TENANT = "multi-tenant"
    BURSTY = "bursty"


# Open loop: the next turn is sent this long per answer token after the previous one (plus
# the think time), whatever the simulated fleet does; a typical decode pace.
ANSWER_MS_PER_TOKEN = 20.0

TokenRange = tuple[int, int]  # inclusive bounds of a uniform draw


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    kind: WorkloadKind = WorkloadKind.MULTI_TENANT
    requests: int = 4000
    rate_per_s: float = 40.0  # mean arrivals per second, whole fleet
    tenants: int = 128  # multi-tenant and bursty; multi-turn has one
    zipf_s: float = 0.8  # tenant popularity skew
    system_tokens: TokenRange = (2048, 8192)
    user_tokens: TokenRange = (128, 1024)
    output_tokens: TokenRange = (64, 512)
    turns: TokenRange = (2, 10)  # multi-turn: turns per conversation
    think_s: float = 8.0  # multi-turn: mean pause between a turn's answer and the next turn
    burst_requests: TokenRange = (8, 48)  # bursty: requests per burst
    burst_window_s: float = 2.0  # bursty: a burst's requests arrive within this window
    background_share: float = 0.25  # bursty: share of requests outside bursts
    block_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, WorkloadKind):
            raise ConfigError("kind", self.kind, f"one of {[k.value for k in WorkloadKind]}")
        for name in ("requests", "tenants", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, value, "give an integer >= 1")
        for name in ("rate_per_s", "think_s", "burst_window_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(name, value, "give a finite number > 0")
        if not (math.isfinite(self.zipf_s) and self.zipf_s >= 0):
            raise ConfigError("zipf_s", self.zipf_s, "give a finite number >= 0")
        if not 0 <= self.background_share < 1:
            raise ConfigError("background_share", self.background_share, "give 0 <= share < 1")
        for name in ("system_tokens", "user_tokens", "output_tokens", "turns",
                     "burst_requests"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise ConfigError(name, (low, high), "give bounds with 0 < low <= high")


def generate(config: WorkloadConfig) -> list[SimRequest]:
    """The workload's requests in arrival order (exactly `config.requests` of them)."""
    maker: Callable[[WorkloadConfig, random.Random, Iterator[int]], list[SimRequest]] = {
        WorkloadKind.MULTI_TURN: _multi_turn,
        WorkloadKind.MULTI_TENANT: _multi_tenant,
        WorkloadKind.BURSTY: _bursty,
    }[config.kind]
    requests = maker(config, random.Random(config.seed), itertools.count(1))
    requests.sort(key=lambda r: r.arrival_ms)
    return requests[:config.requests]


def _draw(rng: random.Random, bounds: TokenRange) -> int:
    return rng.randint(*bounds)


def _extend(prefix: tuple[int, ...], prompt_tokens: int, block_tokens: int,
            ids: Iterator[int]) -> tuple[int, ...]:
    """`prefix` (the shared full blocks) + fresh ids up to the prompt's full blocks."""
    fresh = prompt_tokens // block_tokens - len(prefix)
    return prefix + tuple(itertools.islice(ids, max(0, fresh)))


def _system_prompts(config: WorkloadConfig, rng: random.Random,
                    ids: Iterator[int], count: int) -> list[tuple[int, tuple[int, ...]]]:
    out = []
    for _ in range(count):
        tokens = _draw(rng, config.system_tokens)
        out.append((tokens, _extend((), tokens, config.block_tokens, ids)))
    return out


def _multi_turn(config: WorkloadConfig, rng: random.Random,
                ids: Iterator[int]) -> list[SimRequest]:
    ((system_tokens, system),) = _system_prompts(config, rng, ids, 1)
    mean_turns = sum(config.turns) / 2
    session_rate_per_ms = config.rate_per_s / mean_turns / 1000
    out: list[SimRequest] = []
    start_ms = 0.0
    # Sessions start in time order and only add requests after their start: once enough
    # requests precede the latest start, no later session can come before the cut.
    while sum(r.arrival_ms < start_ms for r in out) < config.requests:
        for _ in range(64):
            start_ms += rng.expovariate(session_rate_per_ms)
            out.extend(_conversation(config, rng, ids, start_ms, system_tokens, system))
    return out


def _conversation(config: WorkloadConfig, rng: random.Random, ids: Iterator[int],
                  start_ms: float, tokens: int, hashes: tuple[int, ...]) -> list[SimRequest]:
    out, at_ms = [], start_ms
    for _ in range(_draw(rng, config.turns)):
        tokens += _draw(rng, config.user_tokens)
        hashes = _extend(hashes, tokens, config.block_tokens, ids)
        output = _draw(rng, config.output_tokens)
        out.append(SimRequest(at_ms, tokens, output, hashes))
        hashes = hashes[:tokens // config.block_tokens]
        tokens += output  # the answer becomes part of the next turn's prompt
        at_ms += output * ANSWER_MS_PER_TOKEN + rng.expovariate(1 / (config.think_s * 1000))
    return out


def _zipf_picker(config: WorkloadConfig, rng: random.Random) -> Callable[[], int]:
    cumulative = list(itertools.accumulate(
        1 / (rank ** config.zipf_s) for rank in range(1, config.tenants + 1)))
    order = list(range(config.tenants))
    rng.shuffle(order)  # popularity is not tied to the order prompts were drawn in
    return lambda: order[rng.choices(range(config.tenants), cum_weights=cumulative)[0]]


def _tenant_request(config: WorkloadConfig, rng: random.Random, ids: Iterator[int],
                    prompt: tuple[int, tuple[int, ...]], at_ms: float) -> SimRequest:
    system_tokens, system = prompt
    tokens = system_tokens + _draw(rng, config.user_tokens)
    return SimRequest(at_ms, tokens, _draw(rng, config.output_tokens),
                      _extend(system, tokens, config.block_tokens, ids))


def _multi_tenant(config: WorkloadConfig, rng: random.Random,
                  ids: Iterator[int]) -> list[SimRequest]:
    prompts = _system_prompts(config, rng, ids, config.tenants)
    pick = _zipf_picker(config, rng)
    rate_per_ms = config.rate_per_s / 1000
    out, at_ms = [], 0.0
    for _ in range(config.requests):
        at_ms += rng.expovariate(rate_per_ms)
        out.append(_tenant_request(config, rng, ids, prompts[pick()], at_ms))
    return out


def _bursty(config: WorkloadConfig, rng: random.Random, ids: Iterator[int]) -> list[SimRequest]:
    prompts = _system_prompts(config, rng, ids, config.tenants)
    pick = _zipf_picker(config, rng)
    background = round(config.requests * config.background_share)
    span_ms = config.requests / config.rate_per_s * 1000
    out, at_ms = [], 0.0
    for _ in range(background):
        at_ms += rng.expovariate(background / span_ms)
        out.append(_tenant_request(config, rng, ids, prompts[pick()], at_ms))
    bursts: list[SimRequest] = []
    mean_burst = sum(config.burst_requests) / 2
    burst_rate_per_ms = (config.requests - background) / mean_burst / span_ms
    start_ms = 0.0
    while len(bursts) < config.requests - background:
        start_ms += rng.expovariate(burst_rate_per_ms)
        prompt = prompts[pick()]
        for _ in range(_draw(rng, config.burst_requests)):
            at_ms = start_ms + rng.uniform(0, config.burst_window_s * 1000)
            bursts.append(_tenant_request(config, rng, ids, prompt, at_ms))
    return out + bursts[:config.requests - background]


# The bench's workloads, per worker of the fleet (arrival rates scale with the fleet size).
# Rates put the reference router's busiest prefill lanes at roughly half to two-thirds load.
_PRESETS: dict[WorkloadKind, tuple[float, WorkloadConfig]] = {
    WorkloadKind.MULTI_TURN: (2.0, WorkloadConfig(kind=WorkloadKind.MULTI_TURN,
                                                  system_tokens=(1024, 2048))),
    WorkloadKind.MULTI_TENANT: (2.5, WorkloadConfig(kind=WorkloadKind.MULTI_TENANT)),
    WorkloadKind.BURSTY: (2.5, WorkloadConfig(kind=WorkloadKind.BURSTY)),
}


def preset(kind: WorkloadKind, *, workers: int, requests: int, seed: int,
           rate_per_worker_s: float | None = None, tenants: int | None = None) -> WorkloadConfig:
    """The bench's shape of `kind` for a fleet of `workers`, with the run's own size and seed."""
    rate, base = _PRESETS[kind]
    return dataclasses.replace(base, requests=requests, seed=seed,
                               rate_per_s=(rate_per_worker_s or rate) * workers,
                               tenants=tenants or base.tenants)
