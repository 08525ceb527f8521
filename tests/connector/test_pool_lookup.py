"""The scheduler's existence check in a key-value pool (Mooncake) on a slow host: a lookup
that answers after ``lookup_timeout_s`` is a miss for that call (counted), and its answer,
when it comes, serves the next call asking the same keys, so that a host on which every
lookup is slower than the timeout still finds what is in the pool (a P/D decode request
then sees its prefilled blocks within its hand-off wait instead of recomputing them).

The pool client is replaced, in the tier registry, by a stand-in whose ``exists`` takes a
set time: the timing is what is under test, and a real master answers in about a
millisecond here."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_kvtier.config import parse_config
from vllm_kvtier.connector.lower import make_planners
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.registry import TIERS, TierEntry


class SlowPool:
    """Answers ``exists`` only once the test opens ``gate`` (then sets ``answered``):
    every key in ``present`` exists. The test decides when an answer comes, so nothing
    here depends on the speed of the machine."""

    present: set[str] = set()
    calls = 0
    gate = threading.Event()
    answered = threading.Event()

    @classmethod
    def from_config(cls, section, ctx) -> SlowPool:
        return cls()

    def exists(self, ids: list[str]) -> list[bool]:
        SlowPool.calls += 1
        SlowPool.gate.wait(60)
        SlowPool.answered.set()
        return [i in SlowPool.present for i in ids]

    def close(self, timeout_s: float = 30.0) -> None:
        SlowPool.gate.set()


@pytest.fixture
def slow_pool(monkeypatch):
    monkeypatch.setitem(TIERS, "mooncake", TierEntry("mooncake", f"{__name__}:SlowPool"))
    SlowPool.calls = 0
    SlowPool.gate = threading.Event()
    SlowPool.answered = threading.Event()
    return SlowPool


def answer(pool) -> None:
    """Let the pending lookup answer, and wait until it has."""
    pool.gate.set()
    assert pool.answered.wait(60)
    pool.gate, pool.answered = threading.Event(), threading.Event()


def until(cond, what: str) -> None:
    """Poll ``cond`` (which may call the planner) until it holds; 60 s at most."""
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def timeouts(counters: Counters) -> float:
    """lookup_timeouts counted since the last call."""
    return ((counters.drain() or {}).get("counters") or {}).get("lookup_timeouts|mooncake", 0)


def planner(counters: Counters):
    cfg = parse_config({"mooncake": {"master": "127.0.0.1:50051", "lookup_timeout_s": 0.05},
                        "load_or_recompute": {"enabled": False}})
    (p,) = make_planners(cfg, namespace="ns", world_size=1, block_bytes_per_rank=4096, counters=counters,
                         read_only_pool=True)
    return p


def test_a_late_answer_serves_the_next_lookup_of_the_same_keys(slow_pool):
    keys = [BlockKey(bytes([i]) * 32) for i in range(3)]
    slow_pool.present = {k.hex() for k in keys}
    counters = Counters()
    p = planner(counters)
    try:
        t = time.monotonic()
        p.discover(keys)  # times out: a miss, counted; the scheduler did not wait for the answer
        assert time.monotonic() - t < 30
        assert all(p.locate(k) is None for k in keys)
        assert timeouts(counters) == 1
        p.discover(keys)  # still running: a miss, not counted again, nothing new sent
        assert all(p.locate(k) is None for k in keys) and slow_pool.calls == 1
        answer(slow_pool)
        # Answered since: the next call uses that answer, without asking again (until the
        # lookup thread has handed the answer over, each call is a miss and sends nothing).
        until(lambda: p.discover(keys) or all(p.locate(k) is not None for k in keys), "the late answer")
        assert slow_pool.calls == 1
        assert timeouts(counters) == 0
    finally:
        p.close()


def test_a_late_answer_about_other_keys_is_not_used(slow_pool):
    first, other = [BlockKey(b"\1" * 32)], [BlockKey(b"\2" * 32)]
    slow_pool.present = {first[0].hex(), other[0].hex()}
    counters = Counters()
    p = planner(counters)
    try:
        p.discover(first)
        answer(slow_pool)
        # Once that lookup is over, a call about `other` asks afresh (and times out again):
        # the late answer was about `first`.
        until(lambda: p.discover(other) or slow_pool.calls == 2, "a second lookup")
        assert p.locate(other[0]) is None and p.locate(first[0]) is None
        assert slow_pool.calls == 2
        assert timeouts(counters) == 2
    finally:
        p.close()
