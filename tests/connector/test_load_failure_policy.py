"""The engine warns at start when ``kv_load_failure_policy`` is not ``recompute``: under
vLLM's default (``fail``) a block the plugin cannot load fails its request."""

from __future__ import annotations

import logging

import pytest

from tests.sched_helpers import block_bytes, make_scheduler, make_vllm_config

CPU = {"cpu": {"capacity_bytes": 16 * block_bytes()}}


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_policy_other_than_recompute_is_warned_about(tiny_model, caplog, policy):
    cfg = make_vllm_config(tiny_model, CPU)
    cfg.kv_transfer_config.kv_load_failure_policy = policy
    with caplog.at_level(logging.WARNING, logger="vllm_kvtier"):
        make_scheduler(cfg)
    warned = [r.getMessage() for r in caplog.records if "kv_load_failure_policy is" in r.getMessage()]
    if policy == "recompute":
        assert warned == []
    else:
        assert len(warned) == 1 and "'fail'" in warned[0] and '"recompute"' in warned[0]
