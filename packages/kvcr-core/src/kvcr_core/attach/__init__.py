"""The attach protocol: how engines reach a Runner, whoever hosts it.

A Runner is served over a Unix socket by an `AttachServer`: in kvcr-guard (guarded mode) or on
a thread of the engine itself (`EmbeddedRunner`, embedded mode). An engine's processes attach
with an `AttachClient`, map the pool memory it passes them and copy KV in and out themselves;
the same code path serves both modes. `EngineSettings` (with its `PeerConfig`) is what every
engine adapter parses from its own config.

This is the package's public API for kvcr-guard and the engine adapters; its submodules are
internals.
"""

from kvcr_core.attach.client import AttachClient, RunnerUnavailable
from kvcr_core.attach.compound import Handle, Pending
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
from kvcr_core.attach.protocol import PROTOCOL_VERSION
from kvcr_core.attach.server import AttachServer
from kvcr_core.attach.session import ClientLimits
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
    "ClientLimits",
    "EmbeddedRunner",
    "EngineSettings",
    "FetchSummary",
    "Handle",
    "HintedFetch",
    "HintedFetcher",
    "HintedRun",
    "Mode",
    "PeerConfig",
    "Pending",
    "RunnerUnavailable",
    "ServerConfig",
    "Skipped",
    "hinted_run",
    "probe_status",
    "reject_unknown",
    "secret_from",
]
