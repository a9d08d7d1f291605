"""`GuardConfig`: the daemon's own settings, frozen and validated once; the pool settings are
a `KVCRConfig` inside it (so `--config FILE` and `KVCR_*` variables work as for any Runner).
"""

from __future__ import annotations

import dataclasses
import os

from kvcr_core.config import KVCRConfig
from kvcr_core.errors import ConfigError
from kvcr_core.peers import PeerSecret, PeerTLS

MAX_SOCKET_PATH_BYTES = 107


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    socket_path: str
    runner: KVCRConfig = dataclasses.field(default_factory=KVCRConfig)
    allowed_uids: frozenset[int] = dataclasses.field(
        default_factory=lambda: frozenset({os.getuid()}))
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    max_clients: int = 256
    peer_listen: str = ""  # "host:port" to serve peers on ("" = no peer server)
    peer_secret: PeerSecret | None = None
    peers: frozenset[str] = frozenset()  # endpoints clients may ask the daemon to fetch from
    peer_tls: PeerTLS | None = None
    peer_nixl: bool = False  # offer / use NIXL reads between peers that both have it

    @property
    def abstract(self) -> bool:
        """A Linux abstract socket ("\\0name"): no file, gone with the process (the uid check
        is then the only gate, as there are no file permissions)."""
        return self.socket_path.startswith("\0")

    def __post_init__(self) -> None:
        if not self.socket_path:
            raise ConfigError("socket", self.socket_path, "give the Unix socket path to serve")
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH_BYTES:
            raise ConfigError("socket", self.socket_path,
                              f"Unix socket paths must be under {MAX_SOCKET_PATH_BYTES} bytes; "
                              "use a shorter directory such as /run/kvcr")
        parent = os.path.dirname(os.path.abspath(self.socket_path))
        if not self.abstract and not os.path.isdir(parent):
            raise ConfigError("socket", self.socket_path, f"create the directory {parent} first")
        if not self.allowed_uids or any(u < 0 for u in self.allowed_uids):
            raise ConfigError("allowed_uids", sorted(self.allowed_uids),
                              "give one or more non-negative uids")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", self.metrics_port, "give a port in 0..65535")
        if self.max_clients < 1:
            raise ConfigError("max_clients", self.max_clients, "give a positive count")
        if self.peer_listen:
            host, _, port = self.peer_listen.rpartition(":")
            if not host or not port.isdigit() or int(port) > 65535:
                raise ConfigError("peer_listen", self.peer_listen,
                                  "give HOST:PORT, e.g. 0.0.0.0:7500 (port 0 = any)")
        if (self.peer_listen or self.peers) and self.peer_secret is None:
            raise ConfigError("peer_secret", None, "peers need the shared secret: "
                              "--peer-secret-file PATH or --peer-secret-env VAR")
