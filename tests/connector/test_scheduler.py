"""Scheduler-side tests: vLLM's real ``Scheduler`` with ``KVTierConnector`` in the
SCHEDULER role, a fake worker that completes every transfer (``sched_helpers``), no model
forward. Each test checks the connector's metadata and the scheduler's state."""

from __future__ import annotations

import time

import pytest
from vllm.v1.request import RequestStatus

from tests.sched_helpers import (
    BLOCK_SIZE,
    FakeWorker,
    all_loads,
    all_saves,
    assert_scheduler_empty,
    block_bytes,
    connector,
    free_blocks,
    make_request,
    make_scheduler,
    make_vllm_config,
    meta_of,
    prompt_tokens,
    sched_half,
)

BS = BLOCK_SIZE


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    """The tiny float32 Llama of ``conftest`` (built locally once per session)."""
    return tiny_model


def new_scheduler(model_dir, extra=None, num_blocks=128, **kw):
    sched = make_scheduler(make_vllm_config(model_dir, extra, **kw), num_blocks=num_blocks)
    return sched, free_blocks(sched)


def store_prompt(sched, worker, req_id, prompt, max_tokens=1):
    """Run one request to the end so its blocks are in the CPU tier."""
    sched.add_request(make_request(req_id, prompt, max_tokens=max_tokens))
    worker.run_until_idle(sched)


def keys_of(prompt, n_blocks):
    return tuple(make_request("probe", prompt).block_hashes[:n_blocks])


def lookup(sched, prompt):
    """What the connector would offer a new request with ``prompt`` (side-effect free)."""
    return connector(sched).get_num_new_matched_tokens(make_request("probe", prompt), 0)


# ---- 1. first request: no hit, saves, held until finished_sending ---------------------


def test_first_request_saves_prompt_and_decode_blocks_and_frees_them_at_once(model_dir):
    sched, initial = new_scheduler(model_dir, {"cpu": {"capacity_bytes": 64 * block_bytes()}})
    half = sched_half(sched)
    worker = FakeWorker()
    prompt = prompt_tokens(4 * BS + 8)  # 4 full prompt blocks + a partial one
    req = make_request("a", prompt, max_tokens=57)  # ends with 136 + 56 = 192 = 6 blocks computed
    assert connector(sched).get_num_new_matched_tokens(req, 0) == (0, False)
    sched.add_request(req)

    out = worker.step(sched)
    assert out.num_scheduled_tokens == {"a": len(prompt)}
    assert not out.has_sync_kv_loads
    meta = meta_of(out)
    assert meta.loads == [] and meta.saves == [] and meta.freed == []
    block_ids = list(sched.kv_cache_manager.get_block_ids("a")[0])
    # The prompt blocks are saved right after the prefill forward, in the same step.
    assert [j.block_ids for j in meta.saves_after] == [tuple(block_ids[:4])]
    assert meta.saves_after[0].keys == tuple(req.block_hashes[:4])

    while req.status == RequestStatus.RUNNING:
        block_ids = list(sched.kv_cache_manager.get_block_ids("a")[0])  # freed with the request
        out = worker.step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(block_ids) == 6
    assert req.num_computed_tokens == 6 * BS
    # request_finished let vLLM free the blocks at once (the next step may schedule into
    # them): nothing is held for our copies.
    assert "a" not in sched.requests and not half.planner.held_requests()
    assert free_blocks(sched) == initial

    # The last decode block was saved after the final forward; the next step names the
    # request as freed, so the worker orders that save before the step's forward.
    sched.add_request(make_request("b", prompt_tokens(BS + 1, seed=3), max_tokens=1))
    out = worker.step(sched)
    meta = meta_of(out)
    assert meta.freed == ["a"]
    assert meta.saves == []
    worker.run_until_idle(sched)

    saves = all_saves(worker.metas, "a")
    saved_keys = [k for j in saves for k in j.keys]
    assert saved_keys == list(req.block_hashes[:6])  # 4 prompt + 2 decode blocks, once each
    saved_slots = [s for j in saves for s in j.slots]
    assert len(set(saved_slots)) == 6
    assert [b for j in saves for b in j.block_ids] == block_ids[:6]
    assert all(half.planner.index.slot(k) == s for k, s in zip(saved_keys, saved_slots, strict=True))
    assert not all_loads(worker.metas)
    assert_scheduler_empty(sched, initial)


# ---- 2. second request: block-aligned sync hit -----------------------------------------


def test_second_request_sync_hit_is_block_aligned_and_skips_last_token(model_dir):
    sched, initial = new_scheduler(model_dir, {"cpu": {"capacity_bytes": 64 * block_bytes()}})
    worker = FakeWorker()
    prompt = prompt_tokens(4 * BS + 1)
    store_prompt(sched, worker, "a", prompt)  # stores 4 blocks
    slot_of = {k: s for j in all_saves(worker.metas, "a") for k, s in zip(j.keys, j.slots, strict=True)}
    assert len(slot_of) == 4

    # Hits are whole blocks and never cover the last prompt token.
    assert lookup(sched, prompt) == (4 * BS, False)  # 129 tokens: all 4 blocks
    assert lookup(sched, prompt[: 4 * BS]) == (3 * BS, False)  # exactly 4 blocks: 3
    assert lookup(sched, prompt[: 4 * BS - 5]) == (3 * BS, False)
    assert lookup(sched, prompt[: BS + 1]) == (BS, False)
    assert lookup(sched, prompt[:BS]) == (0, False)
    assert lookup(sched, prompt[: 2 * BS] + prompt_tokens(2 * BS, seed=9)) == (2 * BS, False)
    assert lookup(sched, prompt_tokens(4 * BS + 1, seed=5)) == (0, False)

    worker.metas.clear()
    b = make_request("b", prompt[: 4 * BS], max_tokens=3)
    sched.add_request(b)
    out = worker.step(sched)
    assert out.has_sync_kv_loads
    assert out.num_scheduled_tokens == {"b": BS}  # only the last block is computed
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BS
    (load,) = meta_of(out).loads
    b_blocks = sched.kv_cache_manager.get_block_ids("b")[0]
    assert load.req_id == "b" and not load.asynchronous
    assert load.block_ids == tuple(b_blocks[:3])
    assert load.keys == tuple(b.block_hashes[:3]) == keys_of(prompt, 3)
    assert load.slots == tuple(slot_of[k] for k in load.keys)
    assert meta_of(out).saves == []
    # Sync load pins end with the step that issues them.
    assert not any(sched_half(sched).planner.index.is_pinned(s) for s in load.slots)

    worker.run_until_idle(sched)
    assert b.num_output_tokens == 3
    # Nothing new to save (its 4th block is stored already), so nothing was held.
    assert all_saves(worker.metas, "b") == []
    assert all(m.freed == [] for m in worker.metas)
    assert len(all_loads(worker.metas)) == 1
    assert_scheduler_empty(sched, initial)


# ---- 3. async load ----------------------------------------------------------------------


def test_async_load_parks_request_until_finished_recving(model_dir):
    sched, initial = new_scheduler(
        model_dir, {"load_mode": "async", "cpu": {"capacity_bytes": 64 * block_bytes()}})
    half = sched_half(sched)
    worker = FakeWorker(auto_recv=False)
    prompt = prompt_tokens(4 * BS + 1)
    store_prompt(sched, worker, "a", prompt)
    assert lookup(sched, prompt) == (4 * BS, True)

    b = make_request("b", prompt, max_tokens=2)
    sched.add_request(b)
    out = worker.step(sched)
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {}
    assert not out.has_sync_kv_loads
    (load,) = meta_of(out).loads
    assert load.asynchronous and load.req_id == "b"
    assert load.keys == tuple(b.block_hashes[:4])
    assert load.block_ids == tuple(sched.kv_cache_manager.get_block_ids("b")[0][:4])
    assert free_blocks(sched) == initial - 4  # blocks for the load only, so far
    assert all(half.planner.index.is_pinned(s) for s in load.slots)

    for _ in range(3):  # nothing runs while the load is in flight
        out = worker.step(sched)
        assert out.num_scheduled_tokens == {}
        assert meta_of(out).loads == []
        assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    worker.complete_recv("b")
    out = worker.step(sched)  # this step's output reports finished_recving={"b"}
    assert out.num_scheduled_tokens == {}
    assert not any(half.planner.index.is_pinned(s) for s in load.slots)

    out = worker.step(sched)
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.scheduled_new_reqs[0].req_id == "b"
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * BS
    assert meta_of(out).loads == []  # loaded once

    worker.run_until_idle(sched)
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.num_output_tokens == 2
    assert_scheduler_empty(sched, initial)


# ---- 4. capacity, LRU eviction, pins ---------------------------------------------------


def _check_index(sched, worker):
    half = sched_half(sched)
    index = half.planner.index
    assert len(index) <= index.num_slots
    assert index.used_slots <= index.num_slots
    slots = list([s for _, s in index.items()])
    assert len(set(slots)) == len(slots)
    # The index only names slots whose bytes the worker holds for that key, or will
    # write first thing next step (final saves of requests finished in this step).
    pending = {k for j in half.planner.pending_final_saves() for k in j.keys}
    for key, slot in index.items():
        assert worker.pool.get(slot) == key or key in pending


def test_capacity_bounds_the_index_and_evicts(model_dir):
    slots = 4
    sched, initial = new_scheduler(model_dir, {"cpu": {"capacity_bytes": slots * block_bytes() + 100}})
    index = sched_half(sched).planner.index
    assert index.num_slots == slots
    worker = FakeWorker()
    prompts = [prompt_tokens(3 * BS + 5, seed=i) for i in range(6)]  # 6 x (3..4 blocks) >> 4 slots
    for i, p in enumerate(prompts):
        sched.add_request(make_request(f"r{i}", p, max_tokens=20))
    while sched.has_requests():
        worker.step(sched)
        _check_index(sched, worker)
    assert index.evictions > 0
    assert len(index) == slots
    saved = all_saves(worker.metas)
    assert sum(len(j.keys) for j in saved) > slots
    assert_scheduler_empty(sched, initial)


def test_lru_evicts_least_recently_used(model_dir):
    sched, initial = new_scheduler(model_dir, {"cpu": {"capacity_bytes": 4 * block_bytes()}})
    index = sched_half(sched).planner.index
    worker = FakeWorker()
    pa, pb, pd = (prompt_tokens(2 * BS + 1, seed=s) for s in (1, 2, 3))
    store_prompt(sched, worker, "a", pa)
    store_prompt(sched, worker, "b", pb)
    assert len(index) == 4 and index.evictions == 0
    # A hit on A's blocks makes them the most recently used ...
    store_prompt(sched, worker, "c", pa)
    assert len(all_loads(worker.metas, "c")) == 1
    # ... so D's two blocks evict B's, not A's.
    store_prompt(sched, worker, "d", pd)
    _check_index(sched, worker)
    assert index.evictions == 2
    assert all(k in index for k in keys_of(pa, 2))
    assert all(k in index for k in keys_of(pd, 2))
    assert not any(k in index for k in keys_of(pb, 2))
    assert lookup(sched, pb) == (0, False)
    assert lookup(sched, pa) == (2 * BS, False)
    assert_scheduler_empty(sched, initial)


def test_prompt_of_whole_blocks_async_load_covers_it_all_sync_load_not_the_last_block(model_dir):
    """A prompt of exactly 4 blocks: an async load offers all 4 (vLLM's scheduler then
    recomputes only the last token), a sync one 3 (vLLM computes at least one token in
    the admitting step, so the block holding the last token is recomputed)."""
    prompt = prompt_tokens(4 * BS)
    for mode, offered in (("sync", 3), ("async", 4)):
        t0 = time.perf_counter()
        sched, initial = new_scheduler(model_dir, {"load_mode": mode, "cpu": {"capacity_bytes": 64 * block_bytes()}})
        worker = FakeWorker()
        store_prompt(sched, worker, "a", prompt)
        assert lookup(sched, prompt) == (offered * BS, mode == "async"), mode
        b = make_request("b", prompt, max_tokens=2)
        sched.add_request(b)
        outs = worker.run_until_idle(sched)
        (load,) = all_loads(worker.metas, "b")
        assert load.keys == tuple(b.block_hashes[:offered]), mode
        first = next(o for o in outs if "b" in o.num_scheduled_tokens)
        # What vLLM computes itself: the last token after a full async load, the whole
        # last block after a sync one.
        assert first.num_scheduled_tokens["b"] == (1 if mode == "async" else BS), mode
        assert first.scheduled_new_reqs[0].num_computed_tokens == (4 * BS - 1 if mode == "async" else 3 * BS)
        assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.num_output_tokens == 2
        assert_scheduler_empty(sched, initial)
        # Looked up: what a load could cover, for "a" and "b" (so a full hit reads 100%).
        counters = sched_half(sched).planner.counters.totals
        assert counters["lookup_blocks|cpu"] == 2 * offered and counters["hit_blocks|cpu"] == offered, mode
        # the scheduler thread's time in our calls is counted, and is part of this run's
        assert 0 < counters["scheduler_seconds|cpu"] < time.perf_counter() - t0, mode


def test_slot_pinned_by_async_load_is_never_reused_by_a_save(model_dir):
    sched, initial = new_scheduler(
        model_dir, {"load_mode": "async", "cpu": {"capacity_bytes": 4 * block_bytes()}})
    index = sched_half(sched).planner.index
    worker = FakeWorker(auto_recv=False)
    pa, pb = prompt_tokens(2 * BS + 1, seed=1), prompt_tokens(2 * BS + 1, seed=2)
    store_prompt(sched, worker, "a", pa)
    store_prompt(sched, worker, "b", pb)
    b_slots = {index.slot(k) for k in keys_of(pb, 2)}
    assert len(index) == 4

    # C hits A's blocks asynchronously: their slots are pinned while it loads.
    sched.add_request(make_request("c", pa, max_tokens=1))
    out = worker.step(sched)
    (load,) = meta_of(out).loads
    assert load.asynchronous and load.keys == keys_of(pa, 2)
    assert all(index.is_pinned(s) for s in load.slots)

    # D needs 3 slots while only B's 2 are unpinned: it evicts B's and skips its 3rd block.
    pd = prompt_tokens(3 * BS + 1, seed=3)
    sched.add_request(make_request("d", pd, max_tokens=1))
    for _ in range(4):
        worker.step(sched)  # FakeWorker fails if a save lands on a slot C still reads
        _check_index(sched, worker)
    assert "d" not in sched.requests
    (d_save,) = all_saves(worker.metas, "d")
    assert d_save.keys == keys_of(pd, 2)
    assert set(d_save.slots) == b_slots
    assert not set(d_save.slots) & set(load.slots)
    assert keys_of(pd, 3)[2] not in index
    assert [index.slot(k) for k in keys_of(pa, 2)] == list(load.slots)
    assert sched.requests["c"].status == RequestStatus.WAITING_FOR_REMOTE_KVS

    worker.complete_recv("c")
    worker.run_until_idle(sched)
    assert "c" not in sched.requests
    assert_scheduler_empty(sched, initial)


# ---- 5. load failure -------------------------------------------------------------------


def test_sync_load_failure_recomputes_and_drops_keys(model_dir):
    sched, initial = new_scheduler(model_dir, {"cpu": {"capacity_bytes": 64 * block_bytes()}})
    index = sched_half(sched).planner.index
    worker = FakeWorker()
    prompt = prompt_tokens(4 * BS + 1)
    store_prompt(sched, worker, "a", prompt)
    keys = keys_of(prompt, 4)

    b = make_request("b", prompt, max_tokens=2)
    sched.add_request(b)
    worker.fail_load_positions["b"] = [2]  # the worker reports the 3rd loaded block bad
    out = worker.step(sched)
    assert out.has_sync_kv_loads and out.num_scheduled_tokens == {"b": 1}
    (load,) = meta_of(out).loads
    assert len(load.block_ids) == 4
    # Recompute policy: b keeps running from the first bad block, no token was emitted.
    assert b.status == RequestStatus.RUNNING
    assert b.num_computed_tokens == 2 * BS
    assert b.num_output_tokens == 0
    # The connector dropped the bad key: an identical request now hits 2 blocks, not 4.
    assert keys[2] not in index
    assert all(k in index for k in keys[:2])
    assert lookup(sched, prompt) == (2 * BS, False)

    out = worker.step(sched)
    assert out.num_scheduled_tokens == {"b": len(prompt) - 2 * BS}
    assert meta_of(out).loads == []
    worker.run_until_idle(sched)
    assert b.num_output_tokens == 2
    # The recomputed block is stored again, so the full hit comes back.
    assert keys[2] in index
    assert lookup(sched, prompt) == (4 * BS, False)
    assert_scheduler_empty(sched, initial)


# ---- 6. abort and preemption -------------------------------------------------------------


def test_abort_during_async_load_frees_once(model_dir):
    sched, initial = new_scheduler(
        model_dir, {"load_mode": "async", "cpu": {"capacity_bytes": 64 * block_bytes()}})
    half = sched_half(sched)
    worker = FakeWorker(auto_recv=False)
    prompt = prompt_tokens(4 * BS + 1)
    store_prompt(sched, worker, "a", prompt)

    sched.add_request(make_request("b", prompt, max_tokens=4))
    out = worker.step(sched)
    (load,) = meta_of(out).loads
    assert sched.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS

    aborted = sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in aborted] == ["b"]
    # vLLM keeps the blocks under the in-flight load; the connector does not hold them
    # too (it would free them twice) and names it in no freed list.
    assert "b" in sched.requests
    assert free_blocks(sched) == initial - 4
    assert all(half.planner.index.is_pinned(s) for s in load.slots)
    out = worker.step(sched)
    assert meta_of(out).freed == [] and meta_of(out).saves == []
    assert "b" in sched.requests

    worker.complete_recv("b")
    worker.step(sched)  # finished_recving frees the aborted request's blocks
    assert "b" not in sched.requests
    assert not sched.has_requests()
    assert_scheduler_empty(sched, initial)


def test_abort_running_request_frees_its_blocks_and_orders_its_saves(model_dir):
    sched, initial = new_scheduler(model_dir, {"cpu": {"capacity_bytes": 64 * block_bytes()}})
    worker = FakeWorker()
    sched.add_request(make_request("a", prompt_tokens(2 * BS + 3), max_tokens=50))
    worker.step(sched)
    worker.step(sched)  # prompt blocks saved
    assert all_saves(worker.metas, "a")
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert "a" not in sched.requests  # freed at once: its saves are ordered instead
    out = worker.step(sched)
    assert meta_of(out).freed == ["a"]
    assert_scheduler_empty(sched, initial)


def test_preemption_drops_state_and_resume_hits_own_blocks(model_dir):
    # 7 usable GPU blocks for two requests that each grow to 5: one is preempted.
    sched, initial = new_scheduler(
        model_dir, {"cpu": {"capacity_bytes": 64 * block_bytes()}}, num_blocks=8)
    half = sched_half(sched)
    worker = FakeWorker()
    reqs = [make_request(f"r{i}", prompt_tokens(2 * BS + 1, seed=i), max_tokens=4 * BS) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    preempted = set()
    for _ in range(400):
        if not sched.has_requests():
            break
        out = worker.step(sched)  # FakeWorker: no job touches blocks its request lost
        preempted |= set(out.preempted_req_ids)
        for rid in out.preempted_req_ids:
            assert rid not in half.planner.tracked_requests() or sched.requests[rid].num_computed_tokens > 0
        _check_index(sched, worker)
    assert preempted
    assert all(r.num_output_tokens == 4 * BS for r in reqs)
    # A resumed request reloads its own saved prompt blocks.
    for rid in preempted:
        assert all_loads(worker.metas, rid)
    assert_scheduler_empty(sched, initial)


def test_same_step_resume_after_reset_keeps_async_load_pins(model_dir):
    # reset_prefix_cache(reset_running_requests=True) preempts every running request
    # outside schedule(); the next schedule() resumes them and reports them preempted in
    # the same step. A resumed request's fresh async load must stay pinned.
    sched, initial = new_scheduler(
        model_dir, {"load_mode": "async", "cpu": {"capacity_bytes": 4 * block_bytes()}})
    half = sched_half(sched)
    index = half.planner.index
    worker = FakeWorker(auto_recv=True)
    pa = prompt_tokens(2 * BS + 1, seed=1)
    store_prompt(sched, worker, "a", pa)
    store_prompt(sched, worker, "b", prompt_tokens(2 * BS + 1, seed=2))
    # R hits A's blocks, loads them, and runs.
    r = make_request("r", pa, max_tokens=20)
    sched.add_request(r)
    for _ in range(3):
        worker.step(sched)
    assert r.status == RequestStatus.RUNNING
    worker.auto_recv = False

    assert sched.reset_prefix_cache(reset_running_requests=True)
    assert r.status == RequestStatus.PREEMPTED
    out = worker.step(sched)
    assert "r" in out.preempted_req_ids
    (load,) = meta_of(out).loads
    assert load.req_id == "r" and load.asynchronous
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert all(index.is_pinned(s) for s in load.slots)
    assert "r" in half.planner.tracked_requests()

    # A save that needs slots while R loads must not take R's.
    sched.add_request(make_request("d", prompt_tokens(3 * BS + 1, seed=3), max_tokens=1))
    for _ in range(3):
        worker.step(sched)
        _check_index(sched, worker)
    worker.complete_recv("r")
    worker.run_until_idle(sched)
    assert r.num_output_tokens == 20
    assert_scheduler_empty(sched, initial)


def test_an_idle_engine_writes_back_what_dram_holds_whatever_the_admission(model_dir, tmp_path):
    """NVMe write-back with ``admit_min_seen: 2``: a prompt seen once is still on NVMe for
    the next process. vLLM's real scheduler is kept stepping while the engine is
    idle until those blocks are planned for writing, and each is marked for the shutdown
    flush; then the engine goes quiet."""
    sched, _ = new_scheduler(model_dir, {"cpu": {"capacity_bytes": 64 * block_bytes()},
                                         "nvme": {"path": str(tmp_path), "capacity_bytes": 1 << 30,
                                                  "admit_min_seen": 2}})
    worker = FakeWorker()
    prompt = prompt_tokens(4 * BS + 8)
    store_prompt(sched, worker, "a", prompt)  # runs until the scheduler has nothing to do
    keys = list(keys_of(prompt, 4))
    flushed = [k for m in worker.metas for job in m.write_through if job.tier == "nvme" for k in job.keys]
    assert sorted(flushed) == sorted(keys)  # in an idle step, not on eviction (nothing was evicted)
    assert all(not m.demotes for m in worker.metas)
    marked = {s for m in worker.metas for s in m.persist_slots.get("nvme", [])}
    assert marked == {s for j in all_saves(worker.metas, "a") for s in j.slots}
    assert not sched.has_requests()  # nothing left to flush: no more idle steps
