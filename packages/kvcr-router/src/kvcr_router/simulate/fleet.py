"""The modelled fleet: what a worker holds, what a request costs it, and its queue.

Each worker has:
- a device tier (the engine's prefix cache) and a pool tier (the node's kvcr pool), both
  LRU with a capacity in blocks; a finished prefill writes its prompt blocks through to both
  (kvcr offloads what the engine computed), so with pool >= device the pool holds a superset;
- one prefill lane, first come first served: a request holds the lane for its pool loads, its
  peer fetch and the prefill of the blocks nobody had (conservative for fetching: a real
  engine can schedule other work while KV arrives);
- a decode batch without a size limit: after its prefill a request decodes for
  `output_tokens * decode_ms_per_token` beside the others; each decoding request slows the
  lane's prefills by `decode_interference` (the batch shares the engine's steps).
A request's blocks are taken, in prompt order, from the device, else the worker's own pool,
else (within the router's hint) from the named peer's pool; the first block found nowhere
ends reuse and everything from there is prefilled (a prefix cache cannot skip a hole). A peer
serves fetches from its pool without cost to its own lane. Tier changes are reported as
inventory batches (stored, removed), as runners do. Single-threaded; pure bookkeeping.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, deque
from collections.abc import Sequence

from kvcr_core.errors import ConfigError
from kvcr_router.cost import WorkerLoad

# Per-block costs and capacities below are for 16-token blocks (vLLM's default); `scaled`
# keeps the physical meaning (bytes moved, tokens held) for other block sizes.
REFERENCE_BLOCK_TOKENS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class FleetConfig:
    workers: int = 16
    block_tokens: int = REFERENCE_BLOCK_TOKENS
    device_blocks: int = 4096  # 64k tokens of engine cache per worker
    pool_blocks: int = 16384  # 256k tokens of node pool per worker (0: no pool tier)
    prefill_ms_per_token: float = 0.1  # ~10k tokens/s: an 8B model on one H100-class GPU
    prefill_overhead_ms: float = 5.0  # per request: scheduling and the first decode step
    pool_load_ms_per_block: float = 0.1  # host to GPU, ~2 MiB block at ~20 GB/s
    fetch_ms_per_block: float = 0.4  # peer pool to pool, ~2 MiB block at ~5 GB/s
    fetch_setup_ms: float = 2.0  # per fetch: the hint round trip and the peer's lookup
    decode_ms_per_token: float = 20.0
    decode_interference: float = 0.01  # prefill slowdown per request in the decode batch

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or (
                    not math.isfinite(value)) or value < 0:
                raise ConfigError(field.name, value, "give a finite number >= 0")
        for name in ("workers", "block_tokens", "device_blocks", "pool_blocks"):
            if not isinstance(getattr(self, name), int):
                raise ConfigError(name, getattr(self, name), "give an integer")
        for name in ("workers", "block_tokens", "device_blocks"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "give an integer >= 1")

    @classmethod
    def scaled(cls, block_tokens: int) -> FleetConfig:
        """The defaults for another block size: same tokens held, same bytes per second."""
        ratio = block_tokens / REFERENCE_BLOCK_TOKENS
        base = cls()
        return cls(block_tokens=block_tokens,
                   device_blocks=max(1, round(base.device_blocks / ratio)),
                   pool_blocks=round(base.pool_blocks / ratio),
                   pool_load_ms_per_block=base.pool_load_ms_per_block * ratio,
                   fetch_ms_per_block=base.fetch_ms_per_block * ratio)

    def names(self) -> list[str]:
        return [f"w{i:02d}" for i in range(self.workers)]


class LRUTier:
    """A set of block hashes with a capacity; inserting past it evicts the least recent."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def touch(self, blocks: Sequence[int]) -> None:
        for h in blocks:
            if h in self._blocks:
                self._blocks.move_to_end(h)

    def store(self, blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Inserts (or refreshes) `blocks`; returns (newly stored, evicted)."""
        if self.capacity_blocks == 0:
            return [], []
        held = self._blocks
        stored = []
        for h in blocks:
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
                stored.append(h)
        evicted = []
        while len(held) > self.capacity_blocks:
            evicted.append(held.popitem(last=False)[0])
        return stored, evicted


@dataclasses.dataclass
class Job:
    """One request on its worker, from admission to the end of its decode."""

    index: int  # the request's position in the replayed stream
    arrival_ms: float
    hashes: tuple[int, ...]
    input_tokens: int
    output_tokens: int
    hint_source: str | None = None
    hint_range: tuple[int, int] = (0, 0)
    load_blocks: int = 0  # what the job adds to its worker's potential decode blocks


@dataclasses.dataclass(frozen=True)
class Coverage:
    """Where a started request's prompt blocks came from."""

    device_blocks: int
    pool_blocks: int
    fetched_blocks: int

    @property
    def reused_blocks(self) -> int:
        return self.device_blocks + self.pool_blocks + self.fetched_blocks


class SimWorker:
    def __init__(self, name: str, config: FleetConfig) -> None:
        self.name = name
        self.config = config
        self.device = LRUTier(config.device_blocks)
        self.pool = LRUTier(config.pool_blocks)
        self.queue: deque[Job] = deque()
        self.busy = False
        self.decoding = 0
        self.load_blocks = 0  # potential decode blocks of every admitted, unfinished job
        self.active = 0
        self.requests = 0
        self.busy_ms = 0.0

    def load(self) -> WorkerLoad:
        return WorkerLoad(decode_blocks=self.load_blocks, active_requests=self.active)

    def admit(self, job: Job) -> None:
        job.load_blocks = -(-(job.input_tokens + job.output_tokens) // self.config.block_tokens)
        self.load_blocks += job.load_blocks
        self.active += 1
        self.requests += 1
        self.queue.append(job)

    def cover(self, job: Job, source: SimWorker | None) -> Coverage:
        """Where each prompt block comes from if `job` starts now (see the module doc)."""
        device = pool = fetched = 0
        start, end = job.hint_range
        for i, h in enumerate(job.hashes):
            if h in self.device:
                device += 1
            elif h in self.pool:
                pool += 1
            elif source is not None and start <= i < end and h in source.pool:
                fetched += 1
            else:
                break
        if source is not None and fetched:
            first = device + pool
            source.pool.touch(job.hashes[first:first + fetched])
        return Coverage(device, pool, fetched)

    def prefill_ms(self, job: Job, coverage: Coverage) -> float:
        c = self.config
        tokens = max(0, job.input_tokens - coverage.reused_blocks * c.block_tokens)
        fetch_ms = c.fetch_setup_ms + c.fetch_ms_per_block * coverage.fetched_blocks if (
            coverage.fetched_blocks) else 0.0
        compute_ms = (c.prefill_overhead_ms + c.prefill_ms_per_token * tokens) * (
            1 + c.decode_interference * self.decoding)
        return c.pool_load_ms_per_block * coverage.pool_blocks + fetch_ms + compute_ms

    def finish(self, job: Job) -> None:
        self.load_blocks -= job.load_blocks
        self.active -= 1
