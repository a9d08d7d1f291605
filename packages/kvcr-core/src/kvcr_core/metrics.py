"""Prometheus collectors of a Runner, registered into an injected registry.

Names follow `kvcr_<subsystem>_<quantity>_<unit>`; counters end in `_total`. Labels are bounded
enums (operation names, hint outcomes, resources), never keys, request ids or endpoints.
Nothing registers on prometheus' global REGISTRY unless the caller passes it.
Thread-safe (prometheus-client collectors lock internally).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvcr_core.errors import HintRejectReason
from kvcr_core.hints import HINT_ACCEPTED

# Bucket edges in seconds, from 1 us (index ops) to 1 s (a slow batched copy).
_OP_BUCKETS_S = (1e-6, 5e-6, 2e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 2e-2, 0.1, 1.0)


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


HINT_OUTCOMES = (HINT_ACCEPTED, *(r.value for r in HintRejectReason))


class RunnerMetrics:
    """All collectors of one Runner. Create one per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.lookups = Counter("kvcr_lookups_total", "Lookup calls", registry=registry)
        self.lookup_hit_blocks = Counter(
            "kvcr_lookup_hit_blocks_total", "Blocks found READY by lookups", registry=registry)
        self.lookup_miss_blocks = Counter(
            "kvcr_lookup_miss_blocks_total", "Blocks asked for but not READY", registry=registry)
        self.blocks_stored = Counter(
            "kvcr_blocks_stored_total", "Blocks committed READY", registry=registry)
        self.bytes_stored = Counter(
            "kvcr_stored_bytes_total", "Bytes of blocks committed READY", registry=registry)
        self.blocks_loaded = Counter(
            "kvcr_blocks_loaded_total", "Blocks leased for reading", registry=registry)
        self.bytes_loaded = Counter(
            "kvcr_loaded_bytes_total", "Bytes of blocks leased for reading", registry=registry)
        self.blocks_aborted = Counter(
            "kvcr_blocks_aborted_total", "Reserved blocks abandoned before commit",
            registry=registry)
        self.evictions = Counter(
            "kvcr_evictions_total", "READY blocks evicted to make room", registry=registry)
        self.capacity_refusals = Counter(
            "kvcr_capacity_refusals_total", "Requests refused because a bound was reached",
            ["resource"], registry=registry)
        self.hints = Counter(
            "kvcr_hints_total", "KV hints by outcome (accepted or rejection reason)",
            ["outcome"], registry=registry)
        self.op_seconds = Histogram(
            "kvcr_index_operation_seconds", "Latency of index operations (whole batch)",
            ["op"], buckets=_OP_BUCKETS_S, registry=registry)
        self.pool_used_bytes = Gauge(
            "kvcr_pool_used_bytes", "Bytes of pool slots in use (FILLING or READY)",
            registry=registry)
        self.pool_capacity_bytes = Gauge(
            "kvcr_pool_capacity_bytes", "Bytes of pool slots in all namespaces", registry=registry)
        for outcome in HINT_OUTCOMES:
            self.hints.labels(outcome=outcome)
        for resource in CapacityResource:
            self.capacity_refusals.labels(resource=resource.value)
        self._op_children = {op: self.op_seconds.labels(op=op.value) for op in IndexOp}
        self._refusal_children = {
            r: self.capacity_refusals.labels(resource=r.value) for r in CapacityResource}

    def observe_op(self, op: IndexOp, seconds: float) -> None:
        self._op_children[op].observe(seconds)

    def refused(self, resource: CapacityResource, amount: int = 1) -> None:
        self._refusal_children[resource].inc(amount)

    def hint_outcome(self, outcome: str) -> None:
        self.hints.labels(outcome=outcome).inc()

    def bind_pool_gauges(self, used: Callable[[], float], capacity: Callable[[], float]) -> None:
        """Gauges read live from the runner at scrape time (no bookkeeping on hot paths)."""
        self.pool_used_bytes.set_function(used)
        self.pool_capacity_bytes.set_function(capacity)
