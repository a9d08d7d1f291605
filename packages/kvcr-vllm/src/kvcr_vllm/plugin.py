"""vLLM plugin entry point (`vllm.general_plugins`): registers `KVCRConnector` by name, so
`--kv-transfer-config '{"kv_connector":"KVCRConnector","kv_role":"kv_both"}'` needs no module
path, and routes kvcr's log lines (`kvcr_vllm`, `kvcr_core`) to vLLM's own log handler, so
they carry vLLM's time, level and process prefix and follow its level.

vLLM calls `register` in every process it starts (API server, engine core, workers) and does
not catch what it raises, so registering never fails vLLM for an engine that does not use
kvcr: outside the supported vLLM versions the name is registered to a stand-in whose
construction raises the error docs/vllm.md promises (which versions, what to do), instead of
vLLM's "unknown connector". Idempotent and lazy (the connector module loads only when vLLM
creates one).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvcr_vllm")

CONNECTOR_NAME = "KVCRConnector"
KVCR_LOGGERS = ("kvcr_vllm", "kvcr_core")


def register() -> None:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcr_vllm import supports_vllm

    follow_vllm_logging()
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    module = "kvcr_vllm.connector" if supports_vllm(vllm.__version__) else "kvcr_vllm.unsupported"
    KVConnectorFactory.register_connector(CONNECTOR_NAME, module, CONNECTOR_NAME)


class _ThroughVllm(logging.Handler):
    """Hands kvcr's records to the `vllm` logger's handlers once vLLM configured its logging
    (its format, level and stream, whenever that happens); before, or when vLLM leaves logging
    alone, to the root logger's, as if kvcr's loggers propagated."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger("vllm")
        if vllm_logger.handlers:
            if vllm_logger.isEnabledFor(record.levelno):
                vllm_logger.handle(record)
            return
        root = logging.getLogger()
        if root.handlers:
            root.handle(record)
        elif record.levelno >= logging.WARNING and logging.lastResort is not None:
            logging.lastResort.handle(record)


_THROUGH_VLLM = _ThroughVllm()


def follow_vllm_logging() -> None:
    """kvcr's loggers write through vLLM's handler, at vLLM's level (`VLLM_LOGGING_LEVEL`)."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    for name in KVCR_LOGGERS:
        target = logging.getLogger(name)
        if _THROUGH_VLLM not in target.handlers:
            target.addHandler(_THROUGH_VLLM)
        if level in logging.getLevelNamesMapping():
            target.setLevel(level)
        target.propagate = False
