"""How an engine adapter reaches its Runner, validated once from the engine's own config
mapping (vLLM's `kv_connector_extra_config`, SGLang's storage-backend / linker extra config).

`EngineSettings` holds what every adapter shares: embedded or guarded mode, the socket, the
Runner config (embedded), timeouts, and the peer keys (where this engine serves blocks, the
shared secret, the peers a KV hint may name). `parse_engine_keys` reads them; each adapter adds
its own keys and rejects the rest (a typo must not silently disable the cache). Pure.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from kvcr_core.config import KVCRConfig, load_config, parse_size_bytes
from kvcr_core.errors import ConfigError, HintRejected
from kvcr_core.hints import Endpoint
from kvcr_core.peers import PeerSecret, PeerTLS

ENGINE_KEYS = frozenset({"mode", "socket", "pool_bytes", "config_file", "kvcr", "timeout_s",
                         "identity", "peer_listen", "peer_secret_file", "peer_secret_env",
                         "peers", "fetch_deadline_s", "peer_tls", "peer_nixl"})


class Mode(enum.Enum):
    EMBEDDED = "embedded"  # the Runner lives in the engine process
    GUARDED = "guarded"  # the Runner lives in a kvcr-guard daemon


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings:
    mode: Mode = Mode.EMBEDDED
    socket: str = ""
    runner: KVCRConfig = dataclasses.field(default_factory=KVCRConfig)
    timeout_s: float = 2.0
    identity: str = ""
    peer_listen: str = ""
    peer_secret: PeerSecret | None = None
    peers: frozenset[str] = frozenset()
    fetch_deadline_s: float = 2.0
    peer_tls: PeerTLS | None = None
    peer_nixl: bool = False


def reject_unknown(extra: Mapping[str, Any], field: str, known: frozenset[str]) -> None:
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(f"{field}.{unknown[0]}", extra[unknown[0]],
                          f"unknown key; kvcr accepts {', '.join(sorted(known))}")


def parse_engine_keys(extra: Mapping[str, Any], *, field: str,
                      default_socket: str) -> dict[str, Any]:
    """The `EngineSettings` fields from `extra` (other keys are the caller's to check).
    `default_socket` is the embedded Runner's socket when none is given (use an abstract
    "\\0name": nothing is left behind when the engine is killed)."""
    try:
        mode = Mode(extra.get("mode", "embedded"))
    except ValueError:
        raise ConfigError(f"{field}.mode", extra.get("mode"),
                          "use 'embedded' (default) or 'guarded'") from None
    socket_path = extra.get("socket", "")
    if not isinstance(socket_path, str):
        raise ConfigError(f"{field}.socket", socket_path,
                          "give the kvcr-guard socket path as a string")
    if mode is Mode.GUARDED and not socket_path:
        raise ConfigError(f"{field}.socket", socket_path,
                          "guarded mode needs the kvcr-guard socket, e.g. "
                          "\"socket\": \"/run/kvcr/guard.sock\"")
    if mode is Mode.EMBEDDED and not socket_path:
        socket_path = default_socket
    overrides = extra.get("kvcr", {})
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"{field}.kvcr", overrides,
                          "give a mapping of kvcr config fields (docs/config.md)")
    overrides = dict(overrides)
    if "pool_bytes" in extra:
        overrides["pool_bytes"] = parse_size_bytes(f"{field}.pool_bytes", extra["pool_bytes"],
                                                   minimum=4096)
    runner = load_config(extra.get("config_file"), overrides=overrides)
    timeout = extra.get("timeout_s", 2.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            0 < timeout <= 60):
        raise ConfigError(f"{field}.timeout_s", timeout, "give seconds in (0, 60]")
    identity = extra.get("identity", "")
    if not isinstance(identity, str):
        raise ConfigError(f"{field}.identity", identity, "give a string")
    return {"mode": mode, "socket": socket_path, "runner": runner, "timeout_s": float(timeout),
            "identity": identity, **_peer_keys(extra, mode, field)}


def _peer_keys(extra: Mapping[str, Any], mode: Mode, field: str) -> dict[str, Any]:
    """Where this engine serves its blocks, the shared secret, and the peers a KV hint may
    name (a hint can never make the engine dial anything else). In guarded mode the daemon
    dials (and must list the same peers with --peer); the engine only filters hints."""
    listen = extra.get("peer_listen", "")
    peers = extra.get("peers", [])
    if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
        raise ConfigError(f"{field}.peers", peers, "give a list of \"tcp://host:port\"")
    for peer in peers:
        try:
            Endpoint.parse(peer, where=f"{field}.peers")
        except HintRejected as exc:
            raise ConfigError(f"{field}.peers", peer, exc.detail) from None
    deadline = extra.get("fetch_deadline_s", 2.0)
    if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not (
            0 < deadline <= 60):
        raise ConfigError(f"{field}.fetch_deadline_s", deadline, "give seconds in (0, 60]")
    if not isinstance(listen, str):
        raise ConfigError(f"{field}.peer_listen", listen, "give \"host:port\"")
    secret = None
    if mode is Mode.GUARDED and listen:
        raise ConfigError(f"{field}.peer_listen", listen,
                          "in guarded mode kvcr-guard serves peers: use its --peer-listen")
    if mode is Mode.EMBEDDED and (listen or peers):
        secret = (PeerSecret.from_file(extra["peer_secret_file"]) if "peer_secret_file" in extra
                  else PeerSecret.from_env(extra.get("peer_secret_env", "KVCR_PEER_SECRET")))
    tls = extra.get("peer_tls")
    if tls is not None:
        if not isinstance(tls, Mapping) or set(tls) != {"cert", "key", "ca"}:
            raise ConfigError(f"{field}.peer_tls", tls,
                              'give {"cert": PEM, "key": PEM, "ca": PEM} file paths')
        tls = PeerTLS(str(tls["cert"]), str(tls["key"]), str(tls["ca"]))
    nixl = extra.get("peer_nixl", False)
    if not isinstance(nixl, bool):
        raise ConfigError(f"{field}.peer_nixl", nixl, "use true or false")
    return {"peer_listen": listen, "peer_secret": secret, "peer_tls": tls, "peer_nixl": nixl,
            "peers": frozenset(str(Endpoint.parse(p)) for p in peers),
            "fetch_deadline_s": float(deadline)}
