"""Scheduler-half policy with lower-tier planners (NVMe, S3), on plain keys (no engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_kvtier.catalog.base import Listing
from vllm_kvtier.config import parse_config
from vllm_kvtier.connector.scheduler import SchedulerHalf
from vllm_kvtier.engine.lower import make_planners
from vllm_kvtier.engine.scheduler import GroupedPlanner, PlannerSetup
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext

BS = 32


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "big"))


@dataclass
class FakeRequest:
    """The few Request attributes the scheduler half reads."""

    request_id: str
    block_hashes: list[bytes]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    extra: dict = field(default_factory=dict)


def make(tmp_path, num_slots: int) -> SchedulerHalf:
    cfg = parse_config({"nvme": {"path": str(tmp_path), "capacity_bytes": 1 << 30, "admit_min_seen": 1}})
    counters = Counters()
    planners = make_planners(cfg, namespace="ns", world_size=1, block_bytes_per_rank=4096, counters=counters)
    return SchedulerHalf(GroupedPlanner(cfg, PlannerSetup(BS, num_slots, 4096), lower=planners, counters=counters))


def test_promotions_never_evict_dram_blocks_of_the_same_load(tmp_path):
    """K0, K1 were demoted to NVMe; K2..K9 are the oldest keys in a full DRAM tier. A
    request hitting K0..K9 must promote K0, K1 without evicting K2..K9 (which it reads
    from DRAM in the same load): it used to crash the engine on an assertion."""
    half = make(tmp_path, num_slots=10)
    nvme = half.planner.lower_tier("nvme")
    assert nvme is not None
    for i in range(2, 10):
        half.planner.index.allocate(key(i))
    half.planner.index.allocate(key(100))
    half.planner.index.allocate(key(101))
    nvme.note_request([key(100), key(101)])  # they were part of an earlier prompt
    nvme.index.add_existing("f0", [key(0), key(1)], 3 * 4096)

    req = FakeRequest("r", [key(i) for i in range(11)], num_prompt_tokens=10 * BS + 1)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (10 * BS, True)  # NVMe -> async
    dram_slots = {i: half.planner.index.slot(key(i)) for i in range(2, 10)}
    half.planner.update_state_after_alloc(req, list(range(50, 61)), 10 * BS)

    assert all(half.planner.index.slot(key(i)) == s for i, s in dram_slots.items())
    assert key(100) not in half.planner.index and key(101) not in half.planner.index  # the LRU victims
    meta = half.build_connector_meta(_Out({}))
    (load,) = meta.loads
    assert load.asynchronous and not load.unloadable
    assert [r.keys for r in load.reads] == [(key(0), key(1))]
    assert {r.chunk_id for r in load.reads} == {"f0"}
    # The evicted DRAM blocks were admitted, so they are demoted to NVMe in this step.
    assert sorted(k for job in meta.demotes for k in job.keys) == [key(100), key(101)]


def test_abort_during_async_load_is_not_held_even_without_pins(tmp_path):
    """A load whose promotions all failed (no free slot) is async with nothing pinned; an
    abort before it completes must leave the blocks to vLLM (which frees them on
    finished_recving), not hold them and save never-loaded blocks."""
    half = make(tmp_path, num_slots=2)
    busy = [half.planner.index.allocate(key(100 + i)).slot for i in range(2)]
    for s in busy:
        half.planner.index.pin(s)  # every slot is read by some transfer right now
    half.planner.lower_tier("nvme").index.add_existing("f0", [key(0), key(1)], 3 * 4096)
    req = FakeRequest("r", [key(0), key(1), key(2)], num_prompt_tokens=2 * BS + 1)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    half.planner.update_state_after_alloc(req, [7, 8, 9], 2 * BS)
    (load,) = half.build_connector_meta(_Out({})).loads
    # No slot for either promotion: both blocks named unloadable (no slot sentinel), async.
    assert load.asynchronous and load.unloadable == (7, 8) and load.slots == () and load.reads == ()
    for s in busy:
        half.planner.index.unpin(s)  # those transfers end; slots are free to allocate again
    req.num_computed_tokens = 2 * BS  # vLLM counts the external tokens already
    assert half.planner.request_finished(req, [7, 8]) == (False, None)
    meta = half.build_connector_meta(_Out({}))
    assert meta.saves == [] and meta.freed == []


@dataclass
class _Cached:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class _Out:
    """A SchedulerOutput with nothing scheduled."""

    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_block_state: None = None
    scheduled_cached_reqs: _Cached = field(default_factory=_Cached)


def make_two_tiers(tmp_path, num_slots: int, s3_mode: str = "write-through") -> SchedulerHalf:
    """CPU + NVMe (write-back) + an S3 planner (no bucket needed: the planner is pure)."""
    cfg = parse_config({"nvme": {"path": str(tmp_path), "capacity_bytes": 1 << 30, "admit_min_seen": 1}})
    counters = Counters()
    planners = make_planners(cfg, namespace="ns", world_size=1, block_bytes_per_rank=4096, counters=counters)
    s3 = ChunkPlanner(ChunkPolicy("s3", s3_mode, 1, 16, None), PlannerContext(1, 4096, counters), Listing([{}]))
    return SchedulerHalf(GroupedPlanner(cfg, PlannerSetup(BS, num_slots, 4096), lower=[*planners, s3],
                                        counters=counters))


def test_lookup_prefers_the_fastest_lower_tier_and_continues_into_s3(tmp_path):
    half = make_two_tiers(tmp_path, num_slots=8)
    nvme, s3 = half.planner.lower_tier("nvme"), half.planner.lower_tier("s3")
    nvme.index.add_existing("n0", [key(0), key(1)], 3 * 4096)
    s3.index.add_existing("o0", [key(1), key(2), key(3)], 4 * 4096)  # key(1) in both
    req = FakeRequest("r", [key(i) for i in range(5)], num_prompt_tokens=4 * BS + 1)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    half.planner.update_state_after_alloc(req, [10, 11, 12, 13, 14], 4 * BS)
    meta = half.build_connector_meta(_Out({}))
    (load,) = meta.loads
    by_tier = {(r.tier, r.chunk_id): (r.positions, r.keys) for r in load.reads}
    assert by_tier == {("nvme", "n0"): ((0, 1), (key(0), key(1))), ("s3", "o0"): ((1, 2), (key(2), key(3)))}
    assert load.asynchronous and not load.unloadable
    # A chunk being read is pinned: neither tier may evict it until the load ends.
    assert half.planner.counters.totals["hit_blocks|nvme"] == 2 and half.planner.counters.totals["hit_blocks|s3"] == 2


def test_each_lower_tier_takes_cpu_blocks_by_its_own_mode(tmp_path):
    """NVMe write-back gets blocks when DRAM evicts them; S3 write-through gets every
    saved block at once; deletes and persist slots are tagged with their tier."""
    half = make_two_tiers(tmp_path, num_slots=2)
    req = FakeRequest("r", [key(i) for i in range(4)], num_prompt_tokens=3 * BS)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (0, False)
    half.planner.update_state_after_alloc(req, [1, 2, 3], 0)
    meta = half.build_connector_meta(_Out({"r": 2 * BS}))
    assert [k for j in meta.saves_after for k in j.keys] == [key(0), key(1)]
    assert meta.demotes == []
    assert [(j.tier, j.keys) for j in meta.write_through] == [("s3", (key(0), key(1)))]
    assert meta.persist_slots == {"nvme": [s for j in meta.saves_after for s in j.slots]}
    req.num_computed_tokens = 2 * BS
    meta = half.build_connector_meta(_Out({"r": BS}))
    # Key 2 evicted key 1 from the 2-slot DRAM tier (kvaware: the prompt's tail before its
    # head): NVMe demotes it; S3 already has it.
    assert [(j.tier, j.keys) for j in meta.demotes] == [("nvme", (key(1),))]
    assert [(j.tier, j.keys) for j in meta.write_through] == [("s3", (key(2),))]


def test_s3_capacity_evicts_lru_objects_and_deletes_them(tmp_path):
    """With s3.capacity_bytes, the oldest objects make room and go out as s3 deletes."""
    cfg = parse_config({})
    counters = Counters()
    per_object = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 2, None), PlannerContext(1, 4096, counters), Listing([{}])).file_bytes(2)
    s3 = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 2, 2 * per_object), PlannerContext(1, 4096, counters), Listing([{}]))
    half = SchedulerHalf(GroupedPlanner(cfg, PlannerSetup(BS, 16, 4096), lower=[s3], counters=counters))
    s3.index.add_existing("old", [key(100), key(101)], per_object)
    s3.index.add_existing("newer", [key(102), key(103)], per_object)
    req = FakeRequest("r", [key(i) for i in range(3)], num_prompt_tokens=2 * BS + 1)
    half.planner.get_num_new_matched_tokens(req, 0)
    half.planner.update_state_after_alloc(req, [1, 2, 3], 0)
    meta = half.build_connector_meta(_Out({"r": 2 * BS + 1}))
    assert [(j.tier, j.keys) for j in meta.write_through] == [("s3", (key(0), key(1)))]
    assert meta.deletes == [("s3", "old")]
    assert s3.index.used_bytes <= 2 * per_object and counters.totals["evictions|s3"] == 2


def test_write_back_flushes_aged_blocks_while_busy_and_all_of_them_when_idle():
    """Warm restart whatever the admission count: blocks only in DRAM are written once they
    are flush_interval_s old (busy), or at once when the engine is idle; a block evicted
    before it aged is not written unless admitted, and a slot reused meanwhile is skipped."""
    now = [0.0]
    counters = Counters()
    p = ChunkPlanner(ChunkPolicy("nvme", "write-back", 2, 4, None, flush_interval_s=10.0), PlannerContext(1, 4096, counters, clock=lambda: now[0]), Listing([{}]))
    where = {key(i): i for i in range(6)}
    for i in range(6):
        p.on_cpu_save(i, key(i))  # none admitted: each was seen in no earlier prompt

    def flushed(idle: bool = False) -> list[BlockKey]:
        demotes, through, _ = p.take_jobs(set(), where.get, idle=idle)
        assert demotes == []
        return [k for job in through for k in job.keys]

    now[0] = 5.0
    assert flushed() == [] and p.has_flush_work()  # busy, nothing aged yet
    p.on_cpu_evict(0, key(0))  # a one-off evicted before it aged: not admitted, not written
    del where[key(0)]
    where[key(3)] = 7  # slot 3 was reused for another block: key 3 is not in its slot
    now[0] = 11.0
    assert flushed() == [key(1), key(2), key(4), key(5)]
    assert counters.totals["flushed_blocks|nvme"] == 4 and not p.has_flush_work()

    now[0] = 12.0
    for i in (10, 11):
        where[key(i)] = i
        p.on_cpu_save(i, key(i))
    assert flushed() == []  # busy: too young
    assert p.has_flush_work() and flushed(idle=True) == [key(10), key(11)]
    assert not p.has_flush_work() and flushed(idle=True) == []  # each block is written once


def test_an_idle_engine_steps_until_its_demotions_are_durable():
    """Demoted blocks are loadable only once every rank reported their chunk written, and
    reports come with steps: an idle engine keeps stepping (``awaits_writes``) until they
    did, so the next request finds them on NVMe. A write that never reports stops keeping
    it busy after WRITE_SETTLE_S."""
    from vllm_kvtier.jobs import WorkerReport
    from vllm_kvtier.plan.chunk_plan import WRITE_SETTLE_S

    now = [0.0]
    p = ChunkPlanner(ChunkPolicy("nvme", "write-back", 1, 2, None), PlannerContext(1, 4096, Counters(), clock=lambda: now[0]),
                     Listing([{}]))
    assert not p.awaits_writes()
    p.note_request([key(i) for i in range(5)])  # one prompt held them: admitted (admit_min_seen 1)
    for i in range(4):
        p.on_cpu_evict(i, key(i))
    demotes, _, _ = p.take_jobs(set(), lambda k: None)
    assert [j.keys for j in demotes] == [(key(0), key(1)), (key(2), key(3))]
    assert p.awaits_writes() and p.locate(key(0)) is None  # written, not reported yet
    now[0] = 1.0
    p.on_worker_meta(WorkerReport(written={("nvme", demotes[0].chunk_id): 1}))
    assert p.awaits_writes() and p.locate(key(0)) is not None and p.locate(key(2)) is None
    p.on_worker_meta(WorkerReport(written={("nvme", demotes[1].chunk_id): 1}))
    assert not p.awaits_writes() and p.locate(key(3)) is not None

    p.on_cpu_evict(4, key(4))
    (lost,), _, _ = p.take_jobs(set(), lambda k: None)
    now[0] = 1.0 + WRITE_SETTLE_S - 0.1
    assert p.awaits_writes()
    now[0] = 1.0 + WRITE_SETTLE_S + 0.1
    assert not p.awaits_writes() and p.locate(key(4)) is None  # never reported: not busy for it
