"""kvcr-core: the engine-neutral KV Cache Runner (pool, index, eviction, hints, keys, metrics),
the attach protocol (`kvcr_core.attach`) and peers (`kvcr_core.peers`).

The public API for other packages: this package root, `kvcr_core.attach`, `kvcr_core.peers`,
`kvcr_core.testing` and the modules `config`, `errors`, `hints`, `keys`, `types` (an import
contract checks it). Importing it loads no engine, torch or nixl (checked by
`test_import_kvcr_core_pulls_no_engine_or_heavy_dependency` in kvcr-core's tests).
"""

from kvcr_core._version import __version__
from kvcr_core.config import KVCRConfig, MemoryBacking, load_config
from kvcr_core.errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    HintRejected,
    HintRejectReason,
    KVCRError,
    UnknownNamespaceError,
)
from kvcr_core.eviction import ARCPolicy, EvictionPolicy, LRUPolicy, resolve_policy
from kvcr_core.hints import FetchAction, HintIntake, HintLimits, KVHint, parse_hint
from kvcr_core.index import BlockIndex, Lease, Reservation
from kvcr_core.keys import NamespaceSpec, block_keys, namespace_digest, router_hashes
from kvcr_core.memory import HostRegion, RegionKind, SlotPool
from kvcr_core.metrics import RunnerMetrics
from kvcr_core.runner import NamespaceStore, Runner
from kvcr_core.types import BlockKey, NamespaceDigest, OpId, OwnerId, RouterHash, SlotId, SlotState

__all__ = [
    "ARCPolicy",
    "BlockIndex",
    "BlockKey",
    "CapacityError",
    "ClosedError",
    "ConfigError",
    "EvictionPolicy",
    "FetchAction",
    "HintIntake",
    "HintLimits",
    "HintRejectReason",
    "HintRejected",
    "HostRegion",
    "KVCRConfig",
    "KVCRError",
    "KVHint",
    "LRUPolicy",
    "Lease",
    "MemoryBacking",
    "NamespaceDigest",
    "NamespaceSpec",
    "NamespaceStore",
    "OpId",
    "OwnerId",
    "RegionKind",
    "Reservation",
    "RouterHash",
    "Runner",
    "RunnerMetrics",
    "SlotId",
    "SlotPool",
    "SlotState",
    "UnknownNamespaceError",
    "__version__",
    "block_keys",
    "load_config",
    "namespace_digest",
    "parse_hint",
    "resolve_policy",
    "router_hashes",
]
