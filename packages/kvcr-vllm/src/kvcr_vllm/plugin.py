"""vLLM plugin entry point (`vllm.general_plugins`): registers `KVCRConnector` by name, so
`--kv-transfer-config '{"kv_connector":"KVCRConnector","kv_role":"kv_both"}'` needs no module
path. Idempotent and lazy (the connector module loads only when vLLM creates it); outside the
supported vLLM versions it refuses with one clear error line and registers nothing.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvcr_vllm")

CONNECTOR_NAME = "KVCRConnector"


def register() -> None:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcr_vllm import SUPPORTED_VLLM

    minor = ".".join(vllm.__version__.split(".")[:2])
    if minor not in SUPPORTED_VLLM:
        log.error("kvcr-vllm supports vLLM %s; this is vLLM %s: KVCRConnector is not "
                  "registered", ", ".join(v + ".x" for v in SUPPORTED_VLLM), vllm.__version__)
        return
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvcr_vllm.connector", CONNECTOR_NAME)
