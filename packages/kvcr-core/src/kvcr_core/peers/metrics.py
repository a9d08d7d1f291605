"""`kvcr_peer_*` and `kvcr_pull_*` collectors (one set per Runner registry), hot-path cheap
like the Runner's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvcr_core.metrics import LightMetrics
from kvcr_core.peers.protocol import PeerRefusal, TransportKind
from kvcr_core.types import FetchStatus


class PeerMetrics(LightMetrics):
    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.fetched = {s.value: 0 for s in FetchStatus}
        self.fetched_bytes = self.served_blocks = self.served_bytes = self.accept_errors = 0
        self.refused = {r.value: 0 for r in PeerRefusal}
        # production transports from the start; the loopback of tests once it is used
        self.connections = {t.value: 0 for t in (TransportKind.TCP, TransportKind.NIXL)}
        self.register()

    def on_fetch(self, counts: dict[FetchStatus, int], received_bytes: int) -> None:
        with self.lock:
            for status, n in counts.items():
                self.fetched[status.value] += n
            self.fetched_bytes += received_bytes

    def on_served(self, blocks: int, sent_bytes: int) -> None:
        with self.lock:
            self.served_blocks += blocks
            self.served_bytes += sent_bytes

    def on_connection(self, transport: TransportKind) -> None:
        with self.lock:
            self.connections[transport.value] = self.connections.get(transport.value, 0) + 1

    def on_accept_error(self) -> None:
        with self.lock:
            self.accept_errors += 1

    def on_refused(self, reason: PeerRefusal) -> None:
        with self.lock:
            self.refused[reason.value] += 1

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            yield self.labelled("kvcr_peer_fetched_blocks_total",
                                "Blocks asked of peers, by outcome", "status", dict(self.fetched))
            yield self.counter("kvcr_peer_fetched_bytes_total",
                               "Block bytes received from peers and verified", self.fetched_bytes)
            yield self.counter("kvcr_peer_served_blocks_total", "Blocks sent to (or read by) peers",
                               self.served_blocks)
            yield self.counter("kvcr_peer_served_bytes_total", "Block bytes sent to peers",
                               self.served_bytes)
            yield self.labelled("kvcr_peer_connections_total",
                                "Peer connections served, by the transport negotiated",
                                "transport", dict(self.connections))
            yield self.counter("kvcr_peer_accept_errors_total",
                               "Connections the peer port could not accept (e.g. out of "
                               "descriptors)", self.accept_errors)
            yield self.labelled("kvcr_peer_refusals_total",
                                "Peer connections refused, by reason", "reason",
                                dict(self.refused))


PULL_OUTCOMES = ("remote_run", "short", "none")
"""A pull-on-miss lookup: a peer holds a run worth fetching, only a shorter one, or none."""


class SnapshotSource(Protocol):
    def snapshot(self) -> dict[str, tuple[int, int, float | None]]: ...


class DirectoryMetrics(LightMetrics):
    """`kvcr_pull_*` and `kvcr_peer_feed_*`: the peer directory (pull on miss). The `peer`
    label is a configured peer endpoint (bounded by the configuration)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.lookups = dict.fromkeys(PULL_OUTCOMES, 0)
        self.offered_blocks = 0
        self._source: SnapshotSource | None = None
        self.register()

    def bind(self, source: SnapshotSource) -> None:
        self._source = source

    def on_lookup(self, outcome: str, blocks: int) -> None:
        with self.lock:
            self.lookups[outcome] += 1
            self.offered_blocks += blocks

    def collect(self) -> Iterator[Metric]:
        feeds = self._source.snapshot() if self._source is not None else {}
        blocks = GaugeMetricFamily("kvcr_peer_feed_blocks", "Blocks a peer holds, as its "
                                   "inventory feed says", labels=["peer"])
        lag = GaugeMetricFamily("kvcr_peer_feed_lag_seconds", "Seconds since the peer's "
                                "feed was last read to its end (absent: never)", labels=["peer"])
        resets = CounterMetricFamily("kvcr_peer_feed_resets", "Times what was known of a peer "
                                     "was dropped (restart, lost batches, lost connection)",
                                     labels=["peer"])
        for peer, (known, reset_count, behind_s) in feeds.items():
            blocks.add_metric([peer], known)
            resets.add_metric([peer], reset_count)
            if behind_s is not None:
                lag.add_metric([peer], behind_s)
        yield blocks
        yield lag
        yield resets
        with self.lock:
            yield self.labelled("kvcr_pull_lookups_total", "Pull-on-miss lookups in the peer "
                                "directory, by outcome", "outcome", dict(self.lookups))
            yield self.counter("kvcr_pull_offered_blocks_total", "Blocks of remote runs the "
                               "directory named for pull on miss", self.offered_blocks)
