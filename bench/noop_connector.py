"""A KV connector that does nothing: what vLLM's connector plumbing costs by itself.

``bench/serving.py --configs noop`` runs it as a reference row: the plugin over this row is
the plugin's own cost; this row over the baseline is what any connector costs in vLLM
(its scheduler and worker take other paths once a connector is configured)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NoopConnector(KVConnectorBase_V1):
    """Every method returns at once; nothing is ever loaded or saved."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
