"""Serving metrics to Prometheus: `serve_metrics` puts a registry on an HTTP port (a daemon
thread; `/metrics`), `process_metrics` adds the process's own series (`process_*`: CPU,
memory, open files; `python_info`) and `kvcr_build_info{component, version}` to a registry,
so every kvcr process an operator scrapes says what it is and what it costs.

Threading: `serve_metrics` returns once the port is bound; the HTTP thread reads the registry
(its collectors are thread-safe).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kvcr_core._version import __version__


class _BuildInfo(Collector):
    def __init__(self, component: str, version: str) -> None:
        self._labels = [component, version]

    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily("kvcr_build_info", "Which kvcr component and version this "
                                   "process runs (always 1)", labels=["component", "version"])
        family.add_metric(self._labels, 1)
        return [family]


def process_metrics(registry: CollectorRegistry, component: str,
                    version: str = __version__) -> None:
    """Adds `process_*`, `python_info` and `kvcr_build_info` to `registry` (once each)."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    registry.register(_BuildInfo(component, version))


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serves `registry` on http://host:port/metrics from a daemon thread; returns the port
    bound (port 0: any free one). Raises OSError when it cannot bind."""
    server, _thread = start_http_server(port, host, registry=registry)
    return int(server.server_address[1])
