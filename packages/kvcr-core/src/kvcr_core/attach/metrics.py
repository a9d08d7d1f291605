"""Attach server collectors (`kvcr_guard_*`: named for kvcr-guard, which exports them), in
the same injected registry as the Runner's.

Hot-path cheap like the Runner's (kvcr_core.metrics.LightMetrics): plain ints under one
lock, families built at scrape. Labels are bounded enums (close reasons). Thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from kvcr_core.attach.protocol import CloseReason
from kvcr_core.metrics import LightHistogram, LightMetrics

_REQUEST_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 2.5e-2)


class AttachMetrics(LightMetrics):
    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.attaches = self.clients = self.pending = self.requests = self.ops = 0
        self.reclaimed_blocks = self.reclaimed_leases = self.namespaces_released = 0
        self.accept_errors = self.over_budget = 0
        self.closed = {r.value: 0 for r in CloseReason}
        self.request_seconds = LightHistogram(_REQUEST_BUCKETS_S)
        self.register()

    def on_attach(self) -> None:
        with self.lock:
            self.attaches += 1

    def on_request(self, seconds: float, ops: int, over_budget: int = 0) -> None:
        with self.lock:
            self.requests += 1
            self.ops += ops
            self.over_budget += over_budget
            self.request_seconds.observe(seconds)

    def on_reclaim(self, blocks: int, leases: int) -> None:
        with self.lock:
            self.reclaimed_blocks += blocks
            self.reclaimed_leases += leases

    def connection_closed(self, reason: CloseReason) -> None:
        with self.lock:
            self.closed[reason.value] += 1

    def set_connections(self, attached: int, pending: int) -> None:
        with self.lock:
            self.clients, self.pending = attached, pending

    def on_accept_error(self) -> None:
        with self.lock:
            self.accept_errors += 1

    def on_namespace_released(self) -> None:
        with self.lock:
            self.namespaces_released += 1

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            c = self.counter
            yield c("kvcr_guard_attaches_total", "Clients attached (Hello accepted)",
                    self.attaches)
            yield GaugeMetricFamily("kvcr_guard_clients", "Clients attached now",
                                    value=self.clients)
            yield GaugeMetricFamily("kvcr_guard_pending_connections",
                                    "Connections that have not attached (no Hello yet)",
                                    value=self.pending)
            yield c("kvcr_guard_accept_errors_total",
                    "Connections the listener could not accept (e.g. out of descriptors)",
                    self.accept_errors)
            yield c("kvcr_guard_over_budget_total",
                    "Keys, slots or hints refused because one request asked for more than a "
                    "request may (clients split large operations)", self.over_budget)
            yield c("kvcr_guard_namespaces_released_total",
                    "Namespaces nobody used for namespace_idle_s, their memory given back",
                    self.namespaces_released)
            yield self.labelled("kvcr_guard_connections_closed_total",
                                "Connections closed, by reason", "reason", dict(self.closed))
            yield c("kvcr_guard_requests_total", "Request frames served", self.requests)
            yield c("kvcr_guard_operations_total", "Operations served (inside requests)",
                    self.ops)
            yield c("kvcr_guard_reclaimed_blocks_total",
                    "FILLING blocks of departed clients aborted (never published)",
                    self.reclaimed_blocks)
            yield c("kvcr_guard_reclaimed_leases_total", "Leases of departed clients released",
                    self.reclaimed_leases)
            yield self.histograms("kvcr_guard_request_seconds", "Time to serve one request frame",
                                  "kind", {"request": self.request_seconds})
