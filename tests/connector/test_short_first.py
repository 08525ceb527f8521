"""``schedule.order: short-first`` on vLLM's real ``Scheduler`` (``sched_helpers``: a fake
worker that completes every transfer, no forward): which of two waiting requests is
admitted first, and every outcome of the policy forced (passed over, bound reached, the
short one aborted, vLLM's order kept with ``fifo``). No clock is read by an assertion:
the bound is either far (30 s) or zero."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from tests.sched_helpers import (
    BLOCK_SIZE,
    FakeWorker,
    assert_scheduler_empty,
    free_blocks,
    make_request,
    make_scheduler,
    make_vllm_config,
    prompt_tokens,
    sched_half,
)

BS = BLOCK_SIZE
#: the stored prefix: 10 blocks
PREFIX = prompt_tokens(10 * BS, seed=1)
#: 32 tokens to compute after a 10-block hit (a sync load stops short of the last block)
SHORT = PREFIX + prompt_tokens(BS, seed=2)
#: 320 tokens, none stored
LONG = prompt_tokens(10 * BS, seed=3)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model


def schedule_cfg(order: str = "short-first", max_wait_s: float = 30.0) -> dict:
    return {"schedule": {"order": order, "short_tokens": 64, "max_wait_s": max_wait_s}}


def setup(model_dir, extra: dict, second=None):
    """A scheduler whose CPU tier holds ``PREFIX``, then the long request queued before
    the request ``second()`` builds (default: the short one)."""
    sched = make_scheduler(make_vllm_config(model_dir, extra), num_blocks=128)
    initial = free_blocks(sched)
    worker = FakeWorker()
    sched.add_request(make_request("stored", PREFIX, max_tokens=1))
    worker.run_until_idle(sched)
    sched.add_request(make_request("long", LONG, max_tokens=2))
    sched.add_request(second() if second is not None else make_request("short", SHORT, max_tokens=2))
    return sched, worker, initial


def counter(sched, name: str) -> float:
    return sched_half(sched).planner.counters.totals.get(f"{name}|all", 0)


def test_a_short_request_is_admitted_before_a_long_one_queued_ahead_of_it(model_dir):
    sched, worker, initial = setup(model_dir, schedule_cfg())
    # Estimated on arrival from the CPU tier: the short one's prefix is stored.
    assert sched_half(sched).planner.order.waiting() == {"long": 10 * BS, "short": 11 * BS - 10 * BS}
    first = worker.step(sched)
    assert dict(first.num_scheduled_tokens) == {"short": BS}  # 10 blocks loaded, 32 computed
    assert counter(sched, "passed_over") == 1
    second = worker.step(sched)
    assert second.num_scheduled_tokens["long"] == 10 * BS  # nothing shorter waits now
    worker.run_until_idle(sched)
    assert counter(sched, "passed_over") == 1 and counter(sched, "passed_over_expired") == 0
    assert sched_half(sched).planner.order.waiting() == {}
    assert_scheduler_empty(sched, initial)


def test_fifo_keeps_vllms_order(model_dir):
    sched, worker, initial = setup(model_dir, schedule_cfg(order="fifo"))
    assert sched_half(sched).planner.order is None
    first = worker.step(sched)
    assert dict(first.num_scheduled_tokens) == {"long": 10 * BS, "short": BS}  # arrival order, one step
    assert list(first.num_scheduled_tokens)[0] == "long"
    worker.run_until_idle(sched)
    assert counter(sched, "passed_over") == 0
    assert_scheduler_empty(sched, initial)


def test_a_zero_bound_keeps_vllms_order(model_dir):
    # No short request is fresh for 0 s, so none holds the long one back.
    sched, worker, initial = setup(model_dir, schedule_cfg(max_wait_s=0.0))
    first = worker.step(sched)
    assert dict(first.num_scheduled_tokens) == {"long": 10 * BS, "short": BS}
    assert list(first.num_scheduled_tokens)[0] == "long"
    assert counter(sched, "passed_over") == 0
    worker.run_until_idle(sched)
    assert_scheduler_empty(sched, initial)


def test_the_long_request_goes_once_the_short_one_waiting_is_aborted(model_dir):
    # The short one ends before any step: nothing shorter waits, the long one goes.
    sched, worker, initial = setup(model_dir, schedule_cfg())
    sched.finish_requests("short", RequestStatus.FINISHED_ABORTED)  # aborted while waiting
    assert "short" not in sched_half(sched).planner.order.waiting()
    first = worker.step(sched)
    assert dict(first.num_scheduled_tokens) == {"long": 10 * BS}
    assert counter(sched, "passed_over") == 0
    worker.run_until_idle(sched)
    assert sched_half(sched).planner.order.waiting() == {}
    assert_scheduler_empty(sched, initial)


def test_a_request_that_reads_no_cache_is_not_judged_by_its_hits(model_dir):
    # prompt_logprobs: vLLM recomputes the whole prompt whatever the lookup says (and
    # would override a "not yet"), so the short prompt is not short, and not followed.
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    sched, worker, _ = setup(model_dir, schedule_cfg(), lambda: Request(
        request_id="logprobs", prompt_token_ids=list(SHORT),
        sampling_params=SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1),
        pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256)))
    assert sched.requests["logprobs"].skip_reading_prefix_cache
    assert list(sched_half(sched).planner.order.waiting()) == ["long"]
    first = worker.step(sched)
    assert dict(first.num_scheduled_tokens) == {"long": 10 * BS, "logprobs": 11 * BS}
    assert counter(sched, "passed_over") == 0


# ---- the policy alone, on a hand-driven clock ----------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(max_wait_s: float = 0.5):
    from vllm_kvtier.metrics import Counters
    from vllm_kvtier.plan.short_first import ShortFirst

    clock = Clock()
    return ShortFirst(short_tokens=64, max_wait_s=max_wait_s, counters=Counters(), clock=clock), clock


def test_passed_over_until_max_wait_from_the_first_time_then_followed_no_more():
    order, clock = policy()
    order.arrived("long", 500)
    order.arrived("short", 40)
    assert not order.admit("long", 500)
    clock.now += 0.4
    assert not order.admit("long", 500)
    clock.now += 0.1
    assert order.admit("long", 500)  # 0.5 s after the first time
    assert order.waiting() == {"short": 40}
    assert order.admit("long", 500)  # no longer followed: vLLM's order (not counted again)
    assert order.counters.totals == {"passed_over|all": 2, "passed_over_expired|all": 1}


def test_a_short_request_not_looked_up_within_max_wait_stops_holding_others_back():
    order, clock = policy()
    order.arrived("short", 10)  # say vLLM keeps skipping it (no LoRA slot): never looked up
    clock.now += 0.4
    order.arrived("long", 500)
    assert not order.admit("long", 500)
    clock.now += 0.2  # the short one was last seen 0.6 s ago; the long one passed 0.2 s ago
    assert order.admit("long", 500)
    assert order.counters.totals == {"passed_over|all": 1}  # not the bound: no fresh short one
    assert order.admit("short", 10)  # looked up at last: fresh again
    order.arrived("long2", 500)
    assert not order.admit("long2", 500)


def test_what_the_lookup_finds_replaces_the_estimate():
    order, _ = policy()
    order.arrived("a", 500)
    order.arrived("b", 500)  # estimated long (say its prefix is in vLLM's own cache)
    assert order.admit("a", 500)  # nothing short waits
    assert order.admit("b", 10)  # looked up: short
    assert not order.admit("a", 500)  # now something short waits
    order.gone("b")  # admitted
    assert order.admit("a", 500)


def test_short_and_unknown_requests_are_never_passed_over():
    order, _ = policy()
    order.arrived("short", 10)
    order.arrived("other-short", 64)
    assert order.admit("short", 10) and order.admit("other-short", 64)
    assert order.admit("preempted", 900)  # not seen to arrive: a resumed request
    assert order.counters.totals == {}


def test_followed_requests_are_bounded_oldest_first(monkeypatch):
    from vllm_kvtier.plan import short_first

    monkeypatch.setattr(short_first, "MAX_WAITING", 3)
    order, _ = policy()
    for i in range(5):
        order.arrived(f"r{i}", 10)
    assert list(order.waiting()) == ["r2", "r3", "r4"]
