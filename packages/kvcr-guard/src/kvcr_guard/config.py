"""`GuardConfig`: the daemon's settings, frozen and validated once: the attach server's
(`ServerConfig`: socket, pool, who may attach, peers) and the daemon's own (metrics HTTP).
"""

from __future__ import annotations

import dataclasses

from kvcr_core.attach import ServerConfig
from kvcr_core.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    server: ServerConfig
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: any free port

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", self.metrics_port, "give a port in 0..65535")
