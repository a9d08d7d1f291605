"""Embedded mode: the Runner lives in the engine process (vLLM: its scheduler; SGLang: the
process that owns the cache).

It is served to the engine's other processes (vLLM's workers, `kvcr status`) exactly as
kvcr-guard serves engines (the same `AttachServer` on a private Unix socket, in a daemon
thread), so embedded and guarded modes run one code path; the engine's own process calls it
in-process (`service`: the same `RunnerService` the socket's codec calls, without a socket
round trip). With `peer.listen` it also serves other nodes, and with `peer.peers` it fetches
hinted blocks from them (the service's fetch tickets). The default socket is a
Linux abstract one (no file; only this uid may attach), so nothing is left behind even when
the engine is killed. Its name ends in a random part chosen at start (`socket_path`; the
engine hands it to its other processes), so no other uid can bind it first, and a name that
is taken is never a reason not to start: another random part is tried.
With `metrics_listen` the Runner's registry (`kvcr_*`, `kvcr_peer_*`,
`kvcr_pull_*`, the process's own series) is served on that port (plus `metrics_offset`, for
engines that run one Runner per rank); a port that cannot be bound is logged, never fatal.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import threading
from collections.abc import Sequence

from kvcr_core.attach.admission import AttachRefused
from kvcr_core.attach.config import MAX_SOCKET_PATH_BYTES, ServerConfig
from kvcr_core.attach.ops import RunnerUnavailable
from kvcr_core.attach.server import AttachServer
from kvcr_core.attach.service import RunnerService
from kvcr_core.attach.settings import EngineSettings
from kvcr_core.config import KVCRConfig
from kvcr_core.exposition import process_metrics, serve_metrics
from kvcr_core.keys import NamespaceSpec

log = logging.getLogger("kvcr_core.attach")
_BIND_ATTEMPTS = 8


class EmbeddedRunner:
    """Starts serving at construction; `stop` (also at interpreter exit) ends it."""

    def __init__(self, settings: EngineSettings, *, runner: KVCRConfig | None = None,
                 metrics_offset: int = 0) -> None:
        """`runner` overrides `settings.runner` (an adapter that sizes the pool itself)."""
        config = runner if runner is not None else settings.runner
        self.server = self._listen(settings, config)
        self.socket_path = self.server.config.socket_path
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvcr-embedded",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        self.metrics_port: int | None = None
        if settings.metrics_listen is not None:
            self._serve_metrics(*settings.metrics_listen, metrics_offset)
        log.info("kvcr embedded runner serving %s (pool %d bytes)",
                 self.socket_path.replace("\0", "@"), config.pool_bytes)

    @staticmethod
    def _listen(settings: EngineSettings, config: KVCRConfig) -> AttachServer:
        """A listening server: on `settings.socket` plus a random part if abstract."""
        for attempt in range(_BIND_ATTEMPTS):
            path = settings.socket
            if path.startswith("\0"):
                path = f"{path[:MAX_SOCKET_PATH_BYTES - 20]}-{secrets.token_hex(8)}"
            server = AttachServer(ServerConfig(
                socket_path=path, runner=config, peer=settings.peer,
                prefault=settings.prefault, back_ahead_bytes=settings.back_ahead_bytes))
            try:
                server.listen()
                return server
            except RuntimeError:
                server.close_unserved()
                if not path.startswith("\0") or attempt == _BIND_ATTEMPTS - 1:
                    raise
                log.warning("kvcr embedded runner: %s is taken (another uid may be squatting "
                            "kvcr names); trying another name", path.replace("\0", "@"))
        raise AssertionError("unreachable")

    def _serve_metrics(self, host: str, port: int, offset: int) -> None:
        registry = self.server.registry
        process_metrics(registry, "kvcr-embedded")
        want = port + offset if port else 0
        try:
            self.metrics_port = serve_metrics(registry, host, want)
        except OSError as exc:
            log.warning("kvcr embedded runner: cannot serve metrics on %s:%d (%s); running "
                        "without", host, want, exc)
            return
        log.info("kvcr embedded runner metrics on http://%s:%d/metrics", host,
                 self.metrics_port)

    @property
    def peer_endpoint(self) -> str | None:
        """Where this Runner serves peers (None: it serves none)."""
        return self.server.host.peers.endpoint

    def service(self, specs: Sequence[NamespaceSpec], block_bytes: int, *,
                identity: str = "") -> RunnerService:
        """An in-process client of this Runner for `specs` (its namespaces, in order), as
        this process's uid; `close()` it when done. Raises RunnerUnavailable if the
        namespaces cannot open (no pool room, another block size)."""
        host = self.server.host
        try:
            return host.attach(host.new_owner(), os.getuid(), specs, block_bytes,
                               identity or f"pid-{os.getpid()}-in-process")
        except AttachRefused as exc:
            raise RunnerUnavailable(exc.reason, exc.detail) from None

    def stop(self) -> None:
        if self._thread.is_alive():
            self.server.request_shutdown()
            self._thread.join(timeout=5)
        if not self.socket_path.startswith("\0"):  # abstract sockets have no file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
