"""The router's Prometheus metrics, registered into an injected registry (never the global one).

Names follow `kvcr_router_<quantity>_<unit>`; counters end in `_total`. Labels are bounded:
`worker` is an operator-chosen name from the config (at most 256), the others are the enums
below. A request costs a few microseconds here, noise next to the HTTP hop.
Thread-safe (prometheus-client locks each child).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvcr_router.bodies import BODY_REFUSALS
from kvcr_router.hinting import HINT_FIELDS, field_label
from kvcr_router.tokenizing import UNHASHED_REASONS

ROUTES = ("completions", "chat")
REQUEST_OUTCOMES = ("ok", "bad_request", "no_worker", "upstream_error", "client_gone")
# emitted: a hint went out; none: no peer holds more than the chosen worker; below_crossover:
# a peer does, but by fewer than min_fetch_blocks; no_endpoint: the source has no peer
# endpoint configured; unhashed: the prompt could not be tokenized (routed on load alone).
HINT_OUTCOMES = ("emitted", "none", "below_crossover", "no_endpoint", "unhashed")
# Why a request's prompt was not hashed: tokenizing.UNHASHED_REASONS (docs/router.md).
UPSTREAM_FAILURES = ("connect", "timeout", "broken")
FEED_KINDS = ("inventory", "kv_events")
LEAD_BUCKETS_BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
DECISION_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, workers: list[str]) -> None:
        self.requests = Counter("kvcr_router_requests_total", "Requests by route and outcome",
                                ["route", "outcome"], registry=registry)
        self.decisions = Counter("kvcr_router_decisions_total", "Routing decisions per worker",
                                 ["worker"], registry=registry)
        self.hints = Counter("kvcr_router_hints_total",
                             "Per decision: whether a KV hint was attached, and why not",
                             ["outcome"], registry=registry)
        self.hint_lead = Histogram(
            "kvcr_router_hint_lead_blocks",
            "Blocks the chosen source holds beyond the chosen worker's prefix (emitted hints)",
            buckets=LEAD_BUCKETS_BLOCKS, registry=registry)
        self.decision_seconds = Histogram(
            "kvcr_router_decision_seconds", "Tokenize, hash and choose, per request",
            buckets=DECISION_BUCKETS_S, registry=registry)
        self.stripped = Counter("kvcr_router_client_hints_stripped_total",
                                "Client-supplied KV hints and transfer params removed before "
                                "forwarding", ["field"], registry=registry)
        self.unhashed = Counter("kvcr_router_unhashed_total",
                                "Requests routed on load alone because their prompt was not "
                                "hashed, by reason", ["reason"], registry=registry)
        self.bodies_refused = Counter("kvcr_router_bodies_refused_total",
                                      "Request bodies refused before routing, by reason: "
                                      "too_large (413), deadline (408), bad_json (400), busy "
                                      "(503)", ["reason"], registry=registry)
        self.healthy = Gauge("kvcr_router_worker_healthy", "1 if the worker passes health checks",
                             ["worker"], registry=registry)
        self.active = Gauge("kvcr_router_worker_active_requests",
                            "Requests this router has in flight at the worker", ["worker"],
                            registry=registry)
        self.upstream_failures = Counter("kvcr_router_upstream_failures_total",
                                         "Forwarding failures by worker and kind",
                                         ["worker", "reason"], registry=registry)
        self.feed_polls = Counter("kvcr_router_feed_polls_total",
                                  "Block feed reads (runner inventory, vLLM KV events)",
                                  ["worker", "feed", "outcome"], registry=registry)
        self.feed_blocks = Counter("kvcr_router_feed_blocks_total",
                                   "Block events applied to the index",
                                   ["worker", "feed", "event"], registry=registry)
        for route in ROUTES:
            for outcome in REQUEST_OUTCOMES:
                self.requests.labels(route, outcome)
        for outcome in HINT_OUTCOMES:
            self.hints.labels(outcome)
        for container, key in HINT_FIELDS:
            self.stripped.labels(field_label(container, key))
        for reason in UNHASHED_REASONS:
            self.unhashed.labels(reason)
        for reason in BODY_REFUSALS:
            self.bodies_refused.labels(reason)
        for worker in workers:
            self.decisions.labels(worker)
            self.healthy.labels(worker).set(0)
            self.active.labels(worker).set(0)
