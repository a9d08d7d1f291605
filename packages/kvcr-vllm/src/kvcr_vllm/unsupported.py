"""The stand-in `KVCRConnector` registered under vLLM versions kvcr-vllm does not support:
constructing it raises the one clear error (which versions, what to do). Imports no vLLM
module, so it loads whatever vLLM's API looks like."""

from __future__ import annotations

from typing import Any


class KVCRConnector:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import vllm

        from kvcr_vllm import SUPPORTED_VLLM_TEXT

        raise RuntimeError(
            f"kvcr-vllm {_version()} supports vLLM {SUPPORTED_VLLM_TEXT};"
            f" this is vLLM {vllm.__version__}. Run a supported vLLM, install kvcr-vllm from a "
            "revision of this repository that supports this one (it is not on PyPI: "
            "pip install ./packages/kvcr-vllm in a clone of https://github.com/kvcr-project/kvcr), "
            "or remove KVCRConnector from --kv-transfer-config.")


def _version() -> str:
    from kvcr_vllm import __version__

    return __version__
