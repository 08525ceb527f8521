"""Issue 31: the scheduler and each worker compute the namespace apart (different
processes: the scheduler cannot see a worker's tensors or environment). The scheduler sends
its namespace in every step plan; a worker that computed another refuses every read and
write of the tiers below CPU, loudly (an ERROR, the ``namespace_mismatch`` counter), and
reports the writes failed, so that nothing is ever stored or read under a namespace only one
of the two believes in. A real worker half, a real NVMe tier under ``tmp_path``."""

from __future__ import annotations

import functools
import logging

import torch

from vllm_kvtier.config import parse_config
from vllm_kvtier.engine.lower import make_workers
from vllm_kvtier.jobs import ChunkRead, ChunkWriteJob, LoadJob, SaveJob, StepPlan
from vllm_kvtier.metrics import sample_key
from vllm_kvtier.transfer.worker import WorkerHalf, WorkerSetup

NUM_BLOCKS = 16
SLOTS = 8
OURS = "0123456789abcdef"


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def worker(tmp_path) -> WorkerHalf:
    cfg = parse_config({"cpu": {"capacity_bytes": 1 << 26},
                        "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 1 << 26, "admit_min_seen": 1}})
    w = WorkerHalf(cfg, WorkerSetup(num_blocks=NUM_BLOCKS, pool_slots=lambda: SLOTS, namespace=OURS,
                                    make_tiers=functools.partial(make_workers)))
    with torch.inference_mode():
        w.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.randn((NUM_BLOCKS, 2, 32, 64))
                              for i in range(2)})
    return w


def step(w: WorkerHalf, n: int, theirs: str) -> None:
    """Step ``n`` saves blocks 3, 4 into two slots of its own (a write-through is copied on
    the store's thread, so a later step reusing them could supersede it) and writes them
    through to NVMe as chunk ``f<n>``, and loads chunk ``f0`` (never written) into block 7
    through the last slot."""
    save = SaveJob("r1", block_ids=(3, 4), slots=(2 * n - 2, 2 * n - 1), keys=(_key(3), _key(4)))
    read = ChunkRead("nvme", "f0", slots=(SLOTS - 1,), positions=(0,), keys=(_key(9),))
    load = LoadJob("r2", (7,), (SLOTS - 1,), (_key(9),), True, reads=(read,))
    w.begin_step(StepPlan(num_slots=SLOTS, step=n, saves=[save], loads=[load], namespace=theirs,
                          write_through=[ChunkWriteJob("nvme", f"f{n}", save.slots, save.keys)]))
    w.start_loads()
    w.end_step()


def chunk_files(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "nvme").rglob("*") if p.is_file() and "f" in p.name)


def test_a_worker_refuses_lower_tier_io_under_a_namespace_the_scheduler_did_not_compute(tmp_path, caplog):
    w = worker(tmp_path)
    with caplog.at_level(logging.ERROR, logger="vllm_kvtier"):
        step(w, 1, theirs="fedcba9876543210")
        step(w, 2, theirs="fedcba9876543210")
    assert w.namespace_conflict == "fedcba9876543210" and w.lower == {}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and OURS in errors[0] and "fedcba9876543210" in errors[0]  # once, both named
    report = w.worker_meta()
    assert report is not None and report.failed == {("nvme", "f1"), ("nvme", "f2")}  # the scheduler drops them
    # two writes and two reads refused
    assert w.counters.totals[sample_key("namespace_mismatch", "nvme")] == 4
    w.shutdown()
    assert not (tmp_path / "nvme").exists() or chunk_files(tmp_path) == []


def test_the_same_namespace_or_none_sent_writes_as_before(tmp_path):
    """The control: the same steps with the scheduler's namespace equal to ours (and with
    none sent, as by a plan built without one) write their chunks."""
    for theirs in (OURS, ""):
        root = tmp_path / (theirs or "none")
        w = worker(root)
        step(w, 1, theirs=theirs)
        step(w, 2, theirs=theirs)
        assert not w.namespace_conflict and set(w.lower) == {"nvme"}
        w.shutdown()
        assert sample_key("namespace_mismatch", "nvme") not in w.counters.totals
        assert len(chunk_files(root)) >= 2, chunk_files(root)
