"""kvcr-guard: the daemon that owns the kvcr pool (docs/guard.md)."""

from kvcr_guard._version import __version__
from kvcr_guard.config import GuardConfig
from kvcr_guard.server import GuardServer

__all__ = ["GuardConfig", "GuardServer", "__version__"]
