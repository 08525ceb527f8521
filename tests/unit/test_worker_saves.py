"""The worker half's saves after a forward on a host KV cache: they run on the copy thread
while the step samples, are complete before the next forward, and a failed one leaves its
slots empty (a future miss), never served; lower-tier writes of those slots wait for them."""

from __future__ import annotations

import pytest
import torch

from vllm_kvtier.config import parse_config
from vllm_kvtier.jobs import ChunkWriteJob, SaveJob, StepPlan
from vllm_kvtier.metrics import sample_key
from vllm_kvtier.transfer.worker import WorkerHalf

NUM_BLOCKS = 16
SLOTS = 8


class _RecordingTier:
    """A lower-tier driver that records what it was asked to write and whether the slots
    held their keys (and their bytes were complete) at that moment."""

    def __init__(self, worker: WorkerHalf) -> None:
        self.worker = worker
        self.written: list[tuple[ChunkWriteJob, bool]] = []

    def write(self, jobs: list[ChunkWriteJob]) -> None:
        for j in jobs:
            slots = self.worker.slots
            assert slots is not None
            held = all(slots.holds(s, k) for s, k in zip(j.slots, j.keys, strict=True))
            self.written.append((j, held and not self.worker._host_saves))

    def clean(self, slots) -> None: ...
    def mark_dirty(self, slots) -> None: ...
    def delete(self, ids) -> None: ...
    def forget(self, ids) -> None: ...
    def poll(self) -> list: return []
    def pending_reads(self) -> bool: return False
    def take_meta(self, meta) -> None: ...
    def close(self) -> None: ...


def _worker() -> tuple[WorkerHalf, dict[str, torch.Tensor], _RecordingTier]:
    w = WorkerHalf(parse_config({"cpu": {"capacity_bytes": 1 << 26}}), num_blocks=NUM_BLOCKS)
    with torch.inference_mode():
        kv = {f"model.layers.{i}.self_attn.attn": torch.randn((NUM_BLOCKS, 2, 32, 128)).to(torch.bfloat16)
              for i in range(2)}
    w.register_kv_caches(kv)
    tier = _RecordingTier(w)
    w._make_tiers = lambda *a, **k: {"nvme": tier}
    return w, kv, tier


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_saves_after_the_forward_are_complete_before_the_next_forward_and_written_below_after():
    w, kv, tier = _worker()
    save = SaveJob("r1", block_ids=(3, 4, 5), slots=(0, 1, 2), keys=(_key(3), _key(4), _key(5)))
    wt = ChunkWriteJob("nvme", "f1", slots=(0, 1, 2), keys=save.keys)
    w.begin_step(StepPlan(num_slots=SLOTS, step=1))
    w._meta = StepPlan(num_slots=SLOTS, step=1, saves_after=[save], write_through=[wt])
    w.end_step()
    # Handed to the copy thread (the step goes on to sample); its lower-tier write waits.
    assert [j for _, j in w._host_saves] == [save] and tier.written == []
    # The next step's first hook: every save is done, then the lower-tier write is queued.
    w.begin_step(StepPlan(num_slots=SLOTS, step=2))
    assert not w._host_saves
    assert [(j.file_id, ok) for j, ok in tier.written] == [("f1", True)]
    assert w.slots is not None
    assert all(w.slots.holds(s, k) for s, k in zip(save.slots, save.keys, strict=True))
    # Bytes: loading the slots back into other blocks gives the saved blocks.
    want = {n: t[list(save.block_ids)].clone() for n, t in kv.items()}
    assert w.engine is not None
    w.engine.submit("load", [10, 11, 12], list(save.slots), background=False)
    for n, t in kv.items():
        assert torch.equal(t[[10, 11, 12]], want[n])
    w.shutdown()


def test_a_failed_save_leaves_its_slots_empty_and_is_not_written_below():
    w, _, tier = _worker()
    w.begin_step(StepPlan(num_slots=SLOTS, step=1))
    bad = SaveJob("r1", block_ids=(NUM_BLOCKS + 1,), slots=(3,), keys=(_key(9),))  # block out of range
    wt = ChunkWriteJob("nvme", "f9", slots=(3,), keys=bad.keys)
    w._meta = StepPlan(num_slots=SLOTS, step=1, saves_after=[bad], write_through=[wt])
    w.end_step()  # does not raise into vLLM
    w.transfer_results(set())
    w.begin_step(StepPlan(num_slots=SLOTS, step=2))
    assert w.slots is not None and w.slots.key(3) is None
    assert [(j.file_id, ok) for j, ok in tier.written] == [("f9", False)]
    assert w.counters.totals[sample_key("store_failures", "cpu")] == 1
    w.shutdown()


class _FailingTier(_RecordingTier):
    """A tier whose writes and close raise."""

    def __init__(self, worker: WorkerHalf) -> None:
        super().__init__(worker)
        self.closed = False

    def write(self, jobs: list[ChunkWriteJob]) -> None:
        if jobs:
            raise OSError("injected: write refused")

    def close(self) -> None:
        self.closed = True
        raise OSError("injected: close failed")


def test_at_shutdown_a_failing_tier_stops_neither_the_others_writes_nor_their_close():
    """Held-back writes of two tiers settle at shutdown; the first tier's write and close
    raise: the second's write is still queued and it is still closed, and the first failure
    comes out with the later one in its notes."""
    w, _, good = _worker()
    bad = _FailingTier(w)
    closes: list[str] = []
    good.close = lambda: closes.append("good")  # type: ignore[method-assign]
    w._make_tiers = lambda *a, **k: {"s3": bad, "nvme": good}
    save = SaveJob("r1", block_ids=(3, 4), slots=(0, 1), keys=(_key(3), _key(4)))
    w.begin_step(StepPlan(num_slots=SLOTS, step=1))
    assert set(w.lower) == {"s3", "nvme"}
    w._meta = StepPlan(num_slots=SLOTS, step=1, saves_after=[save], write_through=[
        ChunkWriteJob("s3", "f-s3", slots=save.slots, keys=save.keys),
        ChunkWriteJob("nvme", "f-nvme", slots=save.slots, keys=save.keys)])
    w.end_step()
    assert w._deferred_writes, "held back behind the save on the copy thread"
    with pytest.raises(OSError, match="write refused") as info:
        w.shutdown()
    assert [(j.file_id, ok) for j, ok in good.written] == [("f-nvme", True)]
    assert bad.closed and closes == ["good"]
    assert any("close failed" in n for n in info.value.__notes__)
    assert w.lower == {}


def test_the_time_of_a_step_with_a_forward_is_counted_and_an_idle_one_is_not():
    w, _, _ = _worker()
    save = SaveJob("r1", block_ids=(3,), slots=(0,), keys=(_key(3),))
    w.begin_step(StepPlan(num_slots=SLOTS, step=1))
    w._meta = StepPlan(num_slots=SLOTS, step=1, saves_after=[save])
    w.end_step()
    w.transfer_results(set())  # a step that ran a forward
    assert w.counters.totals[sample_key("step_calls", "cpu")] == 1
    assert w.counters.totals[sample_key("step_seconds", "cpu")] > 0
    w.begin_step(StepPlan(num_slots=SLOTS, step=2))
    w.transfer_results(set(), idle_step=True)  # no forward: delays no token
    assert w.counters.totals[sample_key("step_calls", "cpu")] == 1
    w.shutdown()
