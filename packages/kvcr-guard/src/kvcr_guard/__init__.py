"""kvcr-guard: the daemon that owns the kvcr pool (docs/guard.md). It hosts kvcr-core's attach
server in a process of its own, so the cache outlives engine crashes and is shared by every
engine on the node."""

from kvcr_guard._version import __version__
from kvcr_guard.config import GuardConfig
from kvcr_guard.daemon import GuardDaemon

__all__ = ["GuardConfig", "GuardDaemon", "__version__"]
