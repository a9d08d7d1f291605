"""kvcr for SGLang: HiCache storage backend (`hicache`) and unified-cache linker (`linker`)."""

from kvcr_sglang._version import __version__

__all__ = ["__version__"]
