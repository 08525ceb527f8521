"""``bench/serving.py``'s capacity loads: the tiers sized from the sampled trace's KV, the
share of prompt tokens each place served, and the planner's prediction for a plugin row
(``kvtier plan --trace`` run for real on a small trace)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from unittest import mock

with mock.patch.dict(os.environ):  # the module sets VLLM_CPU_NUM_OF_RESERVED_CPU for its servers
    from bench.serving import capacity_sizes, capacity_table, kv_config, measured_shares

BLOCK = 32
TOKEN_BYTES = 1024


def write_trace(path: Path) -> None:
    """Four requests of 32-token blocks: two conversations, each asked twice."""
    rows = [([1, 2, 3, 4], 0), ([5, 6, 7, 8, 9, 10], 1000), ([1, 2, 3, 4, 11, 12], 2000),
            ([5, 6, 7, 8, 9, 10, 13, 14], 3000)]
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": len(ids) * BLOCK, "output_length": 4,
                                        "hash_ids": ids}) + "\n" for ids, t in rows))


def test_the_tiers_split_the_sampled_traces_kv_in_whole_blocks(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    sizes = capacity_sizes(trace, BLOCK, TOKEN_BYTES, 0.15)
    block_bytes = BLOCK * TOKEN_BYTES
    assert sizes["kv_blocks"] == 14 and sizes["kv_bytes"] == 14 * block_bytes
    # 15% of 14 blocks is 2.1: 2 whole blocks in DRAM, the other 12 on NVMe
    assert (sizes["cpu_blocks"], sizes["nvme_blocks"]) == (2, 12)
    assert sizes["tier_bytes"] + sizes["nvme_bytes"] == sizes["kv_bytes"]


def test_the_nvme_size_reaches_the_plugins_config_and_not_a_config_without_nvme(tmp_path):
    with_nvme = kv_config({"preset": "interactive", "nvme": {"path": "{nvme}", "capacity_bytes": 1}}, tmp_path,
                          tier_bytes=100, nvme_bytes=200)
    assert with_nvme is not None
    extra = with_nvme["kv_connector_extra_config"]
    assert extra["cpu"]["capacity_bytes"] == 100
    assert extra["nvme"] == {"path": str(tmp_path), "capacity_bytes": 200}
    cpu_only = kv_config({"preset": "interactive"}, tmp_path, tier_bytes=100, nvme_bytes=200)
    assert cpu_only is not None and "nvme" not in cpu_only["kv_connector_extra_config"]


def test_shares_are_over_the_prompt_tokens_of_every_round():
    r = {"load": {"input_tokens": 1000, "rounds": 2},
         "counters": {"vllm_hit_tokens": 400.0, "connector_hit_tokens": 320.0, "hit_blocks|cpu": 4.0,
                      "hit_blocks|nvme": 6.0, "hit_blocks|all": 10.0}}
    m = measured_shares(r, BLOCK)
    assert m["gpu"] == 0.2 and m["connector"] == 0.16 and m["total"] == 0.36
    assert m["by_tier"] == {"cpu": 4 * BLOCK / 2000, "nvme": 6 * BLOCK / 2000}


def test_the_planner_predicts_a_plugin_row_and_the_distance_to_the_measured(tmp_path):
    """The real ``kvtier plan --trace`` on the four-request trace with the row's config
    (write-back NVMe, chunks of 16 blocks) and sizes; the peer's row gets no prediction."""
    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    load = {"name": "capacity", "capacity": True, "trace_file": str(trace), "block": BLOCK,
            "input_tokens": 24 * BLOCK, "tier_bytes": 4 * BLOCK * TOKEN_BYTES, "nvme_bytes": 20 * BLOCK * TOKEN_BYTES,
            "cpu_blocks": 4, "nvme_blocks": 20}
    counters = {"vllm_hit_tokens": 0.0, "connector_hit_tokens": 10 * BLOCK, "hit_blocks|cpu": 4.0,
                "hit_blocks|nvme": 6.0}
    results = {"cpu-nvme.capacity": {"config": "cpu-nvme", "load": load, "counters": counters},
               "lmcache.capacity": {"config": "lmcache", "load": load, "counters": counters}}
    table = capacity_table(results, argparse.Namespace(block_size=BLOCK))
    ours = table["cpu-nvme.capacity"]
    # measured: the counters' 10 hit blocks of the 24 prompt blocks
    assert abs(ours["measured"]["total"] - 10 / 24) < 1e-9
    # predicted (the planner's own replay, not recomputed here): 4 DRAM blocks keep neither
    # conversation until its repeat, and the write-back NVMe tier serves 8 of the 10
    # reusable blocks (an unbounded cache: all 10)
    assert ours["predicted"]["by_tier"] == {"cpu": 0.0, "nvme": 8 / 24}
    assert ours["predicted"]["total"] == 8 / 24
    assert ours["predicted_minus_measured"] == ours["predicted"]["total"] - ours["measured"]["total"]
    assert "predicted" not in table["lmcache.capacity"]
