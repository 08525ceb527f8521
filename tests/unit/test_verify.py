"""Shadow verification's parts alone: the block comparison and its tolerances, the
sampling, the config section, and the scheduler's bookkeeping (pure planner, integer-like
keys: no vLLM engine)."""

from __future__ import annotations

import pytest
import torch

from testkit.requests import Req
from vllm_kvtier.config import KVTierConfig, VerifyConfig, parse_config
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.plan.inputs import StepInput, WorkerOutput
from vllm_kvtier.plan.scheduler import PlannerSetup, SchedulerPlanner
from vllm_kvtier.plan.verify_plan import Sampler
from vllm_kvtier.transfer.verify import (
    DEFAULT_TOLERANCES,
    Tolerance,
    compare_block,
    element_dtype,
    tolerance_for,
)

AUTO = VerifyConfig(sample_rate=1.0)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def kv_block(dtype: torch.dtype, seed: int = 0, n: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 2).to(dtype)


# ---- comparison --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equal_blocks_are_bitwise(dtype):
    b = kv_block(dtype)
    res = compare_block(as_bytes(b), as_bytes(b.clone()), dtype, tolerance_for(AUTO, dtype))
    assert res.bitwise and res.within and res.max_abs == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_recompute_noise_is_within_the_default_and_a_planted_block_far_outside(dtype):
    """A one-ulp perturbation of every element (what another GEMM blocking can give) is
    within the dtype default; the test's planted block (-v + 0.5) is far outside it."""
    computed = kv_block(dtype)
    noisy = (computed.float() * (1 + torch.finfo(dtype).eps)).to(dtype)  # one ulp up
    tol = tolerance_for(AUTO, dtype)
    res = compare_block(as_bytes(noisy), as_bytes(computed), dtype, tol)
    assert not res.bitwise and res.within
    planted = (-computed.float() + 0.5).to(dtype)
    bad = compare_block(as_bytes(planted), as_bytes(computed), dtype, tol)
    assert not bad.within and bad.max_abs > 100 * (tol.atol + tol.rtol)
    # exact: the noise itself is a mismatch
    assert not compare_block(as_bytes(noisy), as_bytes(computed), dtype, Tolerance(exact=True)).within


def test_tolerance_is_normwise_per_plane():
    """Noise of 2% of a plane's largest value passes even where it dwarfs the element
    itself (near 0); a plane off by 10% of its largest value fails, even when the other
    plane of the block is exact."""
    dtype = torch.bfloat16
    tol = tolerance_for(AUTO, dtype)
    c = kv_block(dtype, n=2048)
    planes = (1024 * 2, 1024 * 2)
    scale = float(c.float().abs().max())
    noise = (torch.rand(2048, generator=torch.Generator().manual_seed(3)) - 0.5) * 0.04 * scale
    res = compare_block(as_bytes((c.float() + noise).to(dtype)), as_bytes(c), dtype, tol, planes)
    assert res.within and not res.bitwise
    off = c.float().clone()
    off[1500] += 0.1 * float(c[1024:].float().abs().max())
    assert not compare_block(as_bytes(off.to(dtype)), as_bytes(c), dtype, tol, planes).within


def test_one_wrong_element_nan_or_size_is_a_mismatch():
    c = kv_block(torch.float32)
    tol = tolerance_for(AUTO, torch.float32)
    one = c.clone()
    one[17] += 1.0
    assert not compare_block(as_bytes(one), as_bytes(c), torch.float32, tol).within
    nan = c.clone()
    nan[3] = float("nan")
    res = compare_block(as_bytes(nan), as_bytes(c), torch.float32, tol)
    assert not res.within and res.max_abs == float("inf")
    assert not compare_block(as_bytes(c)[:-4], as_bytes(c), torch.float32, tol).within


def test_tolerance_defaults_overrides_and_exact():
    for dtype, (atol, rtol) in DEFAULT_TOLERANCES.items():
        assert tolerance_for(AUTO, dtype) == Tolerance(atol, rtol)
    assert tolerance_for(VerifyConfig(sample_rate=1.0, rtol=0.5), torch.float32) == \
        Tolerance(DEFAULT_TOLERANCES[torch.float32][0], 0.5)
    assert tolerance_for(VerifyConfig(sample_rate=1.0, tolerance="exact"), torch.bfloat16).exact
    assert not tolerance_for(AUTO, torch.float8_e4m3fn).exact  # fp8 KV: decoded, normwise
    assert tolerance_for(AUTO, torch.int8).exact  # no default: bitwise


@pytest.mark.parametrize(("cache_dtype", "fp8"), [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                                  ("fp8_e5m2", torch.float8_e5m2)])
def test_an_fp8_kv_cache_is_decoded_and_compared_within_its_tolerance(cache_dtype, fp8):
    """vLLM's fp8 caches are uint8 tensors: the bytes are decoded by the format the cache
    dtype names. A recompute 1% off (what crosses rounding boundaries in fp8) is within the
    tolerance, not bitwise; the planted block is far outside; tolerance: exact still
    compares bytes."""
    assert element_dtype(torch.uint8, cache_dtype) == fp8
    assert element_dtype(torch.uint8, "auto") == torch.uint8 and element_dtype(torch.bfloat16, "fp8") == torch.bfloat16
    tol = tolerance_for(AUTO, fp8)
    values = kv_block(torch.float32)
    computed = values.to(fp8)
    noisy = (values * 1.01).to(fp8)
    assert as_bytes(noisy) != as_bytes(computed)
    res = compare_block(as_bytes(noisy), as_bytes(computed), fp8, tol, (2048, 2048))
    assert not res.bitwise and res.within and res.max_abs > 0
    planted = (-values + 0.5).to(fp8)
    assert not compare_block(as_bytes(planted), as_bytes(computed), fp8, tol, (2048, 2048)).within
    assert not compare_block(as_bytes(noisy), as_bytes(computed), fp8, Tolerance(exact=True)).within
    nan = bytearray(as_bytes(computed))
    nan[5] = 0x7F  # NaN in both formats (e4m3fn: S.1111.111; e5m2: S.11111.11)
    assert not compare_block(bytes(nan), as_bytes(computed), fp8, tol).within


# ---- sampling and config -------------------------------------------------------------------


def test_sampling_is_deterministic_and_follows_the_rate():
    assert all(Sampler(1.0, 0).draw() for _ in range(100))
    a, b = Sampler(0.1, 7), Sampler(0.1, 7)
    draws = [a.draw() for _ in range(5000)]
    assert draws == [b.draw() for _ in range(5000)]
    assert 400 < sum(draws) < 600
    assert draws != [Sampler(0.1, 8).draw() for _ in range(5000)]


@pytest.mark.parametrize(("verify", "field_name"), [
    ({"sample_rate": 1.5}, "verify.sample_rate"),
    ({"sample_rate": -0.1}, "verify.sample_rate"),
    ({"tolerance": "exact", "atol": 0.1}, "verify.atol"),
    ({"rtol": -1}, "verify.rtol"),
    ({"quarantine_s": -1}, "verify.quarantine_s"),
    ({"quarantine_s": 1e12}, "verify.quarantine_s"),
    ({"quarantine_mismatches": 0}, "verify.quarantine_mismatches"),
    ({"quarantine_mismatches": 2.5}, "verify.quarantine_mismatches"),
    ({"quarantine_window_s": 0}, "verify.quarantine_window_s"),
    ({"tolerance": "loose"}, "verify.tolerance"),
    ({"sample": 1}, "verify.sample"),
])
def test_bad_verify_config_names_the_field(verify, field_name):
    with pytest.raises(ConfigError) as e:
        parse_config({"verify": verify})
    assert field_name in str(e.value)


def test_verify_config_parses_and_defaults_off():
    assert parse_config({}).verify.sample_rate == 0.0
    v = parse_config({"verify": {"sample_rate": 0.01, "seed": 3, "tolerance": "exact", "quarantine_s": 60}}).verify
    assert (v.sample_rate, v.seed, v.tolerance, v.quarantine_s) == (0.01, 3, "exact", 60.0)


# ---- scheduler bookkeeping -----------------------------------------------------------------

BS = 4


def prompt(req_id: str, nblocks: int = 4) -> Req:
    return Req(req_id, [bytes([i]) * 8 for i in range(nblocks)], nblocks * BS + 1)


def run_request(p: SchedulerPlanner, r: Req, block_ids: list[int]):
    """Admit ``r``, plan its first step (whole prompt) and return (lookup answer, plan)."""
    got = p.lookup(r, 0)
    p.on_alloc(r, block_ids, got[0] or 0)
    plan = p.plan_step(StepInput({r.request_id: r.num_prompt_tokens}))
    r.num_computed_tokens = r.num_prompt_tokens
    return got, plan


def planner(**verify) -> SchedulerPlanner:
    cfg = KVTierConfig(verify=VerifyConfig(**verify)) if verify else KVTierConfig()
    return SchedulerPlanner(cfg, PlannerSetup(BS, 32, 1))


def test_rate_zero_builds_nothing_and_loads():
    p = planner()
    assert p.extras.verify is None
    run_request(p, prompt("a"), [0, 1, 2, 3, 4])
    got, plan = run_request(p, prompt("b"), [5, 6, 7, 8, 9])
    assert got == (4 * BS, False) and not plan.verifies and len(plan.loads) == 1


def test_sampled_hit_is_recomputed_compared_and_a_mismatch_quarantines():
    p = planner(sample_rate=1.0, quarantine_s=600, quarantine_mismatches=1)
    run_request(p, prompt("a"), [0, 1, 2, 3, 4])
    got, plan = run_request(p, prompt("b"), [5, 6, 7, 8, 9])
    assert got == (0, False) and not plan.loads  # told 0 external tokens: recomputed
    (job,) = plan.verifies
    assert job.block_ids == (5, 6, 7, 8) and job.tiers == ("cpu",) * 4 and not job.reads
    assert not plan.saves_after  # its blocks are stored already: nothing saved again
    assert p.has_pending_work()
    bad = job.keys[2]
    p.on_worker_output(WorkerOutput(report=WorkerReport(verified={job.verify_id: 1},
                                                        verify_mismatched={(job.verify_id, bad)})))
    t = p.counters.totals
    assert t["verify_samples|cpu"] == 4 and t["verify_mismatches|cpu"] == 1
    assert t["verify_quarantines|cpu"] == 1
    assert p.extras.verify is not None and p.extras.verify.quarantined("cpu")
    assert bad not in p.index and job.keys[0] in p.index  # the wrong block is dropped
    # Quarantined: no hit, so nothing sampled either.
    got, plan = run_request(p, prompt("c"), [10, 11, 12, 13, 14])
    assert got == (0, False) and not plan.verifies and not plan.loads
    assert p.stats()["gauges"]["verify_quarantined|cpu"] == 1


def mismatching_check(p: SchedulerPlanner, name: str, slots: list[int]) -> None:
    """A sampled hit of a fresh prompt ``name`` whose workers report one wrong block."""
    r = Req(name, [name.encode() + bytes([i]) * 7 for i in range(4)], 4 * BS + 1)
    run_request(p, r, slots)  # stored
    _, plan = run_request(p, Req(name + "'", list(r.block_hashes), r.num_prompt_tokens), [s + 5 for s in slots])
    (job,) = plan.verifies
    p.on_worker_output(WorkerOutput(report=WorkerReport(verified={job.verify_id: 1},
                                                        verify_mismatched={(job.verify_id, job.keys[1])})))


def test_one_mismatch_does_not_quarantine_a_tier_by_default_three_do():
    p = planner(sample_rate=1.0, quarantine_s=600)
    assert p.extras.verify is not None
    mismatching_check(p, "a", [0, 1, 2, 3, 4])
    mismatching_check(p, "b", [10, 11, 12, 13, 14])
    assert p.counters.totals["verify_mismatches|cpu"] == 2 and not p.extras.verify.quarantined("cpu")
    assert p.counters.totals.get("verify_quarantines|cpu", 0) == 0
    mismatching_check(p, "c", [20, 21, 22, 23, 24])
    assert p.extras.verify.quarantined("cpu") and p.counters.totals["verify_quarantines|cpu"] == 1


def test_mismatches_count_toward_a_quarantine_only_within_the_window():
    from vllm_kvtier.plan.verify_plan import MismatchWindow

    w = MismatchWindow(2, 100)
    assert not w.add("cpu", 0) and not w.add("nvme", 50)  # per tier
    assert not w.add("cpu", 100)  # the first one has left the window
    assert w.add("cpu", 150)  # two within 100 s
    assert not w.add("cpu", 160)  # counting starts again after a quarantine
    assert MismatchWindow(1, 100).add("s3", 0)


def test_clean_check_releases_its_pins_and_quarantine_is_off_by_default():
    p = planner(sample_rate=1.0)
    run_request(p, prompt("a"), [0, 1, 2, 3, 4])
    _, plan = run_request(p, prompt("b"), [5, 6, 7, 8, 9])
    (job,) = plan.verifies
    assert all(p.index.is_pinned(s) for s in job.slots)  # held until the workers report
    p.on_worker_output(WorkerOutput(report=WorkerReport(verified={job.verify_id: 1},
                                                        verify_mismatched={(job.verify_id, job.keys[0])})))
    assert not any(p.index.is_pinned(s) for s in job.slots)
    assert p.extras.verify is not None and not p.extras.verify.quarantined("cpu") and not p.extras.verify.has_work()  # quarantine_s 0
    got, plan = run_request(p, prompt("c", 4), [10, 11, 12, 13, 14])
    # block 0 was dropped: the run from block 0 is a miss now (it is recomputed and saved)
    assert got == (0, False) and not plan.verifies


def test_a_request_finished_before_its_check_releases_what_it_held():
    p = planner(sample_rate=1.0)
    run_request(p, prompt("a"), [0, 1, 2, 3, 4])
    b = prompt("b")
    assert p.lookup(b, 0) == (0, False)
    p.on_alloc(b, [5, 6, 7, 8, 9], 0)
    held = [p.index.slot(BlockKey(h)) for h in b.block_hashes]
    assert all(s is not None and p.index.is_pinned(s) for s in held)
    p.on_finished(b, [5, 6, 7, 8, 9])  # aborted before any step: nothing issued
    assert not any(p.index.is_pinned(s) for s in held if s is not None)
    plan = p.plan_step(StepInput({}))
    assert not plan.verifies and not p.has_pending_work()
    got, plan = run_request(p, prompt("c"), [10, 11, 12, 13, 14])
    assert got == (0, False) and len(plan.verifies) == 1  # its blocks are still there to verify


def test_worker_reports_merge_over_ranks():
    a = WorkerReport(verified={1: 1, 2: 1}, verify_mismatched={(1, b"k1")}, verify_inexact={(2, b"k2")})
    b = WorkerReport(verified={1: 1}, verify_unread={(1, b"k3")})
    m = a.aggregate(b)
    assert m.verified == {1: 2, 2: 1}
    assert m.verify_mismatched == {(1, b"k1")} and m.verify_unread == {(1, b"k3")}
    assert m.verify_inexact == {(2, b"k2")}
    assert not m.is_empty() and WorkerReport().is_empty()


def test_a_check_waits_for_every_rank():
    cfg = KVTierConfig(verify=VerifyConfig(sample_rate=1.0, quarantine_s=60, quarantine_mismatches=1))
    p = SchedulerPlanner(cfg, PlannerSetup(BS, 32, 1, world_size=2))
    run_request(p, prompt("a"), [0, 1, 2, 3, 4])
    _, plan = run_request(p, prompt("b"), [5, 6, 7, 8, 9])
    (job,) = plan.verifies
    p.on_worker_output(WorkerOutput(report=WorkerReport(verified={job.verify_id: 1})))
    assert p.extras.verify is not None and p.extras.verify.has_work() and "verify_samples|cpu" not in p.counters.totals
    p.on_worker_output(WorkerOutput(report=WorkerReport(verified={job.verify_id: 1},
                                                        verify_mismatched={(job.verify_id, job.keys[3])})))
    assert not p.extras.verify.has_work() and p.counters.totals["verify_mismatches|cpu"] == 1
    assert p.extras.verify.quarantined("cpu")


def test_host_rows_concatenates_one_row_of_every_plane():
    from vllm_kvtier.transfer.verify import host_rows

    g = torch.Generator().manual_seed(1)
    planes = (torch.randint(0, 256, (5, 48), generator=g, dtype=torch.uint8),
              torch.randint(0, 256, (5, 16), generator=g, dtype=torch.uint8))
    for i in range(5):
        assert host_rows(planes, i) == torch.cat([planes[0][i], planes[1][i]]).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_fp8_tier_is_compared_through_its_codec(dtype):
    """A tier storing fp8 gives back decode(encode(block)): compared with the computed
    block through the same codec it is bitwise equal (raw, it is not); a recompute one ulp
    off stays within the codec tolerance; a planted block does not."""
    from vllm_kvtier.transfer.fp8 import FP8Codec
    from vllm_kvtier.transfer.verify import codec_tolerance, through_codec

    planes = (4096 * dtype.itemsize, 2048 * dtype.itemsize)
    computed = kv_block(dtype, n=6144)
    codec = FP8Codec(sum(planes), dtype)
    stored = through_codec(as_bytes(computed), codec, planes)  # what the tier serves
    tol = codec_tolerance(tolerance_for(AUTO, dtype))
    assert compare_block(stored, through_codec(as_bytes(computed), codec, planes), dtype, tol).bitwise
    assert not compare_block(stored, as_bytes(computed), dtype, Tolerance(exact=True)).bitwise  # lossy
    noisy = (computed.float() * (1 + torch.finfo(dtype).eps)).to(dtype)
    assert compare_block(stored, through_codec(as_bytes(noisy), codec, planes), dtype, tol).within
    planted = (-computed.float() + 0.5).to(dtype)
    assert not compare_block(through_codec(as_bytes(planted), codec, planes),
                             through_codec(as_bytes(computed), codec, planes), dtype, tol).within


def test_a_lower_tier_hit_is_read_into_cpu_slots_and_a_mismatch_drops_and_quarantines_it():
    """A prefix only on a lower tier ("nvme", a real ChunkPlanner over a found chunk): the
    check reads it into promotion slots; a mismatch drops that chunk and quarantines the
    tier; the blocks that matched stay in DRAM, and the tier's lookups answer miss."""
    from vllm_kvtier.catalog.base import Listing
    from vllm_kvtier.chunkformat import make_header
    from vllm_kvtier.metrics import Counters
    from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext

    keys = [bytes([i]) * 8 for i in range(4)]
    counters = Counters()
    found = [{"c1": make_header("ns", keys, [0] * 4, 1024)}]
    nvme = ChunkPlanner(ChunkPolicy("nvme", "write-back", 1, 4, None), PlannerContext(1, 1024, counters), Listing(found))
    cfg = KVTierConfig(verify=VerifyConfig(sample_rate=1.0, quarantine_s=60, quarantine_mismatches=1))
    p = SchedulerPlanner(cfg, PlannerSetup(BS, 32, 1), lower=[nvme], counters=counters)
    got, plan = run_request(p, prompt("a"), [0, 1, 2, 3, 4])
    assert got == (0, False) and not plan.loads
    (job,) = plan.verifies
    assert job.tiers == ("nvme",) * 4
    (read,) = job.reads
    assert (read.tier, read.chunk_id, read.positions, read.keys) == ("nvme", "c1", (0, 1, 2, 3), tuple(keys))
    assert read.slots == job.slots
    p.on_worker_output(WorkerOutput(report=WorkerReport(verified={job.verify_id: 1},
                                                        verify_mismatched={(job.verify_id, keys[2])})))
    assert counters.totals["verify_samples|nvme"] == 4 and counters.totals["verify_mismatches|nvme"] == 1
    assert p.extras.verify is not None and p.extras.verify.quarantined("nvme") and not p.extras.verify.quarantined("cpu")
    assert nvme.locate(BlockKey(keys[0])) is None  # the chunk holding the wrong block is gone
    assert BlockKey(keys[0]) in p.index and BlockKey(keys[2]) not in p.index
    got, plan = run_request(p, prompt("b"), [5, 6, 7, 8, 9])
    (job2,) = plan.verifies  # blocks 0-1 verified good, now in DRAM: sampled from there
    assert job2.tiers == ("cpu", "cpu") and not job2.reads


def _one_chunk_tier(name: str, *, exclusive: bool, key_named: bool = False):
    """A lower tier holding the prompt's 4 blocks in one chunk (key-named: one chunk per
    block, found by lookups that always say present, as a pool does)."""
    from vllm_kvtier.catalog.base import Listing, MemoryLookups
    from vllm_kvtier.chunkformat import make_header
    from vllm_kvtier.metrics import Counters
    from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext

    keys = [bytes([i]) * 8 for i in range(4)]
    counters = Counters()
    found = [{} if key_named else {"c1": make_header("ns", keys, [0] * 4, 1024)}]
    tier = ChunkPlanner(ChunkPolicy(name, "write-back", 1, 1 if key_named else 4, None, key_named=key_named,
                                    exclusive=exclusive), PlannerContext(1, 1024, counters), Listing(found, catalog=MemoryLookups(lambda ids: [True] * len(ids)) if key_named else None))
    return tier, keys, counters


@pytest.mark.parametrize(("name", "key_named"), [("s3", False), ("mooncake", True)])
def test_a_mismatch_on_a_shared_tier_forgets_the_chunk_and_never_deletes_it(name, key_named):
    """A shared tier (a bucket, a pool other instances read): one sample never deletes the
    object; this instance forgets it for good (a pool lookup that finds it again does not
    index it), counted; the blocks that matched still load into DRAM."""
    tier, keys, counters = _one_chunk_tier(name, exclusive=False, key_named=key_named)
    cfg = KVTierConfig(verify=VerifyConfig(sample_rate=1.0))
    p = SchedulerPlanner(cfg, PlannerSetup(BS, 32, 1), lower=[tier], counters=counters)
    got, plan = run_request(p, prompt("a"), [0, 1, 2, 3, 4])
    (job,) = plan.verifies
    assert job.tiers == (name,) * 4
    p.on_worker_output(WorkerOutput(report=WorkerReport(verified={job.verify_id: 1},
                                                        verify_mismatched={(job.verify_id, keys[2])})))
    assert counters.totals[f"verify_mismatches|{name}"] == 1
    assert counters.totals[f"verify_forgotten_chunks|{name}"] == 1
    _, _, deletes = tier.take_jobs(set(), lambda k: None)
    assert deletes == []  # nothing deleted from the shared tier
    assert tier.locate(BlockKey(keys[2])) is None
    tier.discover([BlockKey(keys[2])])  # the pool still has it: not indexed again
    assert tier.locate(BlockKey(keys[2])) is None
    assert BlockKey(keys[2]) not in p.index


def test_a_mismatch_on_the_exclusive_nvme_tier_deletes_the_chunk():
    tier, keys, counters = _one_chunk_tier("nvme", exclusive=True)
    cfg = KVTierConfig(verify=VerifyConfig(sample_rate=1.0))
    p = SchedulerPlanner(cfg, PlannerSetup(BS, 32, 1), lower=[tier], counters=counters)
    _, plan = run_request(p, prompt("a"), [0, 1, 2, 3, 4])
    (job,) = plan.verifies
    p.on_worker_output(WorkerOutput(report=WorkerReport(verified={job.verify_id: 1},
                                                        verify_mismatched={(job.verify_id, keys[2])})))
    _, _, deletes = tier.take_jobs(set(), lambda k: None)
    assert deletes == ["c1"] and counters.totals.get("verify_forgotten_chunks|nvme", 0) == 0
