"""`GuardDaemon`: kvcr-guard's process around core's `AttachServer`: the metrics HTTP endpoint,
SIGTERM/SIGINT handling and the daemon's log line. The attach server owns the pool, the
clients and peer serving; the daemon owns the process.

Threading: `run` serves on the calling (main) thread until a signal or `stop`.
"""

from __future__ import annotations

import logging
import signal
import threading

from prometheus_client import CollectorRegistry

from kvcr_core.attach import AttachServer
from kvcr_core.exposition import process_metrics, serve_metrics
from kvcr_guard._version import __version__
from kvcr_guard.config import GuardConfig

log = logging.getLogger("kvcr_guard")


class GuardDaemon:
    def __init__(self, config: GuardConfig, *, registry: CollectorRegistry | None = None):
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self.server = AttachServer(config.server, registry=self.registry)
        process_metrics(self.registry, "kvcr-guard", __version__)
        self.metrics_port: int | None = None

    def listen(self) -> None:
        """With --prefault (--back-ahead), backs the first namespace's pool (its first SIZE)
        first; then binds the metrics port, the socket and the peer port (raises on
        failure). The socket comes after the metrics port: whoever waits for the socket (a
        supervisor, a readiness probe) may scrape at once. SIGTERM and SIGINT are handled
        from here on: a client may connect, and a supervisor stop the daemon, as soon as the
        socket exists (a stop before `run` drains at once)."""
        server = self.config.server
        if server.prefault or server.back_ahead_bytes:  # before the socket exists: the first
            # engine attaches to a backed pool at once; the loop is not held while it is backed
            backed = self.server.runner.back_first_pool(server.back_ahead_bytes)
            log.info("kvcr-guard backed %d bytes for the first namespace's pool", backed)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.server.request_shutdown())
        if self.config.metrics_port is not None:
            self.metrics_port = self._serve_metrics()
        self.server.listen()
        log.info("kvcr-guard %s ready (metrics %s)", __version__,
                 f"{self.config.metrics_host}:{self.metrics_port}" if self.metrics_port
                 else "off")

    def _serve_metrics(self) -> int:
        host, port = self.config.metrics_host, self.config.metrics_port
        assert port is not None
        try:
            return serve_metrics(self.registry, host, port)
        except OSError as exc:
            raise RuntimeError(f"cannot serve metrics on {host}:{port} ({exc.strerror}); "
                               "choose another --metrics-port (0: any free port) or stop "
                               "whatever holds it") from None

    def run(self) -> int:
        """Serves until SIGTERM/SIGINT (or `stop`); returns the exit code."""
        return self.server.serve_forever()

    def stop(self) -> None:
        self.server.request_shutdown()
