"""kvcr-vllm: the kvcr KV connector for vLLM (docs/vllm.md).

Importing this package imports no vLLM: the connector classes live in `kvcr_vllm.connector`
(loaded by vLLM's factory through the plugin or `kv_connector_module_path`).
"""

from kvcr_vllm._version import __version__

SUPPORTED_VLLM = ("0.32",)
"""vLLM minor versions this connector is tested against."""

__all__ = ["SUPPORTED_VLLM", "__version__"]
