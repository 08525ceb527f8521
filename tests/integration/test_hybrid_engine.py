"""Hybrid models end to end on real vLLM engines with the hybrid KV cache manager ON: a
small random-weight Llama whose layers alternate sliding-window (64 tokens) and full
attention. The reuse scenario's tokens equal a run without the plugin, both groups'
units are loaded, a sliding group stores only its windows, NVMe serves both groups
after a restart, and a failed load is recomputed per request."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    BLOCK_SIZE,
    assert_same_tokens,
    close_llm,
    generate,
    kvtier_config,
    kvtier_counters,
    make_llm,
    rand_tokens,
    reuse_scenario,
    run_scenario,
)
from tests.integration.test_nvme_engine import ROOT, results, run_engine, run_process

WINDOW = 64  # tokens: a hit of m blocks needs the sliding group's blocks [m-2, m)
LAYERS = 4  # sliding, full, sliding, full: two groups of two layers sharing two tensors
SLOT_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4  # two distinct tensors x heads x block x 2*head x fp32
NVME_PROMPTS = [rand_tokens(random.Random(20 + i), 330) for i in range(2)]


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from testkit.tinymodel import build_model

    return build_model(tmp_path_factory.mktemp("models") / "hybrid", "tiny", dtype="float32",
                       sliding_window=WINDOW, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def hybrid_baseline(hybrid_model):
    """The reuse scenario and the NVMe prompts on an engine without the plugin."""
    llm = make_llm(hybrid_model, None)
    try:
        return run_scenario(llm, reuse_scenario()), [generate(llm, p).tokens for p in NVME_PROMPTS]
    finally:
        close_llm(llm)


def engine_core(llm):
    return llm.llm_engine.engine_core.engine_core


def assert_hybrid_manager_on(llm) -> None:
    core = engine_core(llm)
    assert core.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    groups = core.scheduler.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec", "FullAttentionSpec"]


def test_reuse_scenario_with_the_hybrid_manager_on(hybrid_model, hybrid_baseline):
    llm = make_llm(hybrid_model, kvtier_config())
    try:
        assert_hybrid_manager_on(llm)
        got = run_scenario(llm, reuse_scenario())
        counters = kvtier_counters(llm)
        half = engine_core(llm).scheduler.connector.scheduler_half
        loaded_per_group = list(half.planner.group_loaded_blocks)
        stored_per_group = half.planner.stored_units_per_group()
    finally:
        close_llm(llm)
    assert_same_tokens(hybrid_baseline[0], got)
    # Repeat: 9 full blocks + the window [7, 9); shared prefix: the same; turn 2: 11 + [9, 11).
    assert [got[n].loaded for n in ("first", "repeat", "shared_prefix", "unrelated", "turn2")] == [0, 11, 11, 0, 13]
    assert loaded_per_group == [6, 29]  # sliding, full: units of both groups were loaded
    assert counters["blocks_loaded|cpu"] == counters["hit_blocks|cpu"] == 35
    # Lookups count the units a whole hit would load (a sliding group: its window), so a
    # repeat reads as a 100% hit: 9 + 2, 9 + 2, 10 + 2, 2 + 2, 12 + 2.
    assert counters["lookup_blocks|cpu"] == 11 + 11 + 12 + 4 + 14
    # The sliding group stores the windows before the boundaries only: the first prompt's
    # [7, 10) and its answer's [9, 11), the shared prefix's block 9, the unrelated
    # prompt's [0, 2), turn 2's block 11: 8 units; the full group every block: 15.
    assert stored_per_group == [8, 15]
    assert counters["usage_bytes|cpu"] == sum(stored_per_group) * SLOT_BYTES


def test_restart_serves_both_groups_from_nvme(hybrid_model, hybrid_baseline, tmp_path):
    """Engine 1 stores both groups (write-through); engine 2, in a process of its own, loads
    them from NVMe. Engine 1 runs in this process: write-through has written every block
    before it stops (the exit flush is the default config's restart test's subject)."""
    kv = kvtier_config({"cpu": {"capacity_bytes": 64 * SLOT_BYTES},
                        "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 64 * 2**20, "admit_min_seen": 1,
                                 "chunk_blocks": 4, "mode": "write-through"}})
    run_engine(hybrid_model, kv, NVME_PROMPTS)
    data = run_process(hybrid_model, kv, NVME_PROMPTS, tmp_path)
    for r, base in zip(results(data), hybrid_baseline[1], strict=True):
        assert r.tokens == base
    # Each prompt: 10 full-group units and the sliding window [8, 10), all from NVMe.
    assert data["counters"].get("blocks_loaded|nvme", 0) == 2 * (10 + 2)


def test_failed_loads_are_recomputed_per_request(hybrid_model, hybrid_baseline):
    llm = make_llm(hybrid_model, kvtier_config({"fault_injection": {"load_error_rate": 1.0}}))
    try:
        got = run_scenario(llm, reuse_scenario())
        counters = kvtier_counters(llm)
    finally:
        close_llm(llm)
    assert_same_tokens(hybrid_baseline[0], got)
    assert counters["load_failures|cpu"] > 0


def test_a_state_space_model_is_refused_at_start(tmp_path_factory):
    """Mamba layers keep a recurrent state, not KV rows: the engine does not start, and
    the error names the layer type, a layer and what to do. (In a process of its own: an
    engine that failed half-way through its start is not left in this one.)"""
    from testkit.tinymodel import build_mamba_model

    model = build_mamba_model(tmp_path_factory.mktemp("models") / "mamba")
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-m", "tests.engine_run", str(model), json.dumps(kvtier_config())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert re.search(r"layer backbone\.layers\.\d+\.mixer keeps MambaSpec state .*OffloadingConnector",
                     proc.stderr), proc.stderr[-3000:]


def test_loads_continue_after_vllms_own_prefix_cache_hit(hybrid_model, hybrid_baseline):
    """vLLM's prefix cache on, in a KV cache small enough that it loses blocks between
    requests: a load starts where its own hit ends (in every group), twice round."""
    llm = make_llm(hybrid_model, kvtier_config(), enable_prefix_caching=True, kv_cache_memory_bytes=10 * 2**20)
    try:
        first = run_scenario(llm, reuse_scenario())
        again = run_scenario(llm, reuse_scenario())
        counters = kvtier_counters(llm)
    finally:
        close_llm(llm)
    assert_same_tokens(hybrid_baseline[0], first)
    assert_same_tokens(hybrid_baseline[0], again)
    assert counters["blocks_loaded|cpu"] > 0
