"""Hybrid models on vLLM's real ``Scheduler`` (hybrid KV cache manager, two KV cache
groups: layer 0 sliding-window, layer 1 full attention) with ``KVTierConnector`` in the
SCHEDULER role and the fake worker of ``sched_helpers``: the units each group stores,
the hit every group can serve, one merged async load per request, request-level load
failures."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from tests.sched_helpers import (
    BLOCK_SIZE,
    FakeWorker,
    connector,
    make_request,
    make_scheduler,
    make_vllm_config,
    meta_of,
    prompt_tokens,
    sched_half,
)
from vllm_kvtier.engine.scheduler import view_id
from vllm_kvtier.index.groups import group_key
from vllm_kvtier.keys import BlockKey

BS = BLOCK_SIZE
WINDOW = 2 * BS  # a hit of m blocks needs the sliding group's blocks [m-2, m)
SLIDING, FULL = 0, 1


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model


def hybrid_scheduler(model_dir, extra=None, num_blocks=256):
    cfg = {"cpu": {"capacity_bytes": 256 * 2 * 2 * BS * 2 * 64 * 4}, "load_or_recompute": {"enabled": False},
           **(extra or {})}
    sched = make_scheduler(make_vllm_config(model_dir, cfg), num_blocks=num_blocks, sliding_window=WINDOW)
    assert len(sched.kv_cache_config.kv_cache_groups) == 2
    return sched


def stored_positions(sched, prompt, group, n):
    """Positions < n of ``prompt`` whose unit of ``group`` is in the CPU tier."""
    half = sched_half(sched)
    hashes = make_request("probe", prompt).block_hashes
    return {p for p in range(min(n, len(hashes))) if BlockKey(group_key(hashes[p], group)) in half.planner.index}


def run(sched, worker, req_id, prompt, max_tokens=1):
    sched.add_request(make_request(req_id, prompt, max_tokens=max_tokens))
    return worker.run_until_idle(sched)


def test_sliding_group_stores_only_the_windows_and_a_repeat_loads_both_groups_in_one_job(model_dir):
    sched = hybrid_scheduler(model_dir)
    worker = FakeWorker()
    prompt = prompt_tokens(10 * BS + 8)  # 10 full blocks; the repeat boundary is 10 too
    run(sched, worker, "a", prompt)
    assert stored_positions(sched, prompt, FULL, 11) == set(range(10))
    assert stored_positions(sched, prompt, SLIDING, 11) == {8, 9}  # the window before block 10

    req = make_request("b", prompt)
    assert connector(sched).get_num_new_matched_tokens(req, 0) == (10 * BS, True)  # always async
    sched.add_request(req)
    out = worker.step(sched)
    loads = meta_of(out).loads
    assert [j.req_id for j in loads] == ["b"] and loads[0].asynchronous  # one job for both groups
    sliding_ids, full_ids = sched.kv_cache_manager.get_block_ids("b")
    assert all(b == 0 for b in sliding_ids[:8])  # vLLM's null block outside the window
    assert set(loads[0].block_ids) == set(sliding_ids[8:10]) | set(full_ids[:10])
    assert len(loads[0].block_ids) == 12
    assert sched_half(sched).planner.group_loaded_blocks == [2, 10]
    worker.run_until_idle(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not sched_half(sched).planner.tracked_requests() and not sched_half(sched).planner.held_requests()


def test_the_hit_is_the_prefix_every_group_can_serve(model_dir):
    """A prompt sharing 6 blocks: the full group has all 6, the sliding group has the
    windows of the 4-block checkpoint and of the first prompt's end only: a 4-block hit."""
    sched = hybrid_scheduler(model_dir, {"swa_checkpoint_tokens": 4 * BS + 5})  # rounded down: 4 blocks
    worker = FakeWorker()
    first = prompt_tokens(10 * BS + 8)
    run(sched, worker, "a", first)
    assert stored_positions(sched, first, SLIDING, 11) == {2, 3, 6, 7, 8, 9}  # boundaries 4, 8, 10
    shares6 = first[: 6 * BS] + prompt_tokens(3 * BS, seed=5)
    assert connector(sched).get_num_new_matched_tokens(make_request("c", shares6), 0) == (4 * BS, True)
    shares9 = first[: 9 * BS] + prompt_tokens(2 * BS, seed=6)
    assert connector(sched).get_num_new_matched_tokens(make_request("d", shares9), 0) == (9 * BS, True)


def test_a_missing_full_unit_limits_the_hit(model_dir):
    sched = hybrid_scheduler(model_dir)
    worker = FakeWorker()
    prompt = prompt_tokens(10 * BS + 8)
    run(sched, worker, "a", prompt)
    half = sched_half(sched)
    hashes = make_request("probe", prompt).block_hashes
    half.planner.drop_stored(BlockKey(group_key(hashes[9], FULL)))
    # Full group: 9 blocks; the sliding window for 9 is [7, 9): block 7 was not stored.
    assert connector(sched).get_num_new_matched_tokens(make_request("b", prompt), 0) == (0, False)


def test_sliding_decode_blocks_outside_the_final_window_are_dropped_at_finish(model_dir):
    sched = hybrid_scheduler(model_dir)
    worker = FakeWorker()
    prompt = prompt_tokens(4 * BS + 8)
    req = make_request("a", prompt, max_tokens=121)  # ends with 136 + 120 = 256 = 8 blocks computed
    sched.add_request(req)
    worker.run_until_idle(sched)
    hashes = req.block_hashes
    half = sched_half(sched)
    full = {p for p in range(len(hashes)) if BlockKey(group_key(hashes[p], FULL)) in half.planner.index}
    sliding = {p for p in range(len(hashes)) if BlockKey(hashes[p]) in half.planner.index}
    assert full == set(range(8))
    assert sliding == {2, 3, 6, 7}  # the prompt's window and the answer's final one


def test_a_failed_load_is_reported_and_recomputed_per_request(model_dir):
    sched = hybrid_scheduler(model_dir)
    worker = FakeWorker()
    prompt = prompt_tokens(10 * BS + 8)
    run(sched, worker, "a", prompt)
    worker.fail_requests.add("b")
    req = make_request("b", prompt)
    sched.add_request(req)
    worker.step(sched)  # the load is issued and fails as a whole
    assert stored_positions(sched, prompt, FULL, 11) == set()  # every unit it read is dropped
    assert stored_positions(sched, prompt, SLIDING, 11) == set()
    worker.run_until_idle(sched)  # vLLM recomputes it (no block-level error: that raises with 2 groups)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert stored_positions(sched, prompt, FULL, 11) == set(range(10))  # stored again
    assert not sched_half(sched).planner.tracked_requests() and not sched_half(sched).planner.held_requests()


def test_preemption_with_two_groups_keeps_jobs_on_owned_blocks_and_resumes_with_a_load(model_dir):
    """Two requests that outgrow the pool: one is preempted (both its views dropped),
    no job touches a block its request lost (the fake worker checks every group's), and
    the resumed request loads its own stored units of both groups."""
    sched = hybrid_scheduler(model_dir, num_blocks=12)
    initial = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    half = sched_half(sched)
    worker = FakeWorker()
    reqs = [make_request(f"r{i}", prompt_tokens(2 * BS + 1, seed=i), max_tokens=4 * BS) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    preempted = set()
    for _ in range(600):
        if not sched.has_requests():
            break
        out = worker.step(sched)
        preempted |= set(out.preempted_req_ids)
    assert preempted
    assert all(r.num_output_tokens == 4 * BS for r in reqs)
    for rid in preempted:
        # Its prompt's 2 full blocks, in both groups (the window [0, 2) of the sliding one).
        assert [len(j.block_ids) for m in worker.metas for j in m.loads if j.req_id == rid][-1] == 4
    assert not half.planner.tracked_requests() and not half.planner.held_requests()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == initial


def test_a_merged_load_is_observed_once_per_request():
    """The per-request load histograms count a vLLM request once, not once per group."""
    import time

    from vllm.v1.outputs import KVConnectorOutput

    from tests.connector.test_scheduler_nvme import FakeRequest, _Out, key
    from vllm_kvtier.config import parse_config
    from vllm_kvtier.connector.scheduler import SchedulerHalf
    from vllm_kvtier.engine.scheduler import GroupedPlanner, PlannerSetup
    from vllm_kvtier.index.groups import GroupLayout, GroupSpec

    layout = GroupLayout((GroupSpec("sliding", BS, WINDOW), GroupSpec("full", BS)))
    half = SchedulerHalf(GroupedPlanner(parse_config({}), PlannerSetup(BS, 32, 4096), layout=layout))
    hashes = [key(i) for i in range(5)]
    for i in range(4):
        half.planner.index.allocate(BlockKey(group_key(hashes[i], FULL)))
    for i in (2, 3):  # the sliding window before block 4
        half.planner.index.allocate(BlockKey(hashes[i]))
    half.planner.stats()
    req = FakeRequest("r", hashes, num_prompt_tokens=4 * BS + 1)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    half.planner.update_state_after_alloc_groups(req, ([0, 0, 12, 13, 14], [20, 21, 22, 23, 24]), 4 * BS)
    meta = half.build_connector_meta(_Out({}))
    assert [(j.req_id, sorted(j.block_ids)) for j in meta.loads] == [("r", [12, 13, 20, 21, 22, 23])]
    assert (half.planner.stats() or {}).get("histograms") == {"request_loaded_blocks|cpu": [6]}
    time.sleep(0.02)
    half.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
    (wait,) = (half.planner.stats() or {})["histograms"]["request_load_wait_seconds|cpu"]
    assert 0.02 <= wait < 5
    assert half.planner.tracked_requests() == {view_id("r", 0), view_id("r", 1)}


def test_short_first_on_a_hybrid_model_keeps_vllms_order_and_follows_no_one_after(model_dir):
    """On a hybrid model a request's estimate on arrival is its whole prompt (its groups'
    hits are known only from the lookup), and a hit always loads asynchronously: a short
    request is admitted at its lookup, so it is never seen waiting and nothing is passed
    over. Both requests still run to the end and the short one loads its stored prefix."""
    sched = hybrid_scheduler(model_dir, {"schedule": {"order": "short-first", "short_tokens": 64,
                                                      "max_wait_s": 30.0}})
    worker = FakeWorker()
    prefix = prompt_tokens(10 * BS, seed=1)
    run(sched, worker, "stored", prefix)
    order = sched_half(sched).planner.order
    sched.add_request(make_request("long", prompt_tokens(10 * BS, seed=3), max_tokens=2))
    sched.add_request(make_request("short", prefix + prompt_tokens(BS, seed=2), max_tokens=2))
    assert order.waiting() == {"long": 10 * BS, "short": 11 * BS}  # whole prompts: both long
    first = worker.step(sched)
    assert first.num_scheduled_tokens["long"] == 10 * BS  # arrival order
    assert [j.req_id for j in meta_of(first).loads] == ["short"]  # admitted, loading
    assert order.waiting() == {}
    worker.run_until_idle(sched)
    assert sched.requests == {}
    totals = sched_half(sched).planner.counters.totals
    assert totals.get("passed_over|all", 0) == 0 and totals.get("passed_over_expired|all", 0) == 0
    assert sched_half(sched).planner.group_loaded_blocks[FULL] == 10
