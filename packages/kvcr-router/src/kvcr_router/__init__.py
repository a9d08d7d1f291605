"""kvcr-router: KV-aware routing with fetch credit (packages/kvcr-router/README.md)."""

from kvcr_router._version import __version__

__all__ = ["__version__"]
