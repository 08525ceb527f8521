"""The scheduler's existence check in a key-value pool (Mooncake) on a slow host: a lookup
is submitted and never waited for. While its answer may still come within
``lookup_timeout_s``, the planner says so (the request asks again next step); past it, the
lookup is counted once as timed out, its keys are a miss, and nothing more is sent while it
hangs; its answer, when it comes, is indexed without asking again, so a host on which
every lookup is slower than the timeout still finds what is in the pool (a P/D decode
request then sees its prefilled blocks within its hand-off wait instead of recomputing
them).

The pool client is replaced, in the tier registry, by a stand-in whose ``exists`` takes a
set time: the timing is what is under test, and a real master answers in about a
millisecond here."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_kvtier.config import parse_config
from vllm_kvtier.engine.lower import make_planners
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.mooncake.spec import MooncakeSpec
from vllm_kvtier.tiers.registry import TIERS


class SlowPool:
    """Answers ``exists`` only once the test opens ``gate`` (then sets ``answered``):
    every key in ``present`` exists. The test decides when an answer comes, so nothing
    here depends on the speed of the machine."""

    present: set[str] = set()
    calls = 0
    gate = threading.Event()
    answered = threading.Event()


    def exists(self, ids: list[str]) -> list[bool]:
        SlowPool.calls += 1
        SlowPool.gate.wait(60)
        SlowPool.answered.set()
        return [i in SlowPool.present for i in ids]

    def close(self, timeout_s: float = 30.0) -> None:
        SlowPool.gate.set()


class SlowPoolSpec(MooncakeSpec):
    """The Mooncake tier's spec over :class:`SlowPool`."""

    requires = ()

    def open_store(self, section, ctx) -> SlowPool:  # type: ignore[override]
        return SlowPool()


SLOW_POOL = SlowPoolSpec()


@pytest.fixture
def slow_pool(monkeypatch):
    monkeypatch.setitem(TIERS, "mooncake", f"{__name__}:SLOW_POOL")
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


def planner(counters: Counters, timeout_s: float = 0.05):
    cfg = parse_config({"mooncake": {"master": "127.0.0.1:50051", "lookup_timeout_s": timeout_s},
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
        p.discover(keys)  # submitted (True while its answer may still come: ask again next step)
        assert time.monotonic() - t < 30  # the scheduler did not wait for it
        assert all(p.locate(k) is None for k in keys)
        until(lambda: not p.discover(keys), "the lookup's deadline")  # past it: a miss, counted
        assert all(p.locate(k) is None for k in keys)
        assert timeouts(counters) == 1
        assert not p.discover(keys)  # still running: a miss, not counted again, nothing new sent
        assert all(p.locate(k) is None for k in keys) and slow_pool.calls == 1
        answer(slow_pool)
        # Answered since: the next call indexes that answer, without asking again (until the
        # lookup thread has handed the answer over, each call is a miss and sends nothing).
        until(lambda: p.discover(keys) or all(p.locate(k) is not None for k in keys), "the late answer")
        assert slow_pool.calls == 1
        assert timeouts(counters) == 0
    finally:
        p.close()


def test_a_late_answer_is_indexed_and_other_keys_are_asked_afresh(slow_pool):
    first, other = [BlockKey(b"\1" * 32)], [BlockKey(b"\2" * 32)]
    slow_pool.present = {first[0].hex(), other[0].hex()}
    counters = Counters()
    p = planner(counters)
    try:
        p.discover(first)
        answer(slow_pool)
        # Once that lookup is over, a call about `other` asks afresh; the answer about
        # `first` is what the pool holds: indexed, whoever asks next.
        until(lambda: (p.discover(other), slow_pool.calls == 2)[1], "a second lookup")
        assert p.locate(other[0]) is None and p.locate(first[0]) is not None
        until(lambda: not p.discover(other), "the second lookup's deadline")
        assert slow_pool.calls == 2
        assert timeouts(counters) == 1  # the second; the first answered in time or late
    finally:
        p.close()


def test_lookups_submitted_together_go_in_one_request(slow_pool):
    """Keys asked while a lookup runs are queued and sent together in the next one."""
    a, b, c = (BlockKey(bytes([i]) * 32) for i in (7, 8, 9))
    slow_pool.present = {a.hex(), b.hex(), c.hex()}
    counters = Counters()
    p = planner(counters, timeout_s=60.0)  # no deadline passes here, however slow the host
    try:
        assert p.discover([a])
        until(lambda: slow_pool.calls == 1, "the first lookup sent")
        assert p.discover([b]) and p.discover([c])  # queued behind it, within their deadline
        answer(slow_pool)
        until(lambda: slow_pool.calls == 2, "the second lookup sent")
        slow_pool.gate.set()  # answers at once (it may have started before the gate was renewed)
        until(lambda: p.discover([a, b, c]) or all(p.locate(k) is not None for k in (a, b, c)), "both answers")
        assert slow_pool.calls == 2
    finally:
        p.close()
