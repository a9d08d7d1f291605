"""SGLang config -> kvcr config, once: `BackendSettings` from the storage backend's (or the
linker's) extra config, and the namespace of one rank's pages from `HiCacheStorageConfig` and
the host pool geometry.

SGLang's own keys in the same mapping (`backend_name`, `module_path`, `class_name`,
`interface_v1`, the prefetch tuning keys) are accepted and ignored; any other unknown key is
an error naming it (a typo must not silently disable the cache). Pure; thread-safe.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from kvcr_core.attach import ENGINE_KEYS, EngineSettings, reject_unknown
from kvcr_core.errors import ConfigError
from kvcr_core.keys import NamespaceSpec

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                         "prefetch_threshold", "prefetch_timeout_base",
                         "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
                         "tp_lcm_size"})
OWN_KEYS = frozenset({"tenant", "model_id"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendSettings(EngineSettings):
    tenant: str = ""
    model_id: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *,
                          field: str = "hicache_storage_backend_extra_config",
                          ) -> BackendSettings:
        extra = dict(extra or {})
        reject_unknown(extra, field, ENGINE_KEYS | OWN_KEYS, ignored=SGLANG_KEYS)
        own: dict[str, Any] = {}
        for name in OWN_KEYS:
            value = extra.get(name, "")
            if not isinstance(value, str):
                raise ConfigError(f"{field}.{name}", value, "give a string")
            own[name] = value
        # One embedded Runner per SGLang process (TP ranks are processes).
        common = cls.fields_from(extra, field=field,
                                 default_socket=f"\0kvcr-sglang-{os.getpid()}")
        return cls(**common, **own)


@dataclasses.dataclass(frozen=True)
class PageGeometry:
    """What the host pool says about one page: bytes and how they are laid out."""

    layout: str
    dtype: str
    page_tokens: int
    num_layers: int
    num_heads: int
    head_dim: int
    page_bytes: int
    pool_kind: str


def namespace_for(storage_config: Any, geometry: PageGeometry,
                  settings: BackendSettings) -> NamespaceSpec:
    """Pages of two ranks share a namespace only if their bytes are interchangeable: same
    model, KV dtype, page size, layout and shard. MLA KV is replicated on every TP rank, so
    all ranks share one namespace (and only the storage writer stores)."""
    replicated = bool(storage_config.is_mla_model)
    extra = {"pp": f"{storage_config.pp_rank}/{storage_config.pp_size}"}
    cp_size = int(getattr(storage_config, "attn_cp_size", 1) or 1)
    if cp_size > 1:
        extra["cp"] = f"{storage_config.attn_cp_rank}/{cp_size}"
    import sglang

    return NamespaceSpec(
        model_id=settings.model_id or str(storage_config.model_name or "sglang-model"),
        dtype=geometry.dtype, kv_dtype=geometry.dtype,
        block_size_tokens=geometry.page_tokens, num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_heads, head_dim=geometry.head_dim,
        layout=f"sglang-{sglang.__version__}/{geometry.pool_kind}/{geometry.layout}",
        tp_size=1 if replicated else int(storage_config.tp_size),
        tp_rank=0 if replicated else int(storage_config.tp_rank),
        tenant=settings.tenant, extra=extra)
