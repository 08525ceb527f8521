"""The KV-aware and ARC eviction policies, on tiny hand-made traces (integer keys)."""

from __future__ import annotations

import pytest

from vllm_kvtier.index.arc import ARCPolicy
from vllm_kvtier.index.kvaware import KVAwarePolicy
from vllm_kvtier.index.policy import LRUPolicy
from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.ops.trace_gen import DocQASpec, docqa_records
from vllm_kvtier.ops.trace_sim import make_trace, simulate_belady, simulate_infinite, simulate_policy


def anything(_: object) -> bool:
    return True


def chain(policy, keys: list[int], parent: int | None = None) -> None:
    """Store ``keys`` as one prompt: each key's parent is the one before it."""
    for k in keys:
        policy.insert(k, parent)
        parent = k


def test_a_child_leaves_before_its_parent_where_lru_drops_the_head():
    kv, lru = KVAwarePolicy(4), LRUPolicy()
    for p in (kv, lru):
        chain(p, [1, 2, 3])
    assert lru.evict(anything) == 1  # LRU drops the head: 2 and 3 can never hit again
    assert kv.evict(anything) == 3  # the tail goes first
    kv.access(2)  # reusing the child alone does not lift it over its parent
    assert kv.evict(anything) == 2
    assert kv.evict(anything) == 1


def test_a_block_stored_without_its_parent_goes_first():
    kv = KVAwarePolicy(4)
    chain(kv, [1, 2])
    kv.insert(9)  # an unrelated, newer first block
    kv.insert(7, 5)  # its parent 5 is not stored: it can never hit
    assert kv.evict(anything) == 7


def test_a_burst_ages_out():
    kv = KVAwarePolicy(4, protect_ops=8)
    kv.insert(100)
    for _ in range(20):  # a burst of reuse
        kv.access(100)
    fresh = iter(range(1000, 2000))
    victims = []
    for _ in range(3):  # just after the burst the one-off keys leave first
        kv.insert(next(fresh))
        if len(kv) > 4:
            victims.append(kv.evict(anything))
    assert 100 not in victims and kv.level(100) == 20
    for _ in range(20):  # then, unused for longer than its extra time, it goes
        kv.insert(next(fresh))
        victims.append(kv.evict(anything))
    assert 100 in victims


def test_a_scan_does_not_flush_a_reused_prompt():
    hot = [1, 2, 3, 4]
    kv, lru = KVAwarePolicy(8), LRUPolicy()
    for p in (kv, lru):
        chain(p, hot)
        for k in hot:  # a second request reuses the prompt
            p.access(k)
        for k in range(1000, 1030):  # then 30 one-off blocks through an 8-slot pool
            p.insert(k)
            while len(p) > 8:
                p.evict(anything)
    assert set(hot) <= set(kv)
    assert not set(hot) & set(lru)


def test_an_evicted_block_stored_again_comes_back_protected():
    kv = KVAwarePolicy(2)
    kv.insert(1)
    kv.insert(2)
    assert kv.evict(anything) == 1
    kv.insert(1)  # its name is in the history: stored again, it has shown reuse
    assert kv.level(1) == 1 and kv.level(2) == 0
    assert kv.evict(anything) == 2


def test_note_below_makes_a_copy_cheaper_to_drop():
    kv = KVAwarePolicy(4)
    kv.insert(1)
    kv.access(1)
    kv.insert(2)
    kv.access(2)
    kv.note_below(2)  # a lower tier holds 2: losing it from DRAM costs a read only
    assert kv.evict(anything) == 2


def test_slot_index_passes_the_parent_and_a_pin_counts_as_reuse():
    ix = SlotIndex(3, eviction="kvaware")
    keys = [BlockKey(bytes([i]) * 8) for i in range(5)]
    ix.allocate(keys[0])
    ix.allocate(keys[1], keys[0])
    ix.allocate(keys[2], keys[1])
    assert ix.allocate(keys[3]).evicted == keys[2]  # type: ignore[union-attr]
    ix.pin_key(keys[0], 5.0)
    ix.unpin_key(keys[0])
    assert ix.policy.level(keys[0]) == 1  # type: ignore[attr-defined]


def test_arc_keeps_keys_seen_twice_through_a_scan():
    arc = ARCPolicy(8)
    hot = [1, 2, 3, 4]
    for k in hot:
        arc.insert(k)
    for k in hot:
        arc.access(k)
    for k in range(1000, 1030):
        arc.insert(k)
        while len(arc) > 8:
            arc.evict(anything)
    assert set(hot) <= set(arc) and all(arc.in_t2(k) for k in hot)


def test_arc_ghost_hit_moves_the_target():
    arc = ARCPolicy(2)
    arc.insert(1)
    arc.insert(2)
    assert arc.evict(anything) == 1
    arc.insert(1)  # in B1: recency wanted more room
    assert arc.p > 0 and arc.in_t2(1)


def conversations(n: int, turns: int, gap: int) -> list[list[int]]:
    """``n`` conversations of ``turns`` turns, each turn adding 2 blocks, a turn's next one
    coming ``gap`` requests later; one-off requests of 3 blocks fill the gaps."""
    out: list[list[int]] = []
    nxt = 10_000
    chats = [[0, 100 * (c + 1)] for c in range(n)]
    for t in range(turns):
        for c in range(n):
            chats[c] = chats[c] + [100 * (c + 1) + 2 * t + 1, 100 * (c + 1) + 2 * t + 2]
            out.append(list(chats[c]))
            for _ in range(gap):
                out.append([0, nxt, nxt + 1, nxt + 2])
                nxt += 3
    return out


def trace_of(prompts: list[list[int]]):
    return make_trace([{"timestamp": i, "input_length": 512 * len(p), "output_length": 1, "hash_ids": p}
                       for i, p in enumerate(prompts)], 512)


def test_kvaware_keeps_returning_conversations_that_lru_and_arc_lose():
    tr = trace_of(conversations(4, 6, 3))
    share = {p: simulate_policy(tr, 20, p).hit_share for p in ("lru", "s3fifo", "arc", "kvaware")}
    assert share["lru"] == share["arc"] == share["s3fifo"]  # the shared first block only
    assert share["kvaware"] > share["lru"] + 0.02  # plus the conversations' earlier turns
    assert share["kvaware"] <= simulate_belady(tr, 20).hit_share


def test_docqa_trace_is_deterministic_and_shares_document_heads():
    spec = DocQASpec(requests=200, documents=10, seed=3)
    a, b = docqa_records(spec), docqa_records(spec)
    assert a == b and len(a) == 200
    assert docqa_records(DocQASpec(requests=200, documents=10, seed=4)) != a
    tr = make_trace(a, 512)
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in a)
    assert simulate_infinite(tr).hit_share > 0.5  # the heads are reused, the tails never
    with pytest.raises(ValueError, match="document-QA"):
        docqa_records(DocQASpec(documents=0))


def test_over_a_write_back_tier_a_new_block_gets_a_full_pass_of_the_pool():
    # Below DRAM, a write-back tier writes what is still in DRAM at its flush: DRAM is
    # a staging area, and a reused block must not cut a new block's wait short.
    for staging, victim in ((False, 2), (True, 1)):
        kv = KVAwarePolicy(4, staging=staging)
        kv.insert(1)
        kv.access(1)
        for k in (2, 3, 4):
            kv.insert(k)
        assert kv.evict(anything) == victim


def test_the_history_window_follows_its_bets():
    kv = KVAwarePolicy(2, history_factor=8)
    start = kv.window
    kv.insert(1)
    kv.insert(2)
    assert kv.evict(anything) == 1
    kv.insert(1)  # back on the history's word (a trial)
    kv.access(1)  # ... and hit: the bet was good
    assert kv.window > start
    kv2 = KVAwarePolicy(2, history_factor=8)
    kv2.insert(1)
    kv2.insert(2)
    kv2.evict(anything)
    kv2.insert(1)  # a trial, never hit before it leaves
    kv2.discard(2)
    kv2.insert(3)
    kv2.insert(4)
    while len(kv2) > 0:
        kv2.evict(anything)
    assert kv2.window < start


def test_a_copy_noted_below_keeps_its_place_in_time():
    """Hearing that a lower tier stores a key is not a use: it must not make it younger."""
    kv = KVAwarePolicy(4)
    for k in (1, 2, 3):
        kv.insert(k)
    kv.note_below(1)
    assert [kv.evict(anything) for _ in range(3)] == [1, 2, 3]
