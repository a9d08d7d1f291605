"""The attach protocol: how engines reach a Runner, whoever hosts it.

An engine adapter asks a Runner for what it needs through `RunnerOps` (one typed protocol:
lookups, reservations and leases, peer fetches, hints) and handles one error tree
(`RunnerError`: `RunnerUnavailable`, `RunnerRefused`, `ClientClosed`: carry on without the
cache). `RunnerService` is the one implementation, over a `Runner`; `AttachClient` carries the
same calls over a Unix socket to a `RunnerService` in another process, where an
`AttachServer` (in kvcr-guard, or on a thread of the engine itself: `EmbeddedRunner`) decodes
them. An engine's own embedded Runner is called in-process (`EmbeddedRunner.service`).
Clients map the pool memory they are handed and copy KV in and out themselves.
`EngineSettings` (with its `PeerConfig`) is what every engine adapter parses from its own
config.

This is the package's public API for kvcr-guard and the engine adapters; its submodules are
internals.
"""

from kvcr_core.attach.client import AttachClient
from kvcr_core.attach.config import ServerConfig
from kvcr_core.attach.embedded import EmbeddedRunner
from kvcr_core.attach.hinted_fetch import (
    FetchSummary,
    HintedFetch,
    HintedFetcher,
    HintedRun,
    Skipped,
    hinted_run,
)
from kvcr_core.attach.host import RunnerHost
from kvcr_core.attach.ops import (
    ClientClosed,
    Handle,
    RunnerError,
    RunnerOps,
    RunnerRefused,
    RunnerUnavailable,
)
from kvcr_core.attach.protocol import PROTOCOL_VERSION, FetchOutcome, PoolStats, RefusalReason
from kvcr_core.attach.server import AttachServer
from kvcr_core.attach.service import ClientLimits, RunnerService
from kvcr_core.attach.settings import (
    DEFAULT_SECRET_ENV,
    ENGINE_KEYS,
    EngineSettings,
    Mode,
    PeerConfig,
    reject_unknown,
    secret_from,
)
from kvcr_core.attach.status import probe_status

__all__ = [
    "DEFAULT_SECRET_ENV",
    "ENGINE_KEYS",
    "PROTOCOL_VERSION",
    "AttachClient",
    "AttachServer",
    "ClientClosed",
    "ClientLimits",
    "EmbeddedRunner",
    "EngineSettings",
    "FetchOutcome",
    "FetchSummary",
    "Handle",
    "HintedFetch",
    "HintedFetcher",
    "HintedRun",
    "Mode",
    "PeerConfig",
    "PoolStats",
    "RefusalReason",
    "RunnerError",
    "RunnerHost",
    "RunnerOps",
    "RunnerRefused",
    "RunnerService",
    "RunnerUnavailable",
    "ServerConfig",
    "Skipped",
    "hinted_run",
    "probe_status",
    "reject_unknown",
    "secret_from",
]
