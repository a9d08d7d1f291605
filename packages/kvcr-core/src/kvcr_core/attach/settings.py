"""How an engine adapter reaches its Runner, and how a Runner meets its peers: frozen settings,
validated once at the edge.

- `PeerConfig`: where a Runner serves peers, the shared secret, TLS, NIXL, the peers it may
  fetch from (the only endpoints a KV hint may name) and the fetch deadline. One validation
  for every source: kvcr-guard's flags and every engine adapter's config mapping.
- `EngineSettings`: what every engine adapter shares (embedded or guarded mode, the socket,
  the Runner config of the embedded mode, timeouts, identity, `PeerConfig`).
  `EngineSettings.fields_from(extra, ...)` reads them from the engine's own config mapping
  (vLLM's `kv_connector_extra_config`, SGLang's storage backend / linker extra config); each
  adapter adds its own keys and rejects the rest (a typo must not silently disable the cache).

Pure; thread-safe.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from kvcr_core.attach.credentials import trusted_runner_uids
from kvcr_core.config import KVCRConfig, load_config, parse_size_bytes
from kvcr_core.endpoint import Endpoint
from kvcr_core.errors import ConfigError, HintRejected
from kvcr_core.peers import PeerSecret, PeerTLS
from kvcr_core.peers.fleet import FleetCredential, NodeKey, PeerCredential

ENGINE_KEYS = frozenset({"mode", "socket", "pool_bytes", "config_file", "kvcr", "timeout_s",
                         "identity", "peer_listen", "peer_secret_file", "peer_secret_env",
                         "peers", "fetch_deadline_s", "peer_tls", "peer_nixl", "pull_on_miss",
                         "pull_min_blocks", "peer_feed_max_blocks", "metrics_listen",
                         "prefault", "back_ahead", "runner_uids", "peer_node_key_file",
                         "peer_fleet_file"})
DEFAULT_PULL_MIN_BLOCKS = 1  # measured: pulling even one block beat recomputing it
DEFAULT_FEED_MAX_BLOCKS = 1 << 18
DEFAULT_SECRET_ENV = "KVCR_PEER_SECRET"


class Mode(enum.Enum):
    EMBEDDED = "embedded"  # the Runner lives in the engine process
    GUARDED = "guarded"  # the Runner lives in a kvcr-guard daemon


def _seconds(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 60:
        raise ConfigError(field, value, "give seconds in (0, 60]")
    return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """A Runner's peer settings. `peers` are normalised `tcp://host:port` endpoints."""

    listen: str = ""
    """HOST:PORT to serve blocks to peers on ("" = serve none; port 0 = any free port)."""
    secret: PeerCredential | None = None
    """What peers authenticate with (needed to serve or to fetch): this node's fleet
    identity, or the older shared secret."""
    peers: frozenset[str] = frozenset()
    """Endpoints this Runner may fetch from: the only sources a KV hint may name."""
    tls: PeerTLS | None = None
    nixl: bool = False
    """Move peer transfers to NIXL when both sides have it (trusted nodes only)."""
    fetch_deadline_s: float = 2.0
    pull_on_miss: bool = True
    """Follow the peers' inventories and fetch a run a peer holds on a local miss."""
    pull_min_blocks: int = DEFAULT_PULL_MIN_BLOCKS
    """A shorter remote run is recomputed instead (fetching it costs more)."""
    feed_max_blocks: int = DEFAULT_FEED_MAX_BLOCKS
    """Blocks remembered per followed peer (about 180 bytes each); the oldest go first."""

    def __post_init__(self) -> None:
        if not isinstance(self.listen, str):
            raise ConfigError("peer_listen", self.listen, 'give "HOST:PORT"')
        if self.listen:
            host, _, port = self.listen.rpartition(":")
            if not host or not port.isdigit() or int(port) > 65535:
                raise ConfigError("peer_listen", self.listen,
                                  "give HOST:PORT, e.g. 0.0.0.0:7500 (port 0 = any)")
        normalised = set()
        for peer in self.peers:
            try:
                normalised.add(str(Endpoint.parse(peer, where="peers")))
            except HintRejected as exc:
                raise ConfigError("peers", peer, exc.detail) from None
        object.__setattr__(self, "peers", frozenset(normalised))
        for name, flag in (("peer_nixl", self.nixl), ("pull_on_miss", self.pull_on_miss)):
            if not isinstance(flag, bool):
                raise ConfigError(name, flag, "use true or false")
        for name, count, top in (("pull_min_blocks", self.pull_min_blocks, 1 << 20),
                                 ("peer_feed_max_blocks", self.feed_max_blocks, 1 << 26)):
            if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= top:
                raise ConfigError(name, count, f"give a whole number from 1 to {top}")
        object.__setattr__(self, "fetch_deadline_s",
                           _seconds("fetch_deadline_s", self.fetch_deadline_s))

    @property
    def active(self) -> bool:
        """Whether this Runner serves or fetches from peers at all."""
        return bool(self.listen or self.peers)

    def check_secret(self) -> None:
        """A Runner that serves or fetches needs the secret (raises ConfigError)."""
        if self.active and self.secret is None:
            raise ConfigError("peer_secret", None, "peers need the shared secret: a file "
                              "(peer_secret_file / --peer-secret-file) or an environment "
                              "variable (peer_secret_env / --peer-secret-env)")

    @classmethod
    def from_mapping(cls, extra: Mapping[str, Any], *, field: str,
                     load_secret: bool) -> PeerConfig:
        """The peer keys of an engine's config mapping; errors name `field.key`.
        `load_secret`: read the secret (a Runner in this process will use it)."""
        peers = extra.get("peers", [])
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            raise ConfigError(f"{field}.peers", peers, 'give a list of "tcp://host:port"')
        tls = extra.get("peer_tls")
        if tls is not None:
            if not isinstance(tls, Mapping) or set(tls) != {"cert", "key", "ca"}:
                raise ConfigError(f"{field}.peer_tls", tls,
                                  'give {"cert": PEM, "key": PEM, "ca": PEM} file paths')
            tls = PeerTLS(str(tls["cert"]), str(tls["key"]), str(tls["ca"]))
        try:
            config = cls(listen=extra.get("peer_listen", ""), peers=frozenset(peers), tls=tls,
                         nixl=extra.get("peer_nixl", False),
                         fetch_deadline_s=extra.get("fetch_deadline_s", 2.0),
                         pull_on_miss=extra.get("pull_on_miss", True),
                         pull_min_blocks=extra.get("pull_min_blocks", DEFAULT_PULL_MIN_BLOCKS),
                         feed_max_blocks=extra.get("peer_feed_max_blocks",
                                                   DEFAULT_FEED_MAX_BLOCKS))
        except ConfigError as exc:
            raise ConfigError(f"{field}.{exc.field}", exc.value, exc.fix) from None
        if not (load_secret and config.active):
            return config
        secret = secret_from(extra.get("peer_secret_file"),
                             extra.get("peer_secret_env", DEFAULT_SECRET_ENV),
                             node_key=extra.get("peer_node_key_file"),
                             fleet=extra.get("peer_fleet_file"))
        return dataclasses.replace(config, secret=secret)


def secret_from(path: str | None, env: str, *, node_key: str | None = None,
                fleet: str | None = None) -> PeerCredential:
    """The peer credential: a fleet identity when `fleet` (the fleet file) is given, with
    the node key file `node_key`; else the shared secret, from a file when one is named,
    else from environment variable `env`."""
    if fleet or node_key:
        if not (fleet and node_key):
            raise ConfigError("peer_fleet_file" if node_key else "peer_node_key_file", None,
                              "a fleet identity needs both the node's key file and the fleet "
                              "file (peer_node_key_file + peer_fleet_file, or kvcr-guard "
                              "--peer-node-key + --peer-fleet)")
        return FleetCredential(NodeKey.from_file(node_key), fleet)
    return PeerSecret.from_file(path) if path else PeerSecret.from_env(env)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings:
    mode: Mode = Mode.EMBEDDED
    socket: str = ""
    runner: KVCRConfig = dataclasses.field(default_factory=KVCRConfig)
    timeout_s: float = 2.0
    identity: str = ""
    peer: PeerConfig = dataclasses.field(default_factory=PeerConfig)
    metrics_listen: tuple[str, int] | None = None
    """Embedded mode: serve the Runner's metrics (`kvcr_*`, `kvcr_peer_*`, process) here."""
    prefault: bool = False
    """Embedded mode: back the whole pool when the engine starts (kvcr-guard: --prefault), so
    saves and fetches never pay first-touch page faults."""
    back_ahead_bytes: int = 0
    """Embedded mode: back the pool as it fills, this far ahead of the slots in use
    (kvcr-guard: --back-ahead): the same for saves and fetches, but the engine holds only
    what is stored plus the margin (0: off)."""
    runner_uids: frozenset[int] = dataclasses.field(default_factory=frozenset)
    """Uids besides the engine's own whose Runner it accepts (the uid kvcr-guard runs as,
    when another): a socket served by any other uid is refused (`untrusted_runner`)."""

    @property
    def trusted_runner_uids(self) -> frozenset[int]:
        """The uids whose Runner this engine accepts: its own plus `runner_uids`."""
        return trusted_runner_uids(self.runner_uids)

    @staticmethod
    def fields_from(extra: Mapping[str, Any], *, field: str,
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
        if mode is Mode.GUARDED and extra.get("peer_listen"):
            raise ConfigError(f"{field}.peer_listen", extra["peer_listen"],
                              "in guarded mode kvcr-guard serves peers: use its --peer-listen")
        identity = extra.get("identity", "")
        if not isinstance(identity, str):
            raise ConfigError(f"{field}.identity", identity, "give a string")
        metrics = _listen(f"{field}.metrics_listen", extra.get("metrics_listen"))
        if mode is Mode.GUARDED and metrics is not None:
            raise ConfigError(f"{field}.metrics_listen", extra["metrics_listen"],
                              "in guarded mode kvcr-guard serves the metrics: use its "
                              "--metrics-host/--metrics-port")
        prefault, back_ahead = _backing(extra, field, mode)
        # In guarded mode the daemon dials (and must list the same peers with --peer); the
        # engine only filters hints, so it needs no secret.
        peer = PeerConfig.from_mapping(extra, field=field, load_secret=mode is Mode.EMBEDDED)
        return {"mode": mode, "socket": socket_path or default_socket,
                "runner": _runner_config(extra, field),
                "timeout_s": _seconds(f"{field}.timeout_s", extra.get("timeout_s", 2.0)),
                "identity": identity, "peer": peer, "metrics_listen": metrics,
                "prefault": prefault, "back_ahead_bytes": back_ahead,
                "runner_uids": _uids(f"{field}.runner_uids", extra.get("runner_uids", []))}


def _uids(field: str, value: object) -> frozenset[int]:
    if not isinstance(value, list | tuple) or not all(
            isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in value):
        raise ConfigError(field, value, "give a list of uids, e.g. [0] when kvcr-guard runs "
                          "as root")
    return frozenset(value)


def _backing(extra: Mapping[str, Any], field: str, mode: Mode) -> tuple[bool, int]:
    """`prefault` and `back_ahead` (bytes; 0: off): embedded mode only, one of the two."""
    prefault = extra.get("prefault", False)
    if not isinstance(prefault, bool):
        raise ConfigError(f"{field}.prefault", prefault, "use true or false")
    raw = extra.get("back_ahead")
    back_ahead = 0 if raw in (None, 0, "0") else parse_size_bytes(f"{field}.back_ahead", raw)
    for key, value, flag in (("prefault", prefault, "--prefault"),
                             ("back_ahead", back_ahead, "--back-ahead")):
        if mode is Mode.GUARDED and value:
            raise ConfigError(f"{field}.{key}", extra[key],
                              f"in guarded mode kvcr-guard owns the pool: use its {flag}")
    if prefault and back_ahead:
        raise ConfigError(f"{field}.back_ahead", raw,
                          "prefault backs the whole pool already: give one of the two")
    return prefault, back_ahead


def _listen(field: str, value: object) -> tuple[str, int] | None:
    """"HOST:PORT" (None: not set); port 0 picks a free one."""
    if value is None or value == "":
        return None
    host, _, port = str(value).rpartition(":")
    if not isinstance(value, str) or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(field, value, 'give "HOST:PORT", e.g. "0.0.0.0:9750" (port 0 = any)')
    return host.strip("[]"), int(port)


def _runner_config(extra: Mapping[str, Any], field: str) -> KVCRConfig:
    overrides = extra.get("kvcr", {})
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"{field}.kvcr", overrides,
                          "give a mapping of kvcr config fields (docs/config.md)")
    overrides = dict(overrides)
    if "pool_bytes" in extra:
        overrides["pool_bytes"] = parse_size_bytes(f"{field}.pool_bytes", extra["pool_bytes"],
                                                   minimum=4096)
    return load_config(extra.get("config_file"), overrides=overrides)


def reject_unknown(extra: Mapping[str, Any], field: str, known: frozenset[str],
                   *, ignored: frozenset[str] = frozenset()) -> None:
    """A key neither `known` nor `ignored` (the engine's own keys in the same mapping) is a
    ConfigError naming it and what kvcr accepts."""
    unknown = sorted(set(extra) - known - ignored)
    if unknown:
        raise ConfigError(f"{field}.{unknown[0]}", extra[unknown[0]],
                          f"unknown key; kvcr accepts {', '.join(sorted(known))}")
