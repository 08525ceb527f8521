"""The worker half's saves after a forward on a host KV cache: they run on the copy thread
and are done before the step's last call returns (vLLM may give their blocks to another
request before our next call), are settled by the step's end or the next step that uses
pool slots on the host, and a failed one leaves its slots empty (a future miss), never
served; lower-tier writes of those slots wait for them to be settled."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from vllm_kvtier.config import parse_config
from vllm_kvtier.jobs import ChunkWriteJob, LoadJob, SaveJob, StepPlan
from vllm_kvtier.metrics import sample_key
from vllm_kvtier.transfer.worker import WorkerHalf, WorkerSetup

NUM_BLOCKS = 16
SLOTS = 8


class _RecordingTier:
    """A lower-tier driver that records what it was asked to write and whether the slots
    held their keys and no unsettled save was still filling them at that moment."""

    def __init__(self, worker: WorkerHalf) -> None:
        self.worker = worker
        self.written: list[tuple[ChunkWriteJob, bool]] = []
        #: per job written: copied out at once (a demotion) or on the store's thread
        self.copy_now: dict[str, bool] = {}

    def write(self, jobs: list[ChunkWriteJob], *, copy_now: bool = False) -> None:
        for j in jobs:
            self.copy_now[j.chunk_id] = copy_now
            slots = self.worker.slots
            assert slots is not None
            held = all(slots.holds(s, k) for s, k in zip(j.slots, j.keys, strict=True))
            filling = {s for h in self.worker.saves.in_flight() for s in h.job.slots}
            self.written.append((j, held and not filling & set(j.slots)))

    def clean(self, slots) -> None: ...
    def mark_dirty(self, slots) -> None: ...
    def delete(self, ids) -> None: ...
    def forget(self, ids) -> None: ...
    def poll(self) -> list: return []
    def pending_reads(self) -> bool: return False
    def take_meta(self, meta) -> None: ...
    def close(self) -> None: ...


def _worker(others: Callable[[WorkerHalf], dict] = lambda w: {}
            ) -> tuple[WorkerHalf, dict[str, torch.Tensor], _RecordingTier]:
    """A worker whose lower tiers are ``others(worker)`` and a recording "nvme" tier."""
    tiers: dict = {}
    w = WorkerHalf(parse_config({"cpu": {"capacity_bytes": 1 << 26}}),
                   WorkerSetup(num_blocks=NUM_BLOCKS, pool_slots=lambda: SLOTS, make_tiers=lambda *a, **k: tiers))
    with torch.inference_mode():
        kv = {f"model.layers.{i}.self_attn.attn": torch.randn((NUM_BLOCKS, 2, 32, 128)).to(torch.bfloat16)
              for i in range(2)}
    w.register_kv_caches(kv)
    tier = _RecordingTier(w)
    tiers.update(others(w))
    tiers["nvme"] = tier
    return w, kv, tier


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


class _HeldCopyThread:
    """Holds the worker's copy thread until a save submitted behind it is waited for, or
    until a copy on the calling thread drains the copy thread's queue: the saves stay in
    flight exactly until the worker waits for them (no timing)."""

    def __init__(self, w: WorkerHalf) -> None:
        assert w.engine is not None
        self.worker = w
        self.release = threading.Event()
        self.waited: list[SaveJob] = []
        self.drained = False
        w.engine._bg.submit(self.release.wait, 60)  # a deadline, never reached in a pass
        drain = w.engine.drain

        def drained() -> None:
            self.drained = True
            self.release.set()
            drain()
        w.engine.drain = drained  # type: ignore[method-assign]

    def watch(self) -> None:
        """Make the host saves issued so far release the copy thread when waited for."""
        for h in self.worker.saves.in_flight():
            t, job = h.transfer, h.job
            if "wait" in vars(t):
                continue
            orig = t.wait

            def wait(orig=orig, job=job) -> None:
                self.waited.append(job)
                self.release.set()
                orig()
            t.wait = wait  # type: ignore[method-assign]


def _forward(w: WorkerHalf, step: int, saves: list[SaveJob], wt: list[ChunkWriteJob] = (), **plan) -> None:
    w.begin_step(StepPlan(num_slots=SLOTS, step=step, saves_after=saves, write_through=list(wt), **plan))
    w.end_step()
    w.transfer_results(set())


def test_a_forwards_saves_are_done_when_its_step_ends_and_their_write_follows_the_settle():
    w, kv, tier = _worker()
    w.begin_step(StepPlan(num_slots=SLOTS, step=0))
    held = _HeldCopyThread(w)
    save = SaveJob("r1", block_ids=(3, 4, 5), slots=(0, 1, 2), keys=(_key(3), _key(4), _key(5)))
    wt = ChunkWriteJob("nvme", "f1", slots=(0, 1, 2), keys=save.keys)
    w.begin_step(StepPlan(num_slots=SLOTS, step=1, saves_after=[save], write_through=[wt]))
    w.end_step()
    # The step's end waited for the copy thread; its lower-tier write waits for the settle.
    assert held.drained and tier.written == []
    want = {n: t[list(save.block_ids)].clone() for n, t in kv.items()}
    with torch.inference_mode():
        for t in kv.values():
            t[[3, 4, 5]] = 0  # the next step zeroes or rewrites them: too late to matter
    w.transfer_results(set())
    assert not w.saves.in_flight()
    assert [(j.chunk_id, ok) for j, ok in tier.written] == [("f1", True)]
    assert tier.copy_now == {"f1": False}  # a write-through: copied on the store's thread
    assert w.slots is not None
    assert all(w.slots.holds(s, k) for s, k in zip(save.slots, save.keys, strict=True))
    # Bytes: loading the slots back into other blocks gives the saved blocks.
    assert w.engine is not None
    w.engine.submit("load", [10, 11, 12], list(save.slots), background=False)
    for n, t in kv.items():
        assert torch.equal(t[[10, 11, 12]], want[n])
    w.shutdown()


@pytest.mark.parametrize("uses", ["load", "demote"])
def test_a_step_that_uses_pool_slots_first_waits_for_the_last_forwards_saves_and_their_failures(uses):
    """The last forward's save into slot 3 fails on the copy thread: a next step that
    loads or demotes slot 3 waits for it, so slot 3 is empty (the load is recomputed, the
    demotion not written), never copied with bytes the save did not write."""
    w, _, tier = _worker()
    w.begin_step(StepPlan(num_slots=SLOTS, step=0))
    held = _HeldCopyThread(w)
    bad = SaveJob("r1", block_ids=(NUM_BLOCKS + 1,), slots=(3,), keys=(_key(9),))  # block out of range
    w.begin_step(StepPlan(num_slots=SLOTS, step=1, saves_after=[bad]))
    w.end_step()
    held.watch()
    assert w.slots is not None and w.slots.holds(3, _key(9)), "not settled yet"
    if uses == "load":
        w.begin_step(StepPlan(num_slots=SLOTS, step=2, loads=[LoadJob("r2", (7,), (3,), (_key(9),), False)]))
        w.start_loads()
        assert w.take_load_errors() == {7}
    else:
        w.begin_step(StepPlan(num_slots=SLOTS, step=2, demotes=[ChunkWriteJob("nvme", "f9", (3,), (_key(9),))]))
        assert [(j.chunk_id, ok) for j, ok in tier.written] == [("f9", False)]
        assert tier.copy_now == {"f9": True}  # a demotion: copied before this step's saves reuse the slot
    assert held.waited == [bad] and w.slots.key(3) is None
    assert w.counters.totals[sample_key("store_failures", "cpu")] == 1
    w.shutdown()


def test_a_failed_save_leaves_its_slots_empty_and_is_not_written_below():
    w, _, tier = _worker()
    bad = SaveJob("r1", block_ids=(NUM_BLOCKS + 1,), slots=(3,), keys=(_key(9),))  # block out of range
    wt = ChunkWriteJob("nvme", "f9", slots=(3,), keys=bad.keys)
    w.begin_step(StepPlan(num_slots=SLOTS, step=1, saves_after=[bad], write_through=[wt]))
    w.end_step()  # does not raise into vLLM
    w.transfer_results(set())
    # The step's end waited for the copy thread; a later step settles the failure.
    w.begin_step(StepPlan(num_slots=SLOTS, step=2))
    w.end_step()
    w.begin_step(StepPlan(num_slots=SLOTS, step=3))
    assert w.slots is not None and w.slots.key(3) is None
    assert [(j.chunk_id, ok) for j, ok in tier.written] == [("f9", False)]
    assert w.counters.totals[sample_key("store_failures", "cpu")] == 1
    w.shutdown()


class _FailingTier(_RecordingTier):
    """A tier whose writes and close raise."""

    def __init__(self, worker: WorkerHalf) -> None:
        super().__init__(worker)
        self.closed = False

    def write(self, jobs: list[ChunkWriteJob], *, copy_now: bool = False) -> None:
        if jobs:
            raise OSError("injected: write refused")

    def close(self) -> None:
        self.closed = True
        raise OSError("injected: close failed")


def test_at_shutdown_a_failing_tier_stops_neither_the_others_writes_nor_their_close():
    """Held-back writes of two tiers settle at shutdown; the first tier's write and close
    raise: the second's write is still queued and it is still closed, and the first failure
    comes out with the later one in its notes."""
    w, _, good = _worker(lambda w: {"s3": _FailingTier(w)})
    closes: list[str] = []
    good.close = lambda: closes.append("good")  # type: ignore[method-assign]
    save = SaveJob("r1", block_ids=(3, 4), slots=(0, 1), keys=(_key(3), _key(4)))
    w.begin_step(StepPlan(num_slots=SLOTS, step=1, saves_after=[save], write_through=[
        ChunkWriteJob("s3", "f-s3", slots=save.slots, keys=save.keys),
        ChunkWriteJob("nvme", "f-nvme", slots=save.slots, keys=save.keys)]))
    assert list(w.lower) == ["s3", "nvme"]
    bad = w.lower["s3"]
    assert isinstance(bad, _FailingTier)
    w.end_step()
    assert w.saves.held_writes(), "held back behind the save on the copy thread"
    with pytest.raises(OSError, match="write refused") as info:
        w.shutdown()
    assert [(j.chunk_id, ok) for j, ok in good.written] == [("f-nvme", True)]
    assert bad.closed and closes == ["good"]
    assert any("close failed" in n for n in info.value.__notes__)
    assert w.lower == {}


def test_the_time_of_a_step_with_a_forward_is_counted_and_an_idle_one_is_not():
    w, _, _ = _worker()
    save = SaveJob("r1", block_ids=(3,), slots=(0,), keys=(_key(3),))
    w.begin_step(StepPlan(num_slots=SLOTS, step=1, saves_after=[save]))
    w.end_step()
    w.transfer_results(set())  # a step that ran a forward
    assert w.counters.totals[sample_key("step_calls", "cpu")] == 1
    assert w.counters.totals[sample_key("step_seconds", "cpu")] > 0
    w.begin_step(StepPlan(num_slots=SLOTS, step=2))
    w.transfer_results(set(), idle_step=True)  # no forward: delays no token
    assert w.counters.totals[sample_key("step_calls", "cpu")] == 1
    w.shutdown()


def test_a_final_save_is_reported_sent_once_done_and_only_then():
    """A finished request with a final save is held by vLLM: the next step's begin issues
    the save, and the request is reported (``finished_sending``) once its copy is done."""
    w, kv, _ = _worker()
    w.begin_step(StepPlan(num_slots=SLOTS, step=0))
    _forward(w, 1, [SaveJob("r1", block_ids=(3, 4), slots=(0, 1), keys=(_key(3), _key(4)))])
    assert w.take_sent() == set()  # saves after a forward hold no block
    want = {n: t[[5]].clone() for n, t in kv.items()}
    final = SaveJob("r1", block_ids=(5,), slots=(2,), keys=(_key(5),))
    w.begin_step(StepPlan(num_slots=SLOTS, step=2, saves=[final]))
    assert w.take_sent() == {"r1"} and w.take_sent() == set()
    with torch.inference_mode():
        for t in kv.values():
            t[[5]] = 0  # vLLM frees the block and the next step rewrites it
    assert w.engine is not None
    w.engine.submit("load", [10], [2], background=False)
    for name, t in kv.items():
        assert torch.equal(t[[10]], want[name])
    w.shutdown()


def test_a_layer_waited_for_inside_a_step_call_is_counted_once():
    """Layers the forward never asked for are waited for in ``end_step``, whose own timer
    counts the wait. The wait is not added a second time. (The stub reports 5 s of waiting
    and waits none: counted twice, the step would show at least 5 s.)"""
    w, _, _ = _worker()
    w.begin_step(StepPlan(num_slots=SLOTS, step=1))
    waited: list[str] = []
    w.loads.unwaited_layers = lambda: ["layer.0"]  # type: ignore[method-assign]

    def wait(path: object, name: str) -> float:
        waited.append(name)
        return 5.0

    w.loads.wait_for_layer = wait  # type: ignore[method-assign,assignment]
    w.end_step()
    w.transfer_results(set())
    assert waited == ["layer.0"]
    assert w.counters.totals[sample_key("layer_loads_unwaited", "cpu")] == 1
    assert 0 < w.counters.totals[sample_key("step_seconds", "cpu")] < 5.0
    w.shutdown()
