"""The worker's trackers route a finished lower-tier read by (tier, read id): two tiers may
hand out the same read id, a read is routed once, and a read that is not theirs is left to
the next owner (the worker asks the verifier, then the prefetches, then the loads)."""

from __future__ import annotations

import pytest
import torch

from vllm_kvtier.config import parse_config
from vllm_kvtier.jobs import ChunkRead, LoadJob, PrefetchJob, WorkerReport
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import Counters
from vllm_kvtier.transfer.datapath import DataPath, build_datapath, open_lower
from vllm_kvtier.transfer.layout import build_layout
from vllm_kvtier.transfer.loads import Loads
from vllm_kvtier.transfer.prefetches import Prefetches

NUM_BLOCKS = 8
SLOTS = 4
CFG = parse_config({"cpu": {"capacity_bytes": 1 << 24}})


class _Tier:
    """A lower tier that starts every read, numbering them from 0 (as each real tier does)."""

    def __init__(self) -> None:
        self.started: list[ChunkRead] = []

    def start_read(self, read: ChunkRead, *, prefetch: bool = False) -> int:
        self.started.append(read)
        return len(self.started) - 1

    def close(self) -> None: ...


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def _path() -> DataPath:
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn((NUM_BLOCKS, 2, 4, 16)) for i in range(2)}
    tiers = {TierName.NVME: _Tier(), TierName.S3: _Tier()}
    path = build_datapath(CFG, build_layout(kv, NUM_BLOCKS), SLOTS, namespace="ns", rank=0, counters=Counters())
    open_lower(path, CFG, lambda *a, **k: tiers, namespace="ns", rank=0, counters=Counters())
    return path


def _read(tier: TierName, slot: int) -> ChunkRead:
    return ChunkRead(tier, f"{tier}-f", positions=(0,), slots=(slot,), keys=(_key(slot),))


def test_a_load_waits_for_each_of_its_reads_by_tier_and_fails_only_the_blocks_of_a_failed_one():
    path = _path()
    loads = Loads(CFG, Counters())
    nvme, s3 = _read(TierName.NVME, 0), _read(TierName.S3, 1)
    loads.start(path, LoadJob("r", (3, 4), (0, 1), (_key(0), _key(1)), True, reads=(nvme, s3)))
    # both tiers gave read id 0: the tier tells them apart
    assert loads.on_read((TierName.NVME, 0), nvme, True)
    path.slots.set_key(0, _key(0))  # what the worker records for a read that succeeded
    assert not loads.on_read((TierName.NVME, 0), nvme, True), "routed once"
    assert not loads.on_read((TierName.NVME, 1), nvme, True), "no load's read"
    assert loads.poll(path) == set(), "the S3 read is still filling its slot"
    assert loads.on_read((TierName.S3, 0), s3, False)
    assert loads.poll(path) == {"r"}
    assert loads.take_errors() == {4}
    path.engine.shutdown()


def test_a_prefetch_ends_once_all_its_reads_ended_and_fails_if_any_did():
    path = _path()
    prefetches = Prefetches()
    report = WorkerReport()
    prefetches.start(PrefetchJob(1, (_read(TierName.NVME, 0), _read(TierName.S3, 1))), path.lower, report)
    prefetches.start(PrefetchJob(2, (_read(TierName.NVME, 2),)), path.lower, report)
    assert not prefetches.on_read((TierName.S3, 1), True, report), "no prefetch's read: left to the loads"
    assert prefetches.on_read((TierName.NVME, 0), True, report)
    assert prefetches.on_read((TierName.NVME, 1), True, report)
    assert report.prefetched == {2: 1} and not report.prefetch_failed
    assert prefetches.on_read((TierName.S3, 0), False, report)
    assert report.prefetched == {2: 1} and report.prefetch_failed == {1}
    # a prefetch whose reads cannot start (no such tier here) fails at once
    prefetches.start(PrefetchJob(3, (ChunkRead(TierName.NVME, "f", (0,), (3,), (_key(3),)),)), {}, report)
    assert report.prefetch_failed == {1, 3}
    path.engine.shutdown()


def test_a_plan_for_more_slots_than_the_pool_raises_naming_both_sizes():
    """The scheduler plans for the smallest rank's pool (start-up handshake), so a smaller
    plan is normal; a larger one means no handshake reached it, and must not index past
    the pool."""
    path = _path()
    path.check_size(SLOTS)
    path.check_size(SLOTS - 1)
    with pytest.raises(RuntimeError, match=rf"{SLOTS + 1} CPU slots .* has {SLOTS} .*cpu.capacity_bytes"):
        path.check_size(SLOTS + 1)
    path.engine.shutdown()
