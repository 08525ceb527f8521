"""Per-request load histograms: ``vllm:kvtier_request_load_wait_seconds`` (by the slowest
tier a load read) and ``vllm:kvtier_request_loaded_blocks`` (by tier).

From the scheduler half (fake requests, real lower-tier planners), through
``KVTierStats``, to a real engine's ``llm.get_metrics()``.
"""

from __future__ import annotations

import random
import time

import pytest
from vllm.v1.metrics.reader import Histogram
from vllm.v1.outputs import KVConnectorOutput

from tests.conftest import close_llm, generate, kvtier_config, make_llm, rand_tokens
from tests.connector.test_scheduler_nvme import BS, FakeRequest, _Out, key, make_two_tiers
from vllm_kvtier.config import parse_config
from vllm_kvtier.connector.scheduler import SchedulerHalf
from vllm_kvtier.connector.stats import KVTierStats
from vllm_kvtier.engine.scheduler import GroupedPlanner, PlannerSetup
from vllm_kvtier.metrics import Counters, HistogramName

WAIT = "request_load_wait_seconds"
BLOCKS = "request_loaded_blocks"


def observations(half: SchedulerHalf) -> dict[str, list[float]]:
    data = half.planner.stats() or {}
    return data.get("histograms", {})


# ---- Counters and KVTierStats ----------------------------------------------------------


def test_counters_observe_drains_each_observation_once():
    c = Counters()
    c.observe(WAIT, "s3", 0.5)
    c.observe(WAIT, "s3", 1.5)
    c.observe(BLOCKS, "cpu", 4)
    data = c.drain()
    assert data == {"counters": {}, "gauges": {}, "histograms": {f"{WAIT}|s3": [0.5, 1.5], f"{BLOCKS}|cpu": [4]}}
    assert c.drain() is None
    c.add("blocks_loaded", "cpu", 2)
    assert "histograms" not in (c.drain() or {})  # no observations: no section


def test_stats_aggregate_concatenates_observations_and_reduce_counts_them():
    a = KVTierStats({"counters": {"blocks_loaded|cpu": 2}, "gauges": {}})  # an older worker: no section
    assert a.data["histograms"] == {} and not a.is_empty()
    b_data = {"counters": {}, "gauges": {}, "histograms": {f"{WAIT}|nvme": [0.25], f"{BLOCKS}|cpu": [3]}}
    c_data = {"counters": {}, "gauges": {}, "histograms": {f"{WAIT}|nvme": [0.5]}}
    b, c = KVTierStats(b_data), KVTierStats(c_data)
    assert not KVTierStats({"counters": {}, "gauges": {}, "histograms": {f"{WAIT}|s3": [0.1]}}).is_empty()
    a.aggregate(b).aggregate(c)
    assert a.data["histograms"] == {f"{WAIT}|nvme": [0.25, 0.5], f"{BLOCKS}|cpu": [3]}
    assert b_data["histograms"][f"{WAIT}|nvme"] == [0.25]  # the other side is not modified
    reduced = a.reduce()
    assert reduced[f"{WAIT}_nvme_count"] == 2 and reduced[f"{WAIT}_nvme_sum"] == 0.75
    assert reduced[f"{BLOCKS}_cpu_count"] == 1 and reduced["blocks_loaded_cpu"] == 2
    a.reset()
    assert a.is_empty() and a.data["histograms"] == {}


def test_declared_buckets():
    assert HistogramName(WAIT).buckets[0] == 0.001 and HistogramName(WAIT).buckets[-1] == 30
    assert HistogramName(BLOCKS).buckets == tuple(float(2**i) for i in range(13))
    for m in HistogramName:
        assert list(m.buckets) == sorted(set(m.buckets))


# ---- the scheduler half ----------------------------------------------------------------


def cpu_only(load_mode: str, keys: int) -> SchedulerHalf:
    half = SchedulerHalf(GroupedPlanner(parse_config({"load_mode": load_mode}), PlannerSetup(BS, 16, 4096)))
    for i in range(keys):
        half.planner.index.allocate(key(i))
    half.planner.stats()  # drop what setting up counted
    return half


def test_sync_cpu_load_counts_its_blocks_and_zero_wait():
    half = cpu_only("sync", keys=4)
    req = FakeRequest("r", [key(i) for i in range(5)], num_prompt_tokens=4 * BS + 1)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
    half.planner.update_state_after_alloc(req, [10, 11, 12, 13, 14], 4 * BS)
    assert observations(half) == {f"{BLOCKS}|cpu": [4], f"{WAIT}|cpu": [0.0]}
    half.build_connector_meta(_Out({"r": 1}))
    half.update_connector_output(KVConnectorOutput())
    assert observations(half) == {}


def test_no_load_no_observation():
    half = cpu_only("sync", keys=0)
    req = FakeRequest("r", [key(i) for i in range(5)], num_prompt_tokens=4 * BS + 1)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (0, False)
    half.planner.update_state_after_alloc(req, [10, 11, 12, 13, 14], 0)
    assert observations(half) == {}


def test_async_cpu_load_waits_until_finished_recving():
    half = cpu_only("async", keys=3)
    req = FakeRequest("r", [key(i) for i in range(4)], num_prompt_tokens=3 * BS + 1)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    half.planner.update_state_after_alloc(req, [10, 11, 12, 13], 3 * BS)
    assert observations(half) == {f"{BLOCKS}|cpu": [3]}  # no wait yet: the load runs
    half.build_connector_meta(_Out({}))
    time.sleep(0.05)
    half.update_connector_output(KVConnectorOutput())  # a step without the load done
    assert observations(half) == {}
    half.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
    (wait,) = observations(half)[f"{WAIT}|cpu"]
    assert 0.05 <= wait < 5


def test_load_from_three_tiers_is_labelled_by_the_slowest(tmp_path):
    """Blocks 0-1 on NVMe, 2-3 on S3, 4-5 in DRAM: one async load reading all three."""
    half = make_two_tiers(tmp_path, num_slots=8)
    half.planner.lower_tier("nvme").index.add_existing("n0", [key(0), key(1)], 3 * 4096)
    half.planner.lower_tier("s3").index.add_existing("o0", [key(2), key(3)], 3 * 4096)
    for i in (4, 5):
        half.planner.index.allocate(key(i))
    half.planner.stats()
    req = FakeRequest("r", [key(i) for i in range(7)], num_prompt_tokens=6 * BS + 1)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (6 * BS, True)
    half.planner.update_state_after_alloc(req, list(range(10, 17)), 6 * BS)
    assert observations(half) == {f"{BLOCKS}|cpu": [2], f"{BLOCKS}|nvme": [2], f"{BLOCKS}|s3": [2]}
    half.build_connector_meta(_Out({}))
    time.sleep(0.02)
    half.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
    got = observations(half)
    assert list(got) == [f"{WAIT}|s3"] and got[f"{WAIT}|s3"][0] >= 0.02
    half.update_connector_output(KVConnectorOutput(finished_recving={"r"}))  # reported twice: once
    assert observations(half) == {}


def test_nvme_and_cpu_load_is_labelled_nvme(tmp_path):
    half = make_two_tiers(tmp_path, num_slots=8)
    half.planner.lower_tier("nvme").index.add_existing("n0", [key(1)], 2 * 4096)
    half.planner.index.allocate(key(0))
    half.planner.stats()
    req = FakeRequest("r", [key(i) for i in range(3)], num_prompt_tokens=2 * BS + 1)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    half.planner.update_state_after_alloc(req, [10, 11, 12], 2 * BS)
    assert observations(half) == {f"{BLOCKS}|cpu": [1], f"{BLOCKS}|nvme": [1]}
    half.build_connector_meta(_Out({}))
    half.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
    assert list(observations(half)) == [f"{WAIT}|nvme"]


def test_request_aborted_during_async_load_still_reports_its_wait():
    half = cpu_only("async", keys=2)
    req = FakeRequest("r", [key(i) for i in range(3)], num_prompt_tokens=2 * BS + 1)
    half.planner.get_num_new_matched_tokens(req, 0)
    half.planner.update_state_after_alloc(req, [10, 11, 12], 2 * BS)
    half.planner.stats()
    req.num_computed_tokens = 2 * BS
    assert half.planner.request_finished(req, [10, 11, 12]) == (False, None)
    half.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
    assert list(observations(half)) == [f"{WAIT}|cpu"]


# ---- a real engine ---------------------------------------------------------------------


def kvtier_histograms(llm) -> dict[tuple[str, str], Histogram]:
    """``{(metric, tier): Histogram}`` from vLLM's metrics reader."""
    out: dict[tuple[str, str], Histogram] = {}
    for m in llm.get_metrics():
        if isinstance(m, Histogram) and m.name.startswith("vllm:kvtier_"):
            k = (m.name.removeprefix("vllm:kvtier_"), m.labels["tier"])
            assert k not in out, f"{k} twice: {m.labels}"
            assert {"model_name", "engine"} <= set(m.labels), m.labels
            out[k] = m
    return out


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_engine_reports_one_load_per_repeat(tiny_model, load_mode):
    prompt = rand_tokens(random.Random(7), 320)
    llm = make_llm(tiny_model, kvtier_config({"load_mode": load_mode}))
    try:
        first = generate(llm, prompt, 8)
        assert first.loaded == 0
        hists = kvtier_histograms(llm)
        assert all(h.count == 0 for h in hists.values()), "observations before any load"
        repeat = generate(llm, prompt, 8)
        hists = kvtier_histograms(llm)
    finally:
        close_llm(llm)
    assert repeat.loaded > 0
    observed = {k for k, h in hists.items() if h.count}
    assert observed == {(WAIT, "cpu"), (BLOCKS, "cpu")}
    blocks = hists[(BLOCKS, "cpu")]
    assert blocks.count == 1 and blocks.sum == repeat.loaded  # TP=1: the worker's blocks_loaded
    wait = hists[(WAIT, "cpu")]
    assert wait.count == 1 and wait.buckets["+Inf"] == 1
    if load_mode == "sync":
        assert wait.sum == 0 and wait.buckets["0.001"] == 1
    else:  # parked until a later step reported it in finished_recving
        assert 0 < wait.sum < 30
