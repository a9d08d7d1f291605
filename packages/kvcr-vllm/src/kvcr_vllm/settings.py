"""Engine config -> kvcr config, once: `ConnectorSettings` from `kv_connector_extra_config`,
the namespace of each TP rank and the bytes of one block, from vLLM's config.

The only module that reads vLLM's configuration objects. Pure functions; thread-safe.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvcr_core.config import KVCRConfig, load_config, parse_size_bytes
from kvcr_core.errors import ConfigError, HintRejected
from kvcr_core.hints import Endpoint
from kvcr_core.keys import NamespaceSpec
from kvcr_core.peers import PeerSecret, PeerTLS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class Mode(enum.Enum):
    EMBEDDED = "embedded"  # the Runner lives in the engine's scheduler process
    GUARDED = "guarded"  # the Runner lives in a kvcr-guard daemon


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConnectorSettings:
    """`kv_connector_extra_config`, validated. Unknown keys are errors (typos must not
    silently disable the cache)."""

    mode: Mode = Mode.EMBEDDED
    socket: str = ""
    runner: KVCRConfig = dataclasses.field(default_factory=KVCRConfig)
    load: bool = True
    save: bool = True
    timeout_s: float = 2.0
    identity: str = ""
    peer_listen: str = ""
    peer_secret: PeerSecret | None = None
    peers: frozenset[str] = frozenset()
    fetch_deadline_s: float = 2.0
    peer_tls: PeerTLS | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], engine_id: str) -> ConnectorSettings:
        known = {"mode", "socket", "pool_bytes", "config_file", "kvcr", "load", "save",
                 "timeout_s", "identity", "peer_listen", "peer_secret_file", "peer_secret_env",
                 "peers", "fetch_deadline_s", "peer_tls"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config.{unknown[0]}", extra[unknown[0]],
                              f"unknown key; kvcr accepts {', '.join(sorted(known))}")
        try:
            mode = Mode(extra.get("mode", "embedded"))
        except ValueError:
            raise ConfigError("kv_connector_extra_config.mode", extra.get("mode"),
                              "use 'embedded' (default) or 'guarded'") from None
        socket_path = extra.get("socket", "")
        if not isinstance(socket_path, str):
            raise ConfigError("kv_connector_extra_config.socket", socket_path,
                              "give the kvcr-guard socket path as a string")
        if mode is Mode.GUARDED and not socket_path:
            raise ConfigError("kv_connector_extra_config.socket", socket_path,
                              "guarded mode needs the kvcr-guard socket, e.g. "
                              "\"socket\": \"/run/kvcr/guard.sock\"")
        if mode is Mode.EMBEDDED and not socket_path:
            # Abstract (no file): nothing is left behind even if the engine is SIGKILLed.
            socket_path = f"\0kvcr-embedded-{engine_id[:36]}"
        overrides = extra.get("kvcr", {})
        if not isinstance(overrides, Mapping):
            raise ConfigError("kv_connector_extra_config.kvcr", overrides,
                              "give a mapping of kvcr config fields (docs/config.md)")
        overrides = dict(overrides)
        if "pool_bytes" in extra:
            overrides["pool_bytes"] = parse_size_bytes(
                "kv_connector_extra_config.pool_bytes", extra["pool_bytes"], minimum=4096)
        runner = load_config(extra.get("config_file"), overrides=overrides)
        flags = {}
        for name in ("load", "save"):
            value = extra.get(name, True)
            if not isinstance(value, bool):
                raise ConfigError(f"kv_connector_extra_config.{name}", value, "use true or false")
            flags[name] = value
        timeout = extra.get("timeout_s", 2.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
                0 < timeout <= 60):
            raise ConfigError("kv_connector_extra_config.timeout_s", timeout,
                              "give seconds in (0, 60]")
        identity = extra.get("identity", "")
        if not isinstance(identity, str):
            raise ConfigError("kv_connector_extra_config.identity", identity, "give a string")
        peer = _peer_settings(extra, mode)
        return cls(mode=mode, socket=socket_path, runner=runner, load=flags["load"],
                   save=flags["save"], timeout_s=float(timeout), identity=identity, **peer)


def _peer_settings(extra: Mapping[str, Any], mode: Mode) -> dict[str, Any]:
    """Peer keys: where this engine serves its blocks, the shared secret, and the peers a KV
    hint may name (a hint can never make the engine dial anything else). In guarded mode the
    daemon dials (and must list the same peers with --peer); the engine only filters hints."""
    field = "kv_connector_extra_config"
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
    return {"peer_listen": listen, "peer_secret": secret, "peer_tls": tls,
            "peers": frozenset(str(Endpoint.parse(p)) for p in peers),
            "fetch_deadline_s": float(deadline)}


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def layout_tag(vllm_config: VllmConfig) -> str:
    """Engine, version, platform and (on CPU) the kernel ISA: page bytes depend on all."""
    import vllm
    from vllm.platforms import current_platform

    tag = f"vllm-{vllm.__version__}/{current_platform.device_type}"
    if current_platform.device_type == "cpu":
        import torch

        tag += f"/{torch.backends.cpu.get_cpu_capability()}"
    return tag


def namespace_for(vllm_config: VllmConfig, tp_rank: int) -> NamespaceSpec:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("pipeline_parallel_size", parallel.pipeline_parallel_size,
                          "kvcr supports pipeline_parallel_size 1 (tensor parallel is fine)")
    kv_dtype = cache.cache_dtype if cache.cache_dtype != "auto" else _dtype_name(model.dtype)
    return NamespaceSpec(
        model_id=str(model.model), model_revision=str(model.revision or ""),
        dtype=_dtype_name(model.dtype), kv_dtype=str(kv_dtype),
        block_size_tokens=int(cache.block_size),
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_dim=int(model.get_head_size()), layout=layout_tag(vllm_config),
        tp_size=int(parallel.tensor_parallel_size), tp_rank=tp_rank)


def block_bytes_for(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block of every layer (one kvcr slot), from vLLM's KV cache spec."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError("kv_cache_groups", len(groups),
                          "kvcr supports models with one KV cache group (full attention)")
    group = groups[0]
    return int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
