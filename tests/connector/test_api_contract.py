"""The vLLM connector API the plugin relies on. vLLM's connector API changes from release
to release; if an upgrade renames or re-signs one of these methods, this fails loudly
instead of the plugin silently never being called."""

from __future__ import annotations

import inspect

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from vllm_kvtier.connector import KVTierConnector

# method -> its parameter names on KVConnectorBase_V1 (self excluded), as of vLLM 0.32/0.33.
RELIED_ON = {
    "__init__": ["vllm_config", "role", "kv_cache_config"],
    "register_kv_caches": ["kv_caches"],
    "handle_preemptions": ["kv_connector_metadata"],
    "start_load_kv": ["forward_context", "kwargs"],
    "wait_for_layer_load": ["layer_name"],
    "save_kv_layer": ["layer_name", "kv_layer", "attn_metadata", "kwargs"],
    "wait_for_save": [],
    "get_finished": ["finished_req_ids"],
    "get_transfer_results": ["finished_req_ids"],
    "get_block_ids_with_load_errors": [],
    "get_kv_connector_stats": [],
    "shutdown": [],
    "get_num_new_matched_tokens": ["request", "num_computed_tokens"],
    "update_state_after_alloc": ["request", "blocks", "num_external_tokens"],
    "build_connector_meta": ["scheduler_output"],
    "update_connector_output": ["connector_output"],
    "request_finished": ["request", "block_ids"],
    "has_pending_push_work": [],
    "take_events": [],
    "build_kv_connector_stats": ["data"],
    "build_prom_metrics": ["vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"],
}


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]


def test_base_class_still_has_the_methods_we_override():
    missing = [m for m in RELIED_ON if not hasattr(KVConnectorBase_V1, m)]
    assert not missing, f"vLLM's KVConnectorBase_V1 lost: {missing}"
    changed = {m: _params(getattr(KVConnectorBase_V1, m)) for m in RELIED_ON
               if _params(getattr(KVConnectorBase_V1, m)) != RELIED_ON[m]}
    assert not changed, f"vLLM changed these signatures: {changed}"


def test_all_abstract_methods_are_implemented():
    assert not getattr(KVTierConnector, "__abstractmethods__", set())


def test_our_overrides_match_the_base_signatures():
    for m in RELIED_ON:
        ours = getattr(KVTierConnector, m)
        if ours is getattr(KVConnectorBase_V1, m):
            continue
        assert _params(ours) == _params(getattr(KVConnectorBase_V1, m)), m


def test_best_effort_cache_does_not_require_delivery():
    # kv_both defaults to requires_kv_delivery=True in vLLM, which would drop output of
    # preempted requests; a cache must not.
    assert KVTierConnector.requires_kv_delivery.fget(object.__new__(KVTierConnector)) is False


def test_piecewise_cudagraph_follows_the_parsed_config(tmp_path):
    """``layer_pipelined_loads`` read as every other hook reads it: from the parsed config,
    so a value from a config_file (or a preset) counts, not only a raw key."""
    assert KVTierConnector.requires_piecewise_for_cudagraph({}) is True  # default "auto"
    assert KVTierConnector.requires_piecewise_for_cudagraph({"layer_pipelined_loads": "off"}) is False
    off = tmp_path / "kvtier.yaml"
    off.write_text("layer_pipelined_loads: \"off\"\n")
    assert KVTierConnector.requires_piecewise_for_cudagraph({"config_file": str(off)}) is False
    # A preset with a config_file on top: the file's value wins, as in the connector.
    assert KVTierConnector.requires_piecewise_for_cudagraph({"preset": "interactive", "config_file": str(off)}) is False
    on = tmp_path / "on.yaml"
    on.write_text("layer_pipelined_loads: \"on\"\n")
    assert KVTierConnector.requires_piecewise_for_cudagraph({"preset": "interactive", "config_file": str(on)}) is True


def test_sleep_mode_is_refused():
    """vLLM >= 0.33 asks ``supports_sleep_mode`` before it enables sleep mode. The namespace
    digests the weights at start: weights reloaded after a sleep would be served old KV."""
    assert KVTierConnector.supports_sleep_mode(None) is False


def test_a_request_that_reads_no_cache_is_not_followed_under_either_name():
    """vLLM 0.32/0.33 call it ``skip_reading_prefix_cache``, 0.34 ``skip_reading_external_kv``."""
    from types import SimpleNamespace

    from vllm_kvtier.engine.scheduler import followed

    assert followed(SimpleNamespace())
    assert not followed(SimpleNamespace(skip_reading_prefix_cache=True))
    assert not followed(SimpleNamespace(skip_reading_external_kv=True))
