"""Load or recompute: the cost model (pure) and the scheduler's use of it (no engine)."""

from __future__ import annotations

from vllm_kvtier.catalog.base import Listing
from vllm_kvtier.config import parse_config
from vllm_kvtier.connector.scheduler import SchedulerHalf
from vllm_kvtier.engine.scheduler import GroupedPlanner, PlannerSetup
from vllm_kvtier.index.cost import CostModel
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext

MB = 1e6
BS = 32


def test_fast_tier_loads_everything_slow_tier_recomputes():
    m = CostModel(prefill_tokens_per_s=10_000)
    m.tier("nvme").set_prior(0.0005, 2000 * MB)
    m.tier("s3").set_prior(0.5, 10 * MB)
    for t in ("nvme", "s3"):
        m.tier(t).last_sample_s = 0.0  # fresh estimates: no probe
    fast = m.decide(["cpu"] * 2 + ["nvme"] * 8, 1 << 20, BS, now=1.0)
    assert fast.load_blocks == 10 and fast.recomputed == {}
    # 8 blocks of 1 MiB from s3: 0.5 s + 0.84 s to load vs 8*32/10000 = 0.026 s to compute.
    slow = m.decide(["cpu"] * 2 + ["s3"] * 8, 1 << 20, BS, now=1.0)
    assert slow.load_blocks == 2 and slow.recomputed == {"s3": 8}
    assert slow.load_s < slow.recompute_s + 1e-9


def test_loads_the_prefix_that_wins_when_tiers_mix():
    m = CostModel(prefill_tokens_per_s=1000)
    m.tier("nvme").set_prior(0.001, 1000 * MB)
    m.tier("s3").set_prior(5.0, 1 * MB)
    for t in ("nvme", "s3"):
        m.tier(t).last_sample_s = 0.0
    d = m.decide(["nvme"] * 4 + ["s3"] * 4, 64 << 10, BS, now=1.0)
    assert d.load_blocks == 4 and d.recomputed == {"s3": 4}


def test_estimates_follow_samples_and_stale_tiers_are_probed_once():
    m = CostModel(prefill_tokens_per_s=10_000, probe_interval_s=30)
    for _ in range(20):  # requests' loads of 1 MB take 1 s
        m.observe_load("s3", nbytes=MB, seconds=1.0, now=100.0)
    # Reads of one size alone cannot split latency from bandwidth, but the fit predicts
    # the time of that size.
    assert abs(m.tier("s3").load_s(int(MB)) - 1.0) < 0.1
    for _ in range(20):
        m.observe_prefill(tokens=2000, seconds=1.0)
    assert abs(m.prefill_tokens_per_s - 2000) < 50
    assert m.decide(["s3"] * 4, MB, BS, now=110.0).load_blocks == 0  # measured recently: recompute
    probe = m.decide(["s3"] * 4, MB, BS, now=200.0)  # 100 s without a sample: probe once
    assert probe.probe and probe.load_blocks == 4
    assert m.decide(["s3"] * 4, MB, BS, now=201.0).load_blocks == 0  # not a probe storm


def test_latency_and_bandwidth_are_fitted_separately_from_reads_of_several_sizes():
    """Known triples (size, duration = latency + size / bandwidth): both figures come back.
    The old estimator took all of the latency as slowness: small reads made a tier with
    30 ms latency and 200 MB/s look like ~15 MB/s."""
    m = CostModel()
    latency, bandwidth = 0.030, 200 * MB
    for i in range(60):
        size = (64 << 10) * (1 + i % 8)  # 64 KiB .. 512 KiB: small reads, latency-dominated
        m.observe_load("s3", nbytes=size, seconds=latency + size / bandwidth, now=float(i))
    est = m.tier("s3")
    assert abs(est.latency_s - latency) < 0.1 * latency, est.latency_s
    assert abs(est.bandwidth_Bps - bandwidth) < 0.1 * bandwidth, est.bandwidth_Bps
    # ... and a big read is predicted at the tier's bandwidth, not at the small reads' rate.
    assert abs(est.load_s(64 << 20) - (latency + (64 << 20) / bandwidth)) < 0.05


def test_few_samples_stay_near_the_prior_and_noise_is_bounded():
    m = CostModel()
    m.tier("nvme").set_prior(0.001, 1000 * MB)
    m.observe_load("nvme", nbytes=4 << 20, seconds=0.005, now=1.0)  # one read: 4 MiB in 5 ms
    est = m.tier("nvme")
    assert 0 <= est.latency_s < 0.005 and est.bandwidth_Bps > 500 * MB
    # A burst of slow samples (a stalled disk) moves the estimate; it decays back after.
    for i in range(30):
        m.observe_load("nvme", nbytes=4 << 20, seconds=0.5, now=2.0 + i)
    slow = est.load_s(4 << 20)
    assert slow > 0.3
    for i in range(150):
        m.observe_load("nvme", nbytes=(1 + i % 4) << 20, seconds=0.001 + ((1 + i % 4) << 20) / (1000 * MB),
                       now=40.0 + i)
    assert est.load_s(4 << 20) < 0.05 < slow


def test_a_decision_reports_when_a_tier_flips_between_load_and_recompute():
    m = CostModel(prefill_tokens_per_s=10_000)
    m.tier("s3").set_prior(0.5, 10 * MB)
    m.tier("s3").last_sample_s = 0.0
    first = m.decide(["s3"] * 8, 1 << 20, BS, now=1.0)
    assert first.load_blocks == 0 and first.changed == ("s3",)
    assert m.decide(["s3"] * 8, 1 << 20, BS, now=2.0).changed == ()  # same verdict: nothing to log
    m.tier("s3").set_prior(0.0005, 5000 * MB)
    m.tier("s3").last_sample_s = 2.0
    flipped = m.decide(["s3"] * 8, 1 << 20, BS, now=3.0)
    assert flipped.load_blocks == 8 and flipped.changed == ("s3",)


def _key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "big"))


class _Req:
    def __init__(self, n_blocks: int) -> None:
        self.request_id = "r"
        self.block_hashes = [_key(i) for i in range(n_blocks + 1)]
        self.num_prompt_tokens = n_blocks * BS + 1
        self.num_computed_tokens = 0


def test_scheduler_recomputes_blocks_of_a_slow_tier_and_counts_them():
    counters = Counters()
    s3 = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 16, None), PlannerContext(1, 1 << 20, counters), Listing([{}]))
    s3.index.add_existing("o", [_key(i) for i in range(2, 8)], 7 << 20)
    cfg = parse_config({"load_or_recompute": {"prefill_tokens_per_s": 10_000}})
    half = SchedulerHalf(GroupedPlanner(cfg, PlannerSetup(BS, 16, 1 << 20), lower=[s3], counters=counters))
    for i in range(2):
        half.planner.index.allocate(_key(i))
    est = half.planner.extras.load_policy.cost.tier("s3")
    est.set_prior(2.0, 1 * MB)
    est.last_sample_s = 1e18  # slow, freshly measured
    req = _Req(8)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (2 * BS, False)  # only the DRAM blocks, sync
    half.planner.update_state_after_alloc(req, list(range(9)), 2 * BS)
    assert counters.totals["recompute_chosen_blocks|s3"] == 6

    off = parse_config({"load_or_recompute": {"enabled": False}})
    half2 = SchedulerHalf(GroupedPlanner(off, PlannerSetup(BS, 16, 1 << 20), lower=[s3], counters=Counters()))
    for i in range(2):
        half2.planner.index.allocate(_key(i))
    assert half2.planner.get_num_new_matched_tokens(req, 0) == (8 * BS, True)  # always load: everything, async


def test_the_scheduler_logs_a_decision_once_per_change(caplog):
    """The decision and its inputs are logged at INFO when a tier's verdict flips, not per
    request (an operator sees why blocks are recomputed without a line per request)."""
    import logging

    from vllm_kvtier.plan.load_policy import LoadPolicy

    m = CostModel(prefill_tokens_per_s=10_000)
    m.tier("s3").set_prior(0.5, 10 * MB)
    m.tier("s3").last_sample_s = 1e18
    policy = LoadPolicy(m, Counters(), block_bytes=1 << 20, block_size=BS, lower_tiers=["s3"])
    with caplog.at_level(logging.INFO, logger="vllm_kvtier.plan.load_policy"):
        for i in range(5):
            assert policy.decide(f"r{i}", ["s3"] * 8) == 0
    lines = [r.getMessage() for r in caplog.records if "load or recompute" in r.getMessage()]
    assert len(lines) == 1 and "s3 now recomputes" in lines[0] and "500.0 ms" in lines[0], lines


def test_a_pinned_prefill_rate_is_not_remeasured():
    """``measure_prefill: false``: the configured rate stays, however long steps take
    (without it, the same slow steps lower the estimate); false without a rate is refused."""
    import time

    import pytest

    from vllm_kvtier.errors import ConfigError
    from vllm_kvtier.plan.load_policy import LoadPolicy

    def after_slow_steps(measure: bool) -> float:
        policy = LoadPolicy(CostModel(prefill_tokens_per_s=10_000), Counters(), block_bytes=1 << 20,
                            block_size=BS, lower_tiers=["s3"], measure_prefill=measure)
        for _ in range(3):
            policy.observe_step(1000)
            time.sleep(0.2)  # 1000 tokens per 0.2 s or more: at most 5000 tokens/s
        return policy.cost.prefill_tokens_per_s

    assert after_slow_steps(False) == 10_000
    assert after_slow_steps(True) < 9_000
    cfg = parse_config({"load_or_recompute": {"prefill_tokens_per_s": 640, "measure_prefill": False}})
    assert cfg.load_or_recompute.measure_prefill is False
    with pytest.raises(ConfigError, match="load_or_recompute.measure_prefill"):
        parse_config({"load_or_recompute": {"measure_prefill": False}})


def test_a_probe_granted_to_a_request_vllm_did_not_admit_stays_with_it():
    """vLLM looks a request up again each step until it admits it (it may lack KV space,
    or a shorter request goes first). The stale tier was marked fresh when the probe was
    granted: a request that lost its probe that way would leave the estimate stale for
    another interval. It keeps the probe until admitted; others still do not probe."""
    from vllm_kvtier.metrics import sample_key
    from vllm_kvtier.plan.load_policy import LoadPolicy

    probes = sample_key("load_probes", "all")
    m = CostModel(prefill_tokens_per_s=10_000, probe_interval_s=30)
    m.tier("s3").set_prior(0.5, 10 * MB)  # slow: recompute, unless probing
    counters = Counters()
    policy = LoadPolicy(m, counters, block_bytes=1 << 20, block_size=BS, lower_tiers=["s3"])
    assert policy.decide("long", ["s3"] * 8) == 8  # never sampled: the probe
    assert policy.decide("other", ["s3"] * 8) == 0  # one probe, not a storm
    assert policy.decide("long", ["s3"] * 8) == 8  # not admitted last step: still the probe
    policy.commit("long")
    assert counters.totals[probes] == 1
    assert policy.decide("long", ["s3"] * 8) == 0  # admitted (a new lookup): no probe left
    policy.commit("other")
    assert counters.totals[probes] == 1


class _Clock:
    """``time`` as the load planner reads it: a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_tier_is_judged_by_its_reads_not_by_the_engine_steps_a_load_overlapped():
    """vLLM starts an async load after the step's forward and hears it is done after a later
    step's: on a CPU engine the wait holds seconds of compute. Taken as the tier's time, one
    such wait made a 1.5 GB/s NVMe tier look like 1.2 s + 1 MB/s, and switched it off for
    the whole run. The workers time each read; the tier is judged by the slowest one."""
    from types import SimpleNamespace
    from unittest import mock

    from vllm_kvtier.connector.metadata import KVTierWorkerMeta

    def after_one_load(report: KVTierWorkerMeta | None) -> tuple[float, int]:
        counters = Counters()
        s3 = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 16, None), PlannerContext(1, 1 << 20, counters),
                          Listing([{}]))
        s3.index.add_existing("o", [_key(i) for i in range(8)], 8 << 20)
        cfg = parse_config({"load_or_recompute": {"prefill_tokens_per_s": 500, "measure_prefill": False}})
        half = SchedulerHalf(GroupedPlanner(cfg, PlannerSetup(BS, 16, 1 << 20), lower=[s3], counters=counters))
        clock = _Clock()
        with mock.patch("vllm_kvtier.plan.load_plan.time", clock):
            req = _Req(8)
            # the prior (30 ms + 100 MB/s: 0.11 s for 8 MiB) against 8 x 32 tokens at 500/s (0.5 s)
            assert half.planner.get_num_new_matched_tokens(req, 0) == (8 * BS, True)
            half.planner.update_state_after_alloc(req, list(range(9)), 8 * BS)
            half.build_connector_meta(SimpleNamespace(
                scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
                num_scheduled_tokens={}, finished_req_ids=set(), preempted_req_ids=set()))
            clock.now += 5.0  # two CPU prefill steps later
            half.update_connector_output(SimpleNamespace(
                finished_recving={"r"}, finished_sending=set(), invalid_block_ids=set(),
                kv_connector_stats=None, kv_connector_worker_meta=report))
        cost = half.planner.extras.load_policy.cost
        cost.tier("s3").last_sample_s = 1e18  # freshly measured: no probe in the next decision
        again = cost.decide(["s3"] * 8, 1 << 20, BS, now=1.0)
        return cost.tier("s3").load_s(8 << 20), again.load_blocks

    # the reads took 40 ms: the tier still loads, whatever the steps around them took
    fast_s, loads = after_one_load(KVTierWorkerMeta(load_read_seconds={"r": 0.04}))
    assert fast_s < 0.2 and loads == 8
    # no read time reported (a tier without one): the wait is the sample, and 5 s of it
    # turns the same tier off
    slow_s, loads = after_one_load(None)
    assert slow_s > 1.0 and loads == 0
