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


@dataclasses.dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: layers that share a block table. Each group's blocks
    live in a namespace of their own (`namespaces_for`), so a key names its group."""

    layer_names: tuple[str, ...]
    attention: str
    """"full", "mla", "sliding_window:W" or "chunked_local:C": which blocks of a prefix the
    group's layers read (the namespace carries it)."""
    block_bytes: int


def _attention_kind(spec: object, model_type: str) -> str:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    kind = type(spec)
    if kind is FullAttentionSpec:
        return "full"
    if kind is MLAAttentionSpec:
        return "mla"
    if kind in (SlidingWindowSpec, SlidingWindowMLASpec):
        return f"sliding_window:{spec.sliding_window}"  # type: ignore[attr-defined]
    if kind is ChunkedLocalAttentionSpec:
        return f"chunked_local:{spec.attention_chunk_size}"  # type: ignore[attr-defined]
    raise ConfigError(
        "kv_cache_groups", kind.__name__,
        f"kvcr keeps per-token attention KV (full, MLA, sliding-window, chunked-local); this "
        f"model (model_type {model_type}) has a {kind.__name__} KV cache group (state kvcr "
        "cannot reuse by prefix: Mamba and linear-attention layers, cross- or encoder-only "
        "attention). Serve it without KVCRConnector in --kv-transfer-config")


def kv_groups(kv_cache_config: KVCacheConfig, model_type: str = "") -> list[KVGroup]:
    """vLLM's KV cache groups, checked: one for a full-attention model, several for a hybrid
    one (vLLM's hybrid memory manager on). Raises ConfigError for a group kvcr cannot serve
    and for groups of unequal block bytes (every slot of a Runner has one size)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            kinds = {_attention_kind(s, model_type) for s in spec.kv_cache_specs.values()}
            nbytes = sum(int(s.page_size_bytes) for s in spec.kv_cache_specs.values())
            kind = min(kinds) if len(kinds) == 1 else "+".join(sorted(kinds))
        else:
            kind = _attention_kind(spec, model_type)
            nbytes = int(spec.page_size_bytes) * len(group.layer_names)
        groups.append(KVGroup(tuple(group.layer_names), kind, nbytes))
    if not groups:
        raise ConfigError("kv_cache_groups", 0, "this model has no KV cache for kvcr to keep")
    sizes = sorted({g.block_bytes for g in groups})
    if len(sizes) > 1:
        raise ConfigError(
            "kv_cache_groups", [g.block_bytes for g in groups],
            f"kvcr needs every KV cache group's block to be one size (model_type {model_type} "
            f"gives {sizes} bytes); serve it without KVCRConnector, or with vLLM's hybrid "
            "memory manager off (--disable-hybrid-kv-cache-manager)")
    return groups


def namespaces_for(base: NamespaceSpec, groups: list[KVGroup]) -> list[NamespaceSpec]:
    """One namespace per KV cache group, in vLLM's group order. A single group's is `base`
    itself (the keys of a full-attention model do not change); several groups' carry the
    group's index and attention, and its layer count."""
    if len(groups) == 1:
        return [base]
    return [dataclasses.replace(base, num_layers=len(group.layer_names),
                                extra={**base.extra, "kv_group": f"{g}/{len(groups)}",
                                       "attention": group.attention})
            for g, group in enumerate(groups)]



@dataclasses.dataclass(frozen=True)
class EngineNamespaces:
    """Every namespace of an engine, in the Runner's order (`specs`), and which one holds
    each TP rank's blocks of each KV cache group (`index[rank][group]`). One per rank and
    group, except for latent-attention (MLA) groups: their KV is the same on every TP rank,
    so all ranks share one namespace (`tp_rank` 0, marked `tp_ranks: shared`) that rank 0
    writes and every rank reads."""

    specs: tuple[NamespaceSpec, ...]
    index: tuple[tuple[int, ...], ...]
    shared: tuple[bool, ...]  # per group: one namespace for every rank

    @classmethod
    def of(cls, rank_specs: list[list[NamespaceSpec]],
           shared: tuple[bool, ...] | None = None) -> EngineNamespaces:
        """From each rank's namespace of each group (`shared` groups: rank 0's for all)."""
        groups = len(rank_specs[0])
        shared = shared or (False,) * groups
        specs: list[NamespaceSpec] = []
        index: list[tuple[int, ...]] = []
        for rank, per_group in enumerate(rank_specs):
            row = []
            for g, spec in enumerate(per_group):
                if shared[g] and rank > 0:
                    row.append(index[0][g])
                    continue
                row.append(len(specs))
                specs.append(spec)
            index.append(tuple(row))
        return cls(tuple(specs), tuple(index), tuple(shared))

    @property
    def groups(self) -> int:
        return len(self.shared)

    def of_group(self, group: int) -> list[int]:
        """The namespace of each rank's blocks of `group` (repeated when shared)."""
        return [row[group] for row in self.index]

    def of_rank(self, rank: int) -> list[NamespaceSpec]:
        """Rank `rank`'s namespace of each group (what its worker attaches)."""
        return [self.specs[n] for n in self.index[rank]]

    def writes(self, rank: int, group: int) -> bool:
        """Whether `rank` saves its blocks of `group` (a shared group's: rank 0 only)."""
        return rank == 0 or not self.shared[group]


def engine_namespaces(vllm_config: VllmConfig, groups: list[KVGroup]) -> EngineNamespaces:
    """The engine's namespaces (`rank_namespaces` of each TP rank's `namespace_for`)."""
    parallel = vllm_config.parallel_config
    bases = [namespace_for(vllm_config, rank) for rank in range(parallel.tensor_parallel_size)]
    return rank_namespaces(bases, groups,
                           int(getattr(parallel, "decode_context_parallel_size", 1) or 1))


def rank_namespaces(bases: list[NamespaceSpec], groups: list[KVGroup],
                    dcp_size: int = 1) -> EngineNamespaces:
    """Each TP rank's namespace (`bases`) per group (`namespaces_for`); an MLA group's latent
    KV, identical on every TP rank unless decode context parallelism shards it, in one
    namespace for all ranks."""
    shared = tuple(len(bases) > 1 and dcp_size == 1 and g.attention == "mla" for g in groups)
    ranks = [[dataclasses.replace(spec, tp_rank=0, extra={**spec.extra, "tp_ranks": "shared"})
              if shared[g] else spec
              for g, spec in enumerate(namespaces_for(base, groups))] for base in bases]
    return EngineNamespaces.of(ranks, shared)
