"""`ServerConfig`: what an attach server needs (the socket, the Runner's config, who may attach,
the peer settings), frozen and validated once. kvcr-guard builds it from its flags; embedded
mode from the engine's settings.
"""

from __future__ import annotations

import dataclasses
import os

from kvcr_core.attach.settings import PeerConfig
from kvcr_core.config import KVCRConfig
from kvcr_core.errors import ConfigError

MAX_SOCKET_PATH_BYTES = 107


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    socket_path: str
    runner: KVCRConfig = dataclasses.field(default_factory=KVCRConfig)
    allowed_uids: frozenset[int] = dataclasses.field(
        default_factory=lambda: frozenset({os.getuid()}))
    max_clients: int = 256
    peer: PeerConfig = dataclasses.field(default_factory=PeerConfig)

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
        if self.max_clients < 1:
            raise ConfigError("max_clients", self.max_clients, "give a positive count")
        self.peer.check_secret()
