"""kvcr-vllm: the kvcr KV connector for vLLM (docs/vllm.md).

Importing this package imports no vLLM: the connector classes live in `kvcr_vllm.connector`
(loaded by vLLM's factory through the plugin or `kv_connector_module_path`).
"""

from kvcr_vllm._version import __version__

SUPPORTED_VLLM = ("0.32",)
"""vLLM minor versions this connector is tested against."""
SUPPORTED_VLLM_TEXT = ", ".join(f"{minor}.x" for minor in SUPPORTED_VLLM)


def supports_vllm(version: str) -> bool:
    """Whether vLLM `version` (e.g. "0.32.0") is a minor version kvcr-vllm is tested with."""
    return ".".join(version.split(".")[:2]) in SUPPORTED_VLLM


PREFILL_CAP_SCHEDULER = "kvcr_vllm.prefill_cap.PrefillCapScheduler"
"""vLLM's `--scheduler-cls` for kvcr's prefill-cap rule (kvcr_vllm.prefill_cap)."""

__all__ = ["PREFILL_CAP_SCHEDULER", "SUPPORTED_VLLM", "SUPPORTED_VLLM_TEXT", "__version__",
           "supports_vllm"]
