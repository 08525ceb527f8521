"""vllm_kvtier: multi-tier KV cache offloading for vLLM (CPU DRAM, NVMe, object storage,
remote pools).

``import vllm_kvtier`` is cheap and does not import vLLM or torch; the connector lives in
:mod:`vllm_kvtier.connector`.
"""

from __future__ import annotations

__version__ = "0.1.0"

CONNECTOR_NAME = "KVTierConnector"


def register() -> None:
    """``vllm.general_plugins`` entry point: make ``{"kv_connector": "KVTierConnector"}``
    work without ``kv_connector_module_path``. vLLM calls this in every process; calling
    it twice is harmless."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "vllm_kvtier.connector", CONNECTOR_NAME)
