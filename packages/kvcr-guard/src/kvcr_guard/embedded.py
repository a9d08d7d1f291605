"""Embedded mode: the Runner lives in the engine process (vLLM: its scheduler; SGLang: the
scheduler process that owns the cache).

It is served to this engine's workers exactly as kvcr-guard serves engines (the same
`GuardServer` on a private Unix socket, in a daemon thread), so embedded and guarded modes
run one code path; with `peer_listen` it also serves other nodes. The default socket is a
Linux abstract one (no file; only this uid may attach), so nothing is left behind even when
the engine is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading

from kvcr_core.config import KVCRConfig
from kvcr_core.peers import PeerSecret, PeerTLS
from kvcr_guard.config import GuardConfig
from kvcr_guard.server import GuardServer

log = logging.getLogger("kvcr_guard")


class EmbeddedRunner:
    def __init__(self, socket_path: str, runner_config: KVCRConfig, *, peer_listen: str = "",
                 peer_secret: PeerSecret | None = None, peer_tls: PeerTLS | None = None,
                 peers: frozenset[str] = frozenset(), peer_nixl: bool = False) -> None:
        self.socket_path = socket_path
        self.server = GuardServer(GuardConfig(socket_path=socket_path, runner=runner_config,
                                              peer_listen=peer_listen, peer_secret=peer_secret,
                                              peer_tls=peer_tls, peers=peers,
                                              peer_nixl=peer_nixl))
        self.server.listen()
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvcr-embedded",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        log.info("kvcr embedded runner serving %s (pool %d bytes)", socket_path,
                 runner_config.pool_bytes)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.server.request_shutdown()
            self._thread.join(timeout=5)
        if not self.socket_path.startswith("\0"):  # abstract sockets have no file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
