"""Scheduler-half policy with the NVMe planner, on plain integer-like keys (no engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_kvtier.config import parse_config
from vllm_kvtier.connector.nvme_plan import NVMePlanner
from vllm_kvtier.connector.scheduler import SchedulerHalf
from vllm_kvtier.index.keys import BlockKey
from vllm_kvtier.metrics import Counters

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
    planner = NVMePlanner(cfg.nvme, namespace="ns", world_size=1, block_bytes_per_rank=4096, counters=counters)
    return SchedulerHalf(cfg, block_size=BS, num_slots=num_slots, slot_bytes_total=4096, nvme=planner,
                         counters=counters)


def test_promotions_never_evict_dram_blocks_of_the_same_load(tmp_path):
    """K0, K1 were demoted to NVMe; K2..K9 are the oldest keys in a full DRAM tier. A
    request hitting K0..K9 must promote K0, K1 without evicting K2..K9 (which it reads
    from DRAM in the same load): it used to crash the engine on an assertion."""
    half = make(tmp_path, num_slots=10)
    assert half.nvme is not None
    for i in range(2, 10):
        half.index.allocate(key(i))
    half.index.allocate(key(100))
    half.index.allocate(key(101))
    half.nvme.note_request([key(100), key(101)])  # they were part of an earlier prompt
    half.nvme.index.add_existing("f0", [key(0), key(1)], 3 * 4096)

    req = FakeRequest("r", [key(i) for i in range(11)], num_prompt_tokens=10 * BS + 1)
    assert half.get_num_new_matched_tokens(req, 0) == (10 * BS, True)  # NVMe -> async
    dram_slots = {i: half.index.slot(key(i)) for i in range(2, 10)}
    half.update_state_after_alloc(req, list(range(50, 61)), 10 * BS)

    assert all(half.index.slot(key(i)) == s for i, s in dram_slots.items())
    assert key(100) not in half.index and key(101) not in half.index  # the LRU victims
    meta = half.build_connector_meta(_Out({}))
    (load,) = meta.loads
    assert load.asynchronous and -1 not in load.slots
    assert [r.keys for r in load.reads] == [(key(0), key(1))]
    assert {r.file_id for r in load.reads} == {"f0"}
    # The evicted DRAM blocks were admitted, so they are demoted to NVMe in this step.
    assert sorted(k for job in meta.demotes for k in job.keys) == [key(100), key(101)]


def test_abort_during_async_load_is_not_held_even_without_pins(tmp_path):
    """A load whose promotions all failed (no free slot) is async with nothing pinned; an
    abort before it completes must leave the blocks to vLLM (which frees them on
    finished_recving), not hold them and save never-loaded blocks."""
    half = make(tmp_path, num_slots=2)
    busy = [half.index.allocate(key(100 + i)).slot for i in range(2)]
    for s in busy:
        half.index.pin(s)  # every slot is read by some transfer right now
    half.nvme.index.add_existing("f0", [key(0), key(1)], 3 * 4096)
    req = FakeRequest("r", [key(0), key(1), key(2)], num_prompt_tokens=2 * BS + 1)
    assert half.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    half.update_state_after_alloc(req, [7, 8, 9], 2 * BS)
    for s in busy:
        half.index.unpin(s)  # those transfers end; slots are free to allocate again
    req.num_computed_tokens = 2 * BS  # vLLM counts the external tokens already
    assert half.request_finished(req, [7, 8]) == (False, None)
    meta = half.build_connector_meta(_Out({}))
    assert meta.saves == [] and meta.release == []


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
