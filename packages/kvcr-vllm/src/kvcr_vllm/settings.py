"""Engine config -> kvcr config, once: `ConnectorSettings` from `kv_connector_extra_config`,
the namespace of each TP rank and the bytes of one block, from vLLM's config.

The only module that reads vLLM's configuration objects. Pure functions; thread-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvcr_core.attach import ENGINE_KEYS, EngineSettings, reject_unknown
from kvcr_core.errors import ConfigError
from kvcr_core.keys import NamespaceSpec
from kvcr_vllm.router_tier import (
    HintHashScheme,
    RouterHintTier,
    check_control_endpoint,
    parse_hash_scheme,
    parse_secondary_tiers,
)

DEFAULT_FETCH_WAIT_S = 0.05  # a few MiB over TCP; other requests' step waits at most this

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConnectorSettings(EngineSettings):
    """`kv_connector_extra_config`, validated. Unknown keys are errors (typos must not
    silently disable the cache); `secondary_tiers` is Dynamo's (kvcr_vllm.router_tier)."""

    load: bool = True
    save: bool = True
    router_hint: RouterHintTier | None = None
    """Dynamo's router-hint capability, when this worker advertises it."""
    advertised_endpoint: str | None = None
    """The control endpoint Dynamo names when this engine is the source (its DP rank's)."""
    hint_hashes: HintHashScheme = HintHashScheme.KVCR_V1
    fetch_wait_s: float = DEFAULT_FETCH_WAIT_S
    """How long the scheduler may block, once per request, for a peer fetch (a hint's or a
    pull's) to end before it answers "ask again" (0: never blocks)."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], engine_id: str,
                          dp_rank: int = 0) -> ConnectorSettings:
        """`dp_rank`: this engine's local data-parallel rank (its entry of control_ports)."""
        field = "kv_connector_extra_config"
        reject_unknown(extra, field, ENGINE_KEYS | {"load", "save", "secondary_tiers",
                                                    "hint_hash_scheme", "fetch_wait_s"})
        common = cls.fields_from(extra, field=field,
                                 default_socket=f"\0kvcr-embedded-{engine_id[:36]}")
        flags = {}
        for name in ("load", "save"):
            value = extra.get(name, True)
            if not isinstance(value, bool):
                raise ConfigError(f"{field}.{name}", value, "use true or false")
            flags[name] = value
        wait = extra.get("fetch_wait_s", DEFAULT_FETCH_WAIT_S)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 1:
            raise ConfigError(f"{field}.fetch_wait_s", wait,
                              "give seconds in [0, 1] (0: the scheduler never blocks on a fetch)")
        tier = parse_secondary_tiers(extra.get("secondary_tiers"), f"{field}.secondary_tiers")
        if tier is not None:
            check_control_endpoint(tier, common["mode"], common["peer"], dp_rank,
                                   f"{field}.secondary_tiers[0]")
        scheme = parse_hash_scheme(extra.get("hint_hash_scheme"), tier,
                                   f"{field}.hint_hash_scheme")
        return cls(**common, load=flags["load"], save=flags["save"], router_hint=tier,
                   advertised_endpoint=tier.endpoint(dp_rank) if tier else None,
                   hint_hashes=scheme, fetch_wait_s=float(wait))


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
