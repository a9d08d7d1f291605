"""Prometheus metrics of a Runner, cheap enough for the hot path, in an injected registry.

prometheus-client's own Counter.inc costs ~1.2 us and Histogram.observe ~2.3 us here (a lock
and label lookups each), which would be a third of a guard round trip. So the hot path only
bumps plain ints under one lock per call (`LightMetrics`), and a custom collector turns them
into metric families at scrape time. Names follow `kvcr_<subsystem>_<quantity>_<unit>`,
counters end in `_total`, labels are bounded enums (never keys, request ids or endpoints).
Nothing registers on prometheus' global REGISTRY unless the caller passes it.

Threading: every recording method is thread-safe; scrapes read a consistent snapshot.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvcr_core.hints import HINT_OUTCOMES

if TYPE_CHECKING:
    from kvcr_core.hintboard import HintBoard

# Bucket edges in seconds, from 1 us (index ops) to 1 s (a slow batched copy).
OP_BUCKETS_S = (1e-6, 5e-6, 2e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 2e-2, 0.1, 1.0)


class IndexOp(enum.Enum):
    LOOKUP = "lookup"
    RESERVE = "reserve"
    COMMIT = "commit"
    ABORT = "abort"
    ACQUIRE = "acquire"
    RELEASE = "release"


class CapacityResource(enum.Enum):
    SLOTS = "slots"
    RESERVATIONS = "reservations"
    LEASES = "leases"




class LightHistogram:
    """Bucket counts and a sum; observed under the owner's lock."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


class LightMetrics(Collector):
    """Base of kvcr's collectors: counters are int fields, one lock, families at scrape."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lock = threading.Lock()
        self.registry = registry

    def register(self) -> None:
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:  # pragma: no cover - overridden
        return iter(())

    @staticmethod
    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(name.removesuffix("_total"), doc, value=value)

    @staticmethod
    def labelled(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
        family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=[label])
        for key, value in values.items():
            family.add_metric([key], value)
        return family

    @staticmethod
    def histograms(name: str, doc: str, label: str,
                   values: dict[str, LightHistogram]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=[label])
        for key, hist in values.items():
            family.add_metric([key], hist.cumulative(), hist.sum)
        return family


@dataclasses.dataclass(frozen=True)
class NamespaceUsage:
    """One namespace's pool at scrape time; `namespace` is the first 16 hex digits of its
    digest (`kvcr status` shows the rest: model, block size...)."""

    namespace: str
    used_bytes: int
    capacity_bytes: int
    evictions: int


class RunnerMetrics(LightMetrics):
    """All `kvcr_*` collectors of one Runner. Create one per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.lookups = self.lookup_hit_blocks = self.lookup_miss_blocks = 0
        self.blocks_stored = self.bytes_stored = self.blocks_loaded = self.bytes_loaded = 0
        self.blocks_aborted = 0
        self.blocks_holed = 0
        self.refusals = {r.value: 0 for r in CapacityResource}
        self.hints = dict.fromkeys(HINT_OUTCOMES, 0)
        self.op_seconds = {op.value: LightHistogram(OP_BUCKETS_S) for op in IndexOp}
        self._namespaces: Callable[[], list[NamespaceUsage]] = list
        self._board: HintBoard | None = None
        self.register()

    # -- recording (hot path: one lock, plain ints) -------------------------------------------

    def on_lookup(self, seconds: float, hit: int, miss: int) -> None:
        with self.lock:
            self.op_seconds["lookup"].observe(seconds)
            self.lookups += 1
            self.lookup_hit_blocks += hit
            self.lookup_miss_blocks += miss

    def on_reserve(self, seconds: float, refused: int, resource: CapacityResource) -> None:
        with self.lock:
            self.op_seconds["reserve"].observe(seconds)
            if refused:
                self.refusals[resource.value] += refused

    def on_commit(self, seconds: float, blocks: int, block_bytes: int) -> None:
        with self.lock:
            self.op_seconds["commit"].observe(seconds)
            self.blocks_stored += blocks
            self.bytes_stored += blocks * block_bytes

    def on_abort(self, seconds: float, blocks: int) -> None:
        with self.lock:
            self.op_seconds["abort"].observe(seconds)
            self.blocks_aborted += blocks

    def on_acquire(self, seconds: float, blocks: int, block_bytes: int, refused: bool) -> None:
        with self.lock:
            self.op_seconds["acquire"].observe(seconds)
            self.blocks_loaded += blocks
            self.bytes_loaded += blocks * block_bytes
            if refused:
                self.refusals[CapacityResource.LEASES.value] += 1

    def on_release(self, seconds: float) -> None:
        with self.lock:
            self.op_seconds["release"].observe(seconds)

    def on_holed(self, blocks: int) -> None:
        with self.lock:
            self.blocks_holed += blocks

    def on_reclaimed(self, blocks: int) -> None:
        with self.lock:
            self.blocks_aborted += blocks

    def refused(self, resource: CapacityResource, amount: int = 1) -> None:
        with self.lock:
            self.refusals[resource.value] += amount

    def hint_outcome(self, outcome: str) -> None:
        with self.lock:
            if outcome in self.hints:
                self.hints[outcome] += 1

    def bind_pool_gauges(self, namespaces: Callable[[], list[NamespaceUsage]]) -> None:
        """Per-namespace pool figures, read live from the runner at scrape time (no
        bookkeeping on hot paths)."""
        self._namespaces = namespaces

    def _namespace_families(self) -> Iterator[Metric]:
        label = ["namespace"]
        used = GaugeMetricFamily("kvcr_pool_used_bytes",
                                 "Bytes of pool slots in use (FILLING or READY), per namespace",
                                 labels=label)
        capacity = GaugeMetricFamily("kvcr_pool_capacity_bytes",
                                     "Bytes of pool slots, per namespace", labels=label)
        evictions = CounterMetricFamily("kvcr_evictions", "READY blocks evicted to make room, "
                                        "per namespace", labels=label)
        for usage in self._namespaces():
            used.add_metric([usage.namespace], usage.used_bytes)
            capacity.add_metric([usage.namespace], usage.capacity_bytes)
            evictions.add_metric([usage.namespace], usage.evictions)
        yield used
        yield capacity
        yield evictions

    def bind_hint_board(self, board: HintBoard) -> None:
        self._board = board

    # -- scrape ------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            c = self.counter
            yield c("kvcr_lookups_total", "Lookup calls", self.lookups)
            yield c("kvcr_lookup_hit_blocks_total", "Blocks found READY by lookups",
                    self.lookup_hit_blocks)
            yield c("kvcr_lookup_miss_blocks_total", "Blocks asked for but not READY",
                    self.lookup_miss_blocks)
            yield c("kvcr_blocks_stored_total", "Blocks committed READY", self.blocks_stored)
            yield c("kvcr_stored_bytes_total", "Bytes of blocks committed READY",
                    self.bytes_stored)
            yield c("kvcr_blocks_loaded_total", "Blocks leased for reading", self.blocks_loaded)
            yield c("kvcr_loaded_bytes_total", "Bytes of blocks leased for reading",
                    self.bytes_loaded)
            yield c("kvcr_blocks_aborted_total", "Reserved blocks abandoned before commit",
                    self.blocks_aborted)
            yield c("kvcr_holed_blocks_total", "READY blocks dropped because pages of their "
                    "slot were punched out of the pool memfd", self.blocks_holed)
            yield self.labelled("kvcr_capacity_refusals_total",
                                "Requests refused because a bound was reached", "resource",
                                dict(self.refusals))
            yield self.labelled("kvcr_hints_total",
                                "KV hints by outcome (accepted or rejection reason)", "outcome",
                                dict(self.hints))
            yield self.histograms("kvcr_index_operation_seconds",
                                  "Latency of index operations (whole batch)", "op",
                                  self.op_seconds)
        yield from self._namespace_families()
        board = self._board
        if board is not None:
            yield GaugeMetricFamily("kvcr_hint_board_hashes",
                                    "Block hashes of posted hints the board remembers",
                                    value=len(board))
            yield self.counter("kvcr_hint_board_posted_hashes_total",
                               "Block hashes taken from posted hints", board.posted_hashes)
            yield self.counter("kvcr_hint_board_matched_hashes_total",
                               "Missed blocks an engine found a posted hint for",
                               board.matched_hashes)
            yield self.counter("kvcr_hint_board_evicted_endpoints_total",
                               "Source endpoints dropped from the hint board to make room "
                               "(a poster past its share, or the table full)",
                               board.evicted_endpoints)
