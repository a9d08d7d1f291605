"""Daemon collectors (`kvcr_guard_*`), in the same injected registry as the Runner's.

Labels are bounded enums: close reasons and reclaim kinds. Thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvcr_core.guard_client.protocol import CloseReason


class GuardMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.attaches = Counter("kvcr_guard_attaches_total", "Clients attached (Hello accepted)",
                                registry=registry)
        self.clients = Gauge("kvcr_guard_clients", "Clients attached now", registry=registry)
        self.closed = Counter("kvcr_guard_connections_closed_total",
                              "Connections closed, by reason", ["reason"], registry=registry)
        self.requests = Counter("kvcr_guard_requests_total", "Request frames served",
                                registry=registry)
        self.ops = Counter("kvcr_guard_operations_total", "Operations served (inside requests)",
                           registry=registry)
        self.reclaimed_blocks = Counter(
            "kvcr_guard_reclaimed_blocks_total",
            "FILLING blocks of departed clients aborted (never published)", registry=registry)
        self.reclaimed_leases = Counter(
            "kvcr_guard_reclaimed_leases_total", "Leases of departed clients released",
            registry=registry)
        self.request_seconds = Histogram(
            "kvcr_guard_request_seconds", "Time to serve one request frame",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 2.5e-2),
            registry=registry)
        self._closed = {r: self.closed.labels(reason=r.value) for r in CloseReason}

    def connection_closed(self, reason: CloseReason) -> None:
        self._closed[reason].inc()
