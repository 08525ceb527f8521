"""The CPU index and its LRU policy, with integer-like keys (no vLLM, no torch)."""

from __future__ import annotations

import pytest

from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.keys import BlockKey, NamespaceFields, namespace


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "big"))


def test_allocate_until_full_then_evict_lru():
    idx = SlotIndex(3)
    assert [idx.allocate(k(i)).slot for i in range(3)] == [0, 1, 2]
    idx.touch(k(0))  # 1 is now the least recently used
    a = idx.allocate(k(3))
    assert a.evicted == k(1) and a.slot == 1
    assert k(1) not in idx and len(idx) == 3 and idx.evictions == 1


def test_pinned_slots_are_never_evicted():
    idx = SlotIndex(2)
    idx.allocate(k(0))
    idx.allocate(k(1))
    idx.pin(idx.slot(k(0)))
    assert idx.allocate(k(2)).evicted == k(1)
    idx.pin(idx.slot(k(2)))
    assert idx.allocate(k(3)) is None  # every slot is read by a transfer
    idx.unpin(idx.slot(k(0)))
    assert idx.allocate(k(3)).evicted == k(0)


def test_remove_while_pinned_frees_slot_only_after_unpin():
    idx = SlotIndex(1)
    s = idx.allocate(k(0)).slot
    idx.pin(s)
    assert idx.remove(k(0))
    assert idx.allocate(k(1)) is None  # slot still read by the transfer
    idx.unpin(s)
    assert idx.allocate(k(1)).slot == s


def test_match_prefix_stops_at_first_gap():
    idx = SlotIndex(8)
    for i in (0, 1, 2, 4):
        idx.allocate(k(i))
    keys = [k(i) for i in range(6)]
    assert idx.match_prefix(keys) == 3
    assert idx.match_prefix(keys, start=1) == 2
    assert idx.match_prefix(keys, start=3) == 0


def test_zero_capacity_stores_nothing():
    idx = SlotIndex(0)
    assert idx.allocate(k(0)) is None


def test_duplicate_allocate_is_an_error():
    idx = SlotIndex(2)
    idx.allocate(k(0))
    with pytest.raises(KeyError):
        idx.allocate(k(0))


def test_namespace_changes_with_every_field():
    base = NamespaceFields("m", "bfloat16", 16, 32, 8, 128, 1, 0, "L", "sha256")
    seen = {namespace(base)}
    for change in [dict(model="m2"), dict(kv_dtype="fp8"), dict(block_size=32), dict(num_layers=1),
                   dict(num_kv_heads=4), dict(head_size=64), dict(tp_size=2), dict(tp_rank=1),
                   dict(layout="X"), dict(hash_algo="xxhash"), dict(format_version=99)]:
        ns = namespace(NamespaceFields(**{**base.__dict__, **change}))
        assert ns not in seen
        seen.add(ns)
    assert namespace(base) == namespace(NamespaceFields(**base.__dict__))  # stable


# ---- eviction policies and key pins through the index ----------------------------------


def test_default_policy_is_lru_and_the_name_selects_another():
    assert SlotIndex(3).eviction == "lru"
    assert SlotIndex(3, eviction="s3fifo").eviction == "s3fifo"
    with pytest.raises(ValueError, match="unknown eviction policy"):
        SlotIndex(3, eviction="mru")


def test_s3fifo_index_keeps_a_reused_prefix_through_a_flood_lru_does_not():
    def run(eviction: str) -> list[bool]:
        idx = SlotIndex(40, eviction=eviction)
        prompt = [k(i) for i in range(10)]  # a system prompt's blocks
        for key in prompt:
            idx.allocate(key)
        for key in prompt:  # a second request hits them, as the scheduler does
            idx.touch(key)
        for i in range(100, 200):  # one-off documents: 100 blocks through 40 slots
            assert idx.allocate(k(i)) is not None
        return [key in idx for key in prompt]

    assert not any(run("lru"))
    assert all(run("s3fifo"))


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_pins_and_removal_hold_under_every_policy(eviction):
    idx = SlotIndex(2, eviction=eviction)
    s0 = idx.allocate(k(0)).slot
    idx.allocate(k(1))
    idx.pin(s0)
    assert idx.allocate(k(2)).evicted == k(1)
    idx.pin(idx.slot(k(2)))
    assert idx.allocate(k(3)) is None and idx.evictions == 1
    assert idx.remove(k(0))
    assert idx.allocate(k(3)) is None  # the removed key's slot is still read
    idx.unpin(s0)
    assert idx.allocate(k(3)).slot == s0
    assert sorted(s for _, s in idx.items()) == [0, 1] and len(idx) == idx.used_slots == 2


def test_key_pin_and_slot_pin_are_separate():
    idx = SlotIndex(2, eviction="s3fifo", max_pinned_fraction=0.5, clock=lambda: 0.0)
    s = idx.allocate(k(0)).slot
    idx.allocate(k(1))
    idx.pin_key(k(0), 30)
    idx.pin(s)
    idx.unpin(s)  # the transfer ended: the key pin still holds
    assert not idx.is_pinned(s) and idx.key_pinned(k(0))
    assert idx.allocate(k(2)).evicted == k(1)
    assert idx.unpin_key(k(0))
    assert idx.key_pinned(k(0)) is False and idx.allocate(k(3)).evicted is not None


def test_resize_while_empty_then_refused_once_a_slot_is_in_use():
    """The scheduler learns the workers' pool size at start-up: the index takes it while it
    holds nothing, and refuses it after (its slots would name rows of another pool)."""
    idx = SlotIndex(4, max_pinned_fraction=0.5)
    idx.resize(6)
    assert idx.num_slots == 6
    got = [idx.allocate(k(i)) for i in range(6)]
    assert sorted(a.slot for a in got if a is not None) == list(range(6))
    with pytest.raises(ValueError, match="in use"):
        idx.resize(8)
    small = SlotIndex(8)
    small.resize(2)
    assert [small.allocate(k(i)).slot for i in range(2)] == [0, 1]
    assert small.allocate(k(2)).evicted == k(0)  # full at 2: the least recently used goes
