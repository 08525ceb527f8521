"""The trace replay of ``kvtier plan --trace`` (vllm_kvtier/ops/trace_sim.py).

LRU is checked against an independent prefix-hit simulation written here from the
definition (an OrderedDict, nothing of the package), Belady's MIN against an exhaustive
search of every eviction choice, and the tiers below CPU on hand-made traces whose writes
and hits are counted by hand.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path

import pytest

from vllm_kvtier.ops.trace_sim import (
    LowerTier,
    TierSetup,
    Trace,
    TraceError,
    infer_block_tokens,
    make_trace,
    read_trace,
    simulate_belady,
    simulate_infinite,
    simulate_policy,
    simulate_tiers,
)

SAMPLE = Path(__file__).parent / "data" / "mooncake_conversation_first500.jsonl"


def trace_of(requests: list[list[int]], block_tokens: int = 4, lengths: list[int] | None = None) -> Trace:
    """Requests of whole blocks (or of ``lengths`` tokens), one second apart."""
    lengths = lengths or [len(ids) * block_tokens for ids in requests]
    return make_trace([{"timestamp": 1000 * i, "input_length": n, "output_length": 1, "hash_ids": ids}
                       for i, (ids, n) in enumerate(zip(requests, lengths, strict=True))], block_tokens)


def independent_lru(records: list[dict], capacity: int, block_tokens: int, step: int | None = None) -> tuple[int, int]:
    """(hit tokens, hit blocks): a request reuses the longest run of its leading blocks in
    the cache; then each of its blocks becomes the most recently used (inserted if absent,
    the least recently used leaving a full cache), ``step`` blocks at a time (all of them
    when None). A block stored in a step is not evicted by the same step (the plugin holds
    it until the step's save is planned): when only those are left, the block is not stored."""
    cache: OrderedDict[int, None] = OrderedDict()
    tokens = blocks = 0
    for r in sorted(records, key=lambda r: r["timestamp"]):
        ids = r["hash_ids"]
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        tokens += min(n * block_tokens, r["input_length"])
        blocks += n
        size = step or max(1, len(ids))
        for lo in range(0, len(ids), size):
            held: set[int] = set()
            for h in ids[lo : lo + size]:
                if h in cache:
                    cache.move_to_end(h)
                    continue
                if len(cache) >= capacity:
                    victim = next((k for k in cache if k not in held), None)
                    if victim is None:
                        continue
                    del cache[victim]
                cache[h] = None
                held.add(h)
    return tokens, blocks


def synthetic_records(seed: int, n: int = 400) -> list[dict]:
    """Conversations that extend earlier prompts, a shared first block, one-off documents."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    next_id = 1
    out = []
    for i in range(n):
        if convs and rng.random() < 0.6:
            c = rng.choice(convs)
            c.extend(range(next_id, next_id + rng.randint(1, 3)))
            next_id += len(c)
            ids = list(c)
        else:
            k = rng.randint(1, 8)
            ids = [0, *range(next_id, next_id + k)]
            next_id += k
            if rng.random() < 0.5:
                convs.append(ids)
        out.append({"timestamp": i * 100, "input_length": len(ids) * 16 - rng.randint(0, 15),
                    "hash_ids": list(ids)})
    return out


@pytest.mark.parametrize("step", [None, 1, 3])
@pytest.mark.parametrize("capacity", [1, 5, 20, 60, 200])
def test_lru_matches_an_independent_prefix_simulation_on_a_synthetic_trace(capacity, step):
    records = synthetic_records(seed=capacity)
    got = simulate_policy(make_trace(records, 16), capacity, "lru", step)
    assert (got.hit_tokens, got.hit_blocks) == independent_lru(records, capacity, 16, step)
    assert got.hit_blocks > 0 or capacity == 1


@pytest.mark.parametrize(("capacity", "step"), [(50, None), (50, 16), (300, 16), (1000, None), (3000, 16)])
def test_lru_matches_an_independent_prefix_simulation_on_the_mooncake_sample(capacity, step):
    records = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    got = simulate_policy(read_trace(SAMPLE), capacity, "lru", step)
    assert (got.hit_tokens, got.hit_blocks) == independent_lru(records, capacity, 512, step)
    assert got.hit_tokens > 0


def test_the_mooncake_sample_reads_with_its_block_size_inferred():
    tr = read_trace(SAMPLE)
    assert tr.block_tokens == 512 and len(tr) == 500
    assert tr.prompt_tokens == sum(json.loads(line)["input_length"] for line in SAMPLE.read_text().splitlines())
    inf = simulate_infinite(tr)
    # the bounds are ordered: a bounded cache never beats MIN, MIN never beats infinite
    for cap in (100, 1000):
        lru, s3, opt = simulate_policy(tr, cap, "lru"), simulate_policy(tr, cap, "s3fifo"), simulate_belady(tr, cap)
        assert max(lru.hit_tokens, s3.hit_tokens) <= opt.hit_tokens <= inf.hit_tokens


def test_hits_count_the_prompt_tokens_of_a_partial_last_block():
    # 10 tokens in blocks of 4: blocks of 4, 4 and 2 tokens
    tr = trace_of([[1, 2, 3], [1, 2, 3], [1, 2, 9]], lengths=[10, 10, 10])
    inf = simulate_infinite(tr)
    assert inf.hit_tokens == 10 + 8 and inf.hit_blocks == 3 + 2
    assert simulate_policy(tr, 3, "lru").hit_tokens == 10 + 8


def test_belady_on_a_cycle_keeps_what_comes_back_soonest():
    # one block a request: a b c a b c with room for 2. MIN does not store c (used
    # furthest), so a and b hit; LRU evicts each block just before its reuse: no hit.
    tr = trace_of([[1], [2], [3], [1], [2], [3]])
    assert simulate_belady(tr, 2).hit_blocks == 2
    assert simulate_policy(tr, 2, "lru").hit_blocks == 0
    assert simulate_belady(tr, 3).hit_blocks == 3 == simulate_infinite(tr).hit_blocks


def optimum(seq: list[int], capacity: int) -> int:
    """The most hits any eviction choice (storing a missed key or not) achieves."""
    best = 0

    def walk(i: int, held: frozenset[int], hits: int) -> None:
        nonlocal best
        if hits + (len(seq) - i) <= best:
            return
        if i == len(seq):
            best = max(best, hits)
            return
        k = seq[i]
        if k in held:
            walk(i + 1, held, hits + 1)
            return
        walk(i + 1, held, hits)  # not stored
        if len(held) < capacity:
            walk(i + 1, held | {k}, hits)
        else:
            for v in held:
                walk(i + 1, (held - {v}) | {k}, hits)

    walk(0, frozenset(), 0)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_belady_reaches_the_exhaustive_optimum(seed):
    rng = random.Random(seed)
    seq = [rng.randint(1, 5) for _ in range(12)]
    for capacity in (1, 2, 3):
        got = simulate_belady(trace_of([[k] for k in seq]), capacity)
        assert got.hit_blocks == optimum(seq, capacity), (seq, capacity)


def test_infinite_bound_is_the_prefix_of_blocks_seen_before():
    tr = trace_of([[1, 2], [1, 3], [4, 2], [1, 2, 3]])
    # [1,2]: 0; [1,3]: 1; [4,2]: 0 (4 new, 2 behind it does not count); [1,2,3]: 3
    assert simulate_infinite(tr).hit_blocks == 4


def nvme(**kw) -> LowerTier:
    base = dict(name="nvme", capacity_blocks=100, mode="write-back", admit_min_seen=1, chunk_blocks=1)
    return LowerTier(**{**base, **kw})


def test_write_back_demotes_what_the_cpu_tier_evicts_and_serves_it_from_below():
    # CPU holds 2 blocks. [1,2] then [3,4] evicts 1 and 2 to NVMe; [1,2] hits there.
    tr = trace_of([[1, 2], [3, 4], [1, 2]])
    r = simulate_tiers(tr, TierSetup(cpu_blocks=2, cpu_eviction="lru", lower=(nvme(block_bytes=1000),)))
    cpu, low = r.tiers
    assert (cpu.hit_blocks, low.hit_blocks) == (0, 2)
    assert low.hit_tokens == 8 and r.tokens_to_compute == 3 * 8 - 8
    # 1 and 2 demoted (one chunk each); promoting them evicts 3 and 4, demoted as well
    assert low.written_blocks == 4 and low.write_ops == 4
    assert low.written_bytes == 4 * (4096 + 4096)  # a 4 KiB header and the block aligned to 4 KiB
    assert low.read_ops == 2  # one read a chunk


def test_nvme_admission_keeps_blocks_seen_once_off_the_ssd():
    tr = trace_of([[1, 2], [1, 5], [3, 4], [1, 2]])
    r = simulate_tiers(tr, TierSetup(cpu_blocks=2, cpu_eviction="lru", lower=(nvme(admit_min_seen=2),)))
    low = r.tiers[1]
    # only block 1 was in two requests when it left DRAM
    assert low.written_blocks == 1
    assert (r.tiers[0].hit_blocks, low.hit_blocks) == (1, 1)  # [1,5]: 1 in DRAM; [1,2]: 1 on NVMe, 2 gone


def test_write_through_writes_every_admitted_save_at_once_and_the_tier_is_bounded():
    tr = trace_of([[1, 2], [3, 4], [5, 6], [1, 2]])
    r = simulate_tiers(tr, TierSetup(cpu_blocks=2, cpu_eviction="lru",
                                     lower=(nvme(mode="write-through", capacity_blocks=4, chunk_blocks=2),)))
    low = r.tiers[1]
    assert low.written_blocks == 8 and low.write_ops == 4  # 6 saved, then 1 and 2 again
    # 4 blocks of room: [5,6] evicted the chunk [1,2], so the last request misses
    assert low.hit_blocks == 0 and low.evicted_blocks == 4


def test_write_back_flushes_blocks_older_than_the_interval():
    # requests 1 s apart, flush after 1.5 s in DRAM: [1,2] is written at the third request
    tr = trace_of([[1, 2], [3], [4], [5]])
    r = simulate_tiers(tr, TierSetup(cpu_blocks=10, lower=(nvme(flush_interval_s=1.5),)))
    assert r.tiers[1].written_blocks == 3  # 1, 2 at t=2 s; 3 at t=3 s; 4 and 5 are too young
    r0 = simulate_tiers(tr, TierSetup(cpu_blocks=10, lower=(nvme(flush_interval_s=0.0),)))
    assert r0.tiers[1].written_blocks == 0


def test_s3_below_nvme_is_inclusive_and_takes_what_nvme_lost():
    tr = trace_of([[1, 2], [3, 4], [5, 6], [1, 2]])
    s3 = nvme(name="s3", mode="write-through", capacity_blocks=None)
    r = simulate_tiers(tr, TierSetup(cpu_blocks=2, cpu_eviction="lru", lower=(nvme(capacity_blocks=2), s3)))
    cpu, nv, obj = r.tiers
    assert obj.written_blocks == 6  # every save
    assert (cpu.hit_blocks, nv.hit_blocks, obj.hit_blocks) == (0, 0, 2)
    assert obj.read_ops == 2  # 1 and 2 are in two chunks of one block: a read each
    assert r.tokens_to_compute == 4 * 8 - 8


def test_bad_traces_are_refused_with_the_line_named(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"timestamp": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: no 'input_length'"):
        read_trace(p, 16)
    p.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": ["a"]}\n')
    with pytest.raises(TraceError, match=r":1: hash_ids must be a list of integers"):
        read_trace(p, 16)
    p.write_text("[1]\n")
    with pytest.raises(TraceError, match="not a JSON object"):
        read_trace(p)
    p.write_text("")
    with pytest.raises(TraceError, match="no request"):
        read_trace(p)
    # 3 ids for 40 tokens needs B = 16; 1 id for 5000 tokens needs B >= 5000
    p.write_text('{"timestamp": 0, "input_length": 40, "hash_ids": [1, 2, 3]}\n'
                 '{"timestamp": 5, "input_length": 5000, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match="give the trace's block size"):
        read_trace(p)
    with pytest.raises(TraceError, match="not a regular file"):
        read_trace(tmp_path)


def test_block_size_inference_takes_the_smallest_that_explains_every_request():
    assert infer_block_tokens([{"input_length": 40, "hash_ids": [1, 2, 3]}]) == 16
    assert infer_block_tokens([{"input_length": 600, "hash_ids": [1, 2]},
                               {"input_length": 512, "hash_ids": [1]}]) == 512
    assert infer_block_tokens([{"input_length": 600, "hash_ids": [1]}]) == 1024


def test_a_block_stored_past_the_end_of_the_hit_is_touched_by_the_save():
    # room for 3: [4, 2] misses on 4 but finds 2 stored: saving it makes it the most
    # recently used, so [5] evicts 3, not 2, and [2] hits
    tr = trace_of([[1], [2], [3], [4, 2], [5], [2]])
    assert simulate_policy(tr, 3, "lru").hit_blocks == 1


def test_a_trace_of_prompt_tokens_gets_chained_block_ids(tmp_path):
    a = list(range(1000))
    b = a[:600] + [7] * 500  # shares the first 512-token block with a, not the second
    c = a + list(range(5000, 5100))  # a conversation's next turn: extends a
    p = tmp_path / "tokens.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "prompt_token_ids": t, "output_length": 5}) + "\n"
                         for i, t in enumerate([a, b, c])))
    tr = read_trace(p)
    assert tr.block_tokens == 512 and tr.block_tokens_source == "default for prompt_token_ids"
    ka, kb, kc = tr.keys
    assert len(ka) == 2 and len(kc) == 3 and tr.input_lengths == (1000, 1100, 1100)
    assert ka[0] == kb[0] and ka[1] != kb[1] and kc[:1] == ka[:1]
    # a's last block is partial (488 tokens): c's second block holds more tokens, another id
    assert kc[1] != ka[1]
    assert simulate_infinite(tr).hit_tokens == 512 + 512
    # written back as hash ids, it reads the same (and holds no token)
    from vllm_kvtier.ops.trace_sim import trace_records

    out = tmp_path / "ids.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in trace_records(tr)))
    assert "prompt_token_ids" not in out.read_text()
    again = read_trace(out, 512)
    assert again.keys == tr.keys and again.input_lengths == tr.input_lengths
    with pytest.raises(TraceError, match="prompt_token_ids must be a list of token ids"):
        p.write_text('{"timestamp": 0, "prompt_token_ids": [1, "x"]}\n')
        read_trace(p)


def test_at_the_engines_block_size_a_partial_last_block_is_not_stored():
    # 10 tokens in blocks of 4: [1, 2] full, 3 partial. Room for 2 blocks.
    tr = trace_of([[1, 2, 3], [1, 2, 3], [9]], lengths=[10, 10, 4])
    coarse = simulate_tiers(tr, TierSetup(cpu_blocks=2, cpu_eviction="lru", step_blocks=1))
    exact = simulate_tiers(tr, TierSetup(cpu_blocks=2, cpu_eviction="lru", step_blocks=1, save_partial_blocks=False))
    # stored whole, 3 evicts 1 and the second request finds nothing; not stored, 1 and 2 stay
    assert coarse.tiers[0].hit_blocks == 0 and exact.tiers[0].hit_blocks == 2


def test_sampling_keeps_whole_conversations():
    from vllm_kvtier.ops.trace_sim import sample_conversations

    # 200 conversations of 3 turns, all behind a shared first block 0
    records = [{"timestamp": t, "input_length": 16 * (2 + t), "hash_ids": [0, g, *range(10**6 + g * 10, 10**6 + g * 10 + t)]}
               for t in range(3) for g in range(1, 201)]
    kept = sample_conversations(records, 0.25, seed=1)
    groups = {r["hash_ids"][1] for r in kept}
    assert 30 <= len(groups) <= 70  # about a quarter
    assert len(kept) == 3 * len(groups)  # every turn of a kept conversation
    assert sample_conversations(records, 0.25, seed=1) == kept and sample_conversations(records, 0.25, seed=2) != kept
    assert simulate_infinite(make_trace(kept, 16)).hit_share > 0.3  # the turns still reuse each other


def test_writes_in_flight_are_not_loadable_until_confirmed():
    # [1,2] then [3,4] demotes 1 and 2; [1,2] right after finds them on NVMe at once (lag 0),
    # or not yet (lag 1: the writes of request 2 are loadable from request 4)
    tr = trace_of([[1, 2], [3, 4], [1, 2], [1, 2]])
    now = simulate_tiers(tr, TierSetup(cpu_blocks=2, cpu_eviction="lru", lower=(nvme(),)))
    late = simulate_tiers(tr, TierSetup(cpu_blocks=2, cpu_eviction="lru", lower=(nvme(),), confirm_lag_requests=1))
    assert [t.hit_blocks for t in now.tiers] == [2, 2]  # request 3 from NVMe, request 4 from DRAM
    assert [t.hit_blocks for t in late.tiers] == [2, 0]  # request 3 recomputes; 4 hits DRAM
