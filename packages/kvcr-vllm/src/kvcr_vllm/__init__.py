"""kvcr-vllm: the kvcr KV connector for vLLM (docs/vllm.md).

Importing this package imports no vLLM: the connector classes live in `kvcr_vllm.connector`
(loaded by vLLM's factory through the plugin or `kv_connector_module_path`).
"""

from kvcr_vllm._version import __version__

SUPPORTED_VLLM = ("0.32",)
"""vLLM minor versions this connector is tested against."""

PREFILL_CAP_SCHEDULER = "kvcr_vllm.prefill_cap.PrefillCapScheduler"
"""vLLM's `--scheduler-cls` for kvcr's prefill-cap rule (kvcr_vllm.prefill_cap)."""

__all__ = ["PREFILL_CAP_SCHEDULER", "SUPPORTED_VLLM", "__version__"]
