"""Load or recompute: the cost model (pure) and the scheduler's use of it (no engine)."""

from __future__ import annotations

from vllm_kvtier.config import parse_config
from vllm_kvtier.connector.scheduler import SchedulerHalf
from vllm_kvtier.index.cost import CostModel
from vllm_kvtier.index.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy

MB = 1e6
BS = 32


def test_fast_tier_loads_everything_slow_tier_recomputes():
    m = CostModel(prefill_tokens_per_s=10_000)
    m.tier("nvme").latency_s, m.tier("nvme").bandwidth_Bps = 0.0005, 2000 * MB
    m.tier("s3").latency_s, m.tier("s3").bandwidth_Bps = 0.5, 10 * MB
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
    m.tier("nvme").latency_s, m.tier("nvme").bandwidth_Bps = 0.001, 1000 * MB
    m.tier("s3").latency_s, m.tier("s3").bandwidth_Bps = 5.0, 1 * MB
    for t in ("nvme", "s3"):
        m.tier(t).last_sample_s = 0.0
    d = m.decide(["nvme"] * 4 + ["s3"] * 4, 64 << 10, BS, now=1.0)
    assert d.load_blocks == 4 and d.recomputed == {"s3": 4}


def test_estimates_follow_samples_and_stale_tiers_are_probed_once():
    m = CostModel(prefill_tokens_per_s=10_000, probe_interval_s=30)
    m.tier("s3").latency_s = 0.01
    for _ in range(20):  # requests' loads of 1 MB take 1 s: about 1 MB/s
        m.observe_load("s3", nbytes=MB, seconds=1.0, now=100.0)
    assert 0.8 * MB < m.tier("s3").bandwidth_Bps < 1.2 * MB
    for _ in range(20):
        m.observe_prefill(tokens=2000, seconds=1.0)
    assert abs(m.prefill_tokens_per_s - 2000) < 50
    assert m.decide(["s3"] * 4, MB, BS, now=110.0).load_blocks == 0  # measured recently: recompute
    probe = m.decide(["s3"] * 4, MB, BS, now=200.0)  # 100 s without a sample: probe once
    assert probe.probe and probe.load_blocks == 4
    assert m.decide(["s3"] * 4, MB, BS, now=201.0).load_blocks == 0  # not a probe storm


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
    s3 = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 16, None), world_size=1, block_bytes_per_rank=1 << 20,
                      counters=counters, found=[{}])
    s3.index.add_existing("o", [_key(i) for i in range(2, 8)], 7 << 20)
    cfg = parse_config({"load_or_recompute": {"prefill_tokens_per_s": 10_000}})
    half = SchedulerHalf(cfg, block_size=BS, num_slots=16, slot_bytes_total=1 << 20, lower=[s3], counters=counters)
    for i in range(2):
        half.index.allocate(_key(i))
    est = half.load_policy.cost.tier("s3")
    est.latency_s, est.bandwidth_Bps, est.last_sample_s = 2.0, 1 * MB, 1e18  # slow, freshly measured
    req = _Req(8)
    assert half.get_num_new_matched_tokens(req, 0) == (2 * BS, False)  # only the DRAM blocks, sync
    half.update_state_after_alloc(req, list(range(9)), 2 * BS)
    assert counters.totals["recompute_chosen_blocks|s3"] == 6

    off = parse_config({"load_or_recompute": {"enabled": False}})
    half2 = SchedulerHalf(off, block_size=BS, num_slots=16, slot_bytes_total=1 << 20, lower=[s3], counters=Counters())
    for i in range(2):
        half2.index.allocate(_key(i))
    assert half2.get_num_new_matched_tokens(req, 0) == (8 * BS, True)  # always load: everything, async
