"""Prefetch: a conversation's blocks that left DRAM while its request ran are promoted back
from NVMe when the request ends, so the next turn loads everything from DRAM."""

from __future__ import annotations

import random

from tests.conftest import (
    BLOCK_SIZE,
    close_llm,
    generate,
    kvtier_config,
    kvtier_counters,
    make_llm,
    rand_tokens,
    settle,
)
from tests.connector.test_scheduler_nvme import FakeRequest, _Out, key, make_two_tiers
from tests.integration.test_nvme_engine import BLOCK_BYTES
from vllm_kvtier.jobs import WorkerReport


def test_prefetch_restores_a_finished_chain_without_evicting_it(tmp_path):
    half = make_two_tiers(tmp_path, num_slots=6)
    nvme = half.planner.lower_tier("nvme")
    nvme.index.add_existing("n0", [key(0), key(1)], 3 * 4096)  # the chain's head, demoted
    for k in (key(2), key(3), key(100), key(101)):  # its tail and someone else's blocks
        half.planner.index.allocate(k)
    half.planner.index.allocate(key(102))
    half.planner.index.allocate(key(103))  # DRAM is full
    half.planner.extras.prefetcher.predict([key(i) for i in range(4)])
    meta = half.build_connector_meta(_Out({}))
    (job,) = meta.prefetches
    (read,) = job.reads
    assert read.tier == "nvme" and read.keys == (key(0), key(1)) and read.positions == (0, 1)
    assert all(k in half.planner.index for k in (key(2), key(3)))  # the chain's tail was not evicted
    assert key(100) not in half.planner.index and key(101) not in half.planner.index  # the oldest others were
    # Not readable from DRAM until the workers report it.
    req = FakeRequest("r", [key(i) for i in range(5)], num_prompt_tokens=4 * BS + 1)
    assert half.planner.get_num_new_matched_tokens(req, 0) == (None, False)  # key 0 lands soon: ask again
    half.update_connector_output(_Conn(WorkerReport(prefetched={job.prefetch_id: 1})))
    half.planner.lookups.forget("r")
    req2 = FakeRequest("r2", [key(i) for i in range(5)], num_prompt_tokens=4 * BS + 1)
    assert half.planner.get_num_new_matched_tokens(req2, 0) == (4 * BS, False)  # all in DRAM: sync
    assert half.planner.counters.totals["prefetch_blocks|nvme"] == 2


def test_prefetch_is_cancelled_when_every_slot_is_pinned(tmp_path):
    half = make_two_tiers(tmp_path, num_slots=2)
    half.planner.lower_tier("nvme").index.add_existing("n0", [key(0)], 2 * 4096)
    for k in (key(100), key(101)):
        half.planner.index.pin(half.planner.index.allocate(k).slot)  # live transfers hold every slot
    half.planner.extras.prefetcher.predict([key(0)])
    meta = half.build_connector_meta(_Out({}))
    assert meta.prefetches == []
    assert half.planner.counters.totals["prefetch_cancelled|cpu"] == 1


class _Conn:
    def __init__(self, meta: WorkerReport) -> None:
        self.kv_connector_worker_meta = meta
        self.finished_recving = set()
        self.finished_sending = set()
        self.invalid_block_ids = set()
        self.kv_connector_stats = None


BS = BLOCK_SIZE


def _conversation(tiny_model, tmp_path, prefetch: bool):
    """Turn 1 of A, then other traffic evicts A's prompt blocks (demoted to NVMe) while A
    is still generating; A ends; turn 2 of A."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(5)
    a = rand_tokens(rng, 8 * BS + 1)
    fillers = [rand_tokens(rng, 8 * BS + 1) for _ in range(2)]
    kv = kvtier_config({
        "cpu": {"capacity_bytes": 16 * BLOCK_BYTES, "eviction": "lru"},
        "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 64 * 2**20, "admit_min_seen": 1},
        "prefetch": {"enabled": prefetch},
    })
    llm = make_llm(tiny_model, kv)
    try:
        eng = llm.llm_engine
        sp = SamplingParams(temperature=0, max_tokens=2 * BS, ignore_eos=True, detokenize=False)
        eng.add_request("A", TokensPrompt(prompt_token_ids=a), sp)
        eng.step()  # A's prompt is computed and saved
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
        for i, f in enumerate(fillers):
            eng.add_request(f"F{i}", TokensPrompt(prompt_token_ids=f), one)
        answer: list[int] = []
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.request_id == "A" and out.finished:
                    answer = list(out.outputs[0].token_ids)
        settle(llm)  # the prefetch reads land
        turn2 = a + answer + rand_tokens(rng, 40)
        res = generate(llm, turn2)
        counters = kvtier_counters(llm)
    finally:
        close_llm(llm)
    return turn2, res, counters


def test_next_turn_loads_from_dram_after_prefetch(tiny_model, tmp_path, engine_mode):
    turn2, with_pf, c = _conversation(tiny_model, tmp_path / "on", prefetch=True)
    base = make_llm(tiny_model, None)
    try:
        expect = generate(base, turn2).tokens
    finally:
        close_llm(base)
    stored = (8 * BS + 1 + 2 * BS - 1) // BS  # turn 1 computed its prompt and all but its last token
    assert with_pf.tokens == expect
    if engine_mode == "multiprocess":
        # The EngineCore runs ahead of this client: how many of A's blocks were evicted
        # before A ended, and whether a prefetch landed before turn 2 came, depend on the
        # machine's speed. What holds at any speed: every stored block is loaded from some
        # tier, and prefetched blocks are only ever used after they were read. (The run
        # without prefetch is in-process only: with prefetch off, the mode changes nothing.)
        assert with_pf.loaded + with_pf.loaded_nvme == stored
        assert c.get("prefetch_used_blocks|cpu", 0) <= c.get("prefetch_blocks|nvme", 0)
        return
    _, without, c0 = _conversation(tiny_model, tmp_path / "off", prefetch=False)
    assert without.tokens == expect
    assert without.loaded_nvme > 0  # without prefetch, part of the prefix comes from NVMe
    assert without.loaded + without.loaded_nvme == stored
    assert with_pf.loaded_nvme == 0 and with_pf.loaded == stored  # with it, all from DRAM
    assert c["prefetch_blocks|nvme"] >= without.loaded_nvme
    assert c["prefetch_used_blocks|cpu"] > 0 and c0.get("prefetch_blocks|nvme", 0) == 0
