"""`GuardConfig`: the daemon's settings, frozen and validated once: the attach server's
(`ServerConfig`: socket, pool, who may attach, peers) and the daemon's own (metrics HTTP).
"""

from __future__ import annotations

import dataclasses

from kvcr_core.attach import ServerConfig
from kvcr_core.errors import ConfigError

DEFAULT_NAMESPACE_SHARE = 4
"""Without --namespace-pool-bytes each namespace gets this fraction (1/N) of the pool, so the
first Hello cannot take all of it (N namespaces fit: e.g. one engine of TP=4)."""
DEFAULT_NAMESPACE_IDLE_S = 600.0
"""A namespace no client used for this long gives its memory back."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    server: ServerConfig
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: any free port

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", self.metrics_port, "give a port in 0..65535")
