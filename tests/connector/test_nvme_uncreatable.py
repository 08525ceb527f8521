"""An ``nvme.path`` that cannot be created: the worker runs without the tier, and vLLM's real
scheduler with the connector plans no NVMe write either (``sched_helpers``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sched_helpers import (
    BLOCK_SIZE,
    FakeWorker,
    block_bytes,
    make_request,
    make_scheduler,
    make_vllm_config,
    prompt_tokens,
    sched_half,
)
from vllm_kvtier.tiers.nvme.dirs import open_rank_dir


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model


def nvme_writes(model_dir: Path, nvme_path: Path) -> int:
    """Run two requests through a scheduler whose NVMe tier takes every block at once
    (write-through, admitted on first sight); the NVMe writes it planned."""
    extra = {"cpu": {"capacity_bytes": 64 * block_bytes()},
             "nvme": {"path": str(nvme_path), "capacity_bytes": 1 << 30, "mode": "write-through",
                      "admit_min_seen": 1}}
    sched = make_scheduler(make_vllm_config(model_dir, extra))
    worker = FakeWorker()
    for i in range(2):
        sched.add_request(make_request(f"r{i}", prompt_tokens(4 * BLOCK_SIZE + 8, seed=i), max_tokens=1))
        worker.run_until_idle(sched)
    assert sched_half(sched).planner.lower_tier("nvme") is not None
    return sum(1 for m in worker.metas for job in m.write_through + m.demotes if job.tier == "nvme")


@pytest.mark.parametrize("blocker", ["a regular file", "a dangling symlink"])
def test_no_nvme_write_is_planned_when_the_path_cannot_be_created(model_dir, tmp_path: Path, blocker: str) -> None:
    assert nvme_writes(model_dir, tmp_path / "ok") > 0  # the same traffic writes to a usable path
    parent = tmp_path / "parent"
    if blocker == "a regular file":
        parent.write_text("not a directory")
    else:
        parent.symlink_to(tmp_path / "gone")  # e.g. a mount point that is not there
    with pytest.raises(OSError):  # what the worker does at start: its tier is off
        open_rank_dir(parent / "nvme", "ns", 0)
    assert nvme_writes(model_dir, parent / "nvme") == 0
