"""One instance's tiers, and one request replayed through them: the code that the
single-instance replay (:func:`~vllm_kvtier.ops.trace_sim.simulate_tiers`) and the fleet
replay (:func:`~vllm_kvtier.ops.fleet_sim.simulate_fleet`) both run.

What a request does, step by step, is in :mod:`vllm_kvtier.ops.trace_sim`'s module doc. In
a fleet the shared tier comes last in the lookup: the instance's own planner for it (its
own chunks), then the bucket (what other instances wrote and it has listed). Called from
the replay loop only. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from vllm_kvtier.catalog.base import Listing
from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import BlockKey, TierName
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext

if TYPE_CHECKING:
    from vllm_kvtier.ops.fleet_sim import SharedTier
    from vllm_kvtier.ops.trace_sim import LowerTier, TierResult, TierSetup, TraceRequest

def block_tokens_in(block_tokens: int, input_length: int, j: int) -> int:
    """Prompt tokens of block ``j`` of a prompt of ``input_length`` tokens (the last may
    be partial)."""
    return max(0, min(block_tokens, input_length - j * block_tokens))


#: A trace block's bytes when the model is not known: large against a chunk's 4 KiB header,
#: so that a tier's capacity in blocks is what it holds.
_UNKNOWN_BLOCK_BYTES = 1 << 20

#: What a replay does with a worker's report of a step's writes (default: confirm at once).
Confirm = Callable[[ChunkPlanner, WorkerReport], None]


def make_lower_planner(t: LowerTier, clock: list[float]) -> ChunkPlanner:
    """The serving planner of tier ``t``; ``clock``: a one-item list of seconds that the
    write-back flush reads."""
    block_bytes = t.block_bytes or _UNKNOWN_BLOCK_BYTES
    policy = ChunkPolicy(tier=TierName(t.name), mode=t.mode, admit_min_seen=t.admit_min_seen, chunk_blocks=t.chunk_blocks,
                         capacity_bytes=None, flush_interval_s=t.flush_interval_s, exclusive=True,
                         eviction=t.eviction)
    planner = ChunkPlanner(policy, PlannerContext(1, block_bytes, Counters(), clock=lambda: clock[0]), Listing([]))
    if t.capacity_blocks is not None:
        # Capacity in whole chunks of this tier's own file size, so that it holds
        # capacity_blocks blocks (headers included) whatever the block's bytes.
        full = planner.file_bytes(t.chunk_blocks)
        planner.index.resize(-(-t.capacity_blocks // t.chunk_blocks) * full)
    return planner


def step_writes(p: ChunkPlanner, res: TierResult, tier: LowerTier, saved: set[BlockKey],
                slot_of: Callable[[BlockKey], int | None]) -> list[WorkerReport]:
    """A step's writes to ``tier`` (counted in ``res``), as the worker's reports that confirm them."""
    reports = []
    for _ in range(1 << 16):
        demotes, through, _deletes = p.take_jobs(saved, slot_of)
        jobs = demotes + through
        if not jobs:
            break
        written = {}
        for job in jobs:
            res.write_ops += tier.objects_per_chunk
            res.written_blocks += len(job.keys)
            if tier.block_bytes:  # the chunk's file (header and aligned blocks)
                res.written_bytes += p.file_bytes(len(job.keys))
            written[(p.tier, job.chunk_id)] = 1
        reports.append(WorkerReport(written=written))
        saved = set()
    return reports


class Instance:
    """One replica: its CPU tier, its local tiers and, in a fleet, its planner for the
    shared tier (last of :attr:`planners`, at :attr:`shared_at`)."""

    def __init__(self, setup: TierSetup, shared: LowerTier | None = None, clock: list[float] | None = None) -> None:
        self.setup = setup
        self.clock = clock if clock is not None else [0.0]
        self.tiers: list[LowerTier] = [*setup.lower, *([shared] if shared is not None else [])]
        # a write-back tier below makes the CPU pool a staging one
        self.index: SlotIndex = SlotIndex(setup.cpu_blocks, eviction=setup.cpu_eviction,
                                          staging=any(t.mode == "write-back" for t in self.tiers))
        self.planners = [make_lower_planner(t, self.clock) for t in setup.lower]
        self.shared_at: int | None = None
        if shared is not None:
            # unbounded here: the bucket's own LRU bounds what every writer holds
            self.planners.append(make_lower_planner(replace(shared, capacity_blocks=None), self.clock))
            self.shared_at = len(setup.lower)
        for p in self.planners:  # as the scheduler wires them (plan/scheduler.py)
            p.on_durable = self.index.note_below

    def holds_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Leading blocks of ``keys`` in this instance's own tiers (what its KV events told
        a router); the shared tier is left out: every instance reads it alike."""
        local = self.planners[: len(self.setup.lower)]
        n = 0
        for k in keys:
            if k not in self.index and not any(p.locate(k) is not None for p in local):
                break
            n += 1
        return n


def _in_bucket(bucket: SharedTier | None, key: BlockKey, me: int, now: float) -> bool:
    return bucket is not None and bucket.locate(key, me, now) is not None


def serve_request(inst: Instance, rq: TraceRequest, block_tokens: int, stats: Sequence[TierResult], *,
                  bucket: SharedTier | None = None, me: int = 0, now: float = 0.0,
                  confirm: Confirm | None = None) -> tuple[int, int]:
    """Replay request ``rq`` (of ``block_tokens`` a block) on ``inst`` (instance ``me`` of a fleet sharing ``bucket``, at
    ``now`` seconds); ``stats``: the CPU tier's figures, then each planner's, added to.
    ``confirm``: what to do with each step's write reports (None: confirm them at once).
    Returns (hit tokens, of which shared-tier hits on another instance's chunks)."""
    keys = rq.keys
    index, planners, setup = inst.index, inst.planners, inst.setup
    sj = inst.shared_at if bucket is not None else None
    # 1. lookup: 0: CPU, j + 1: planners[j]; a bucket hit counts as the shared planner's
    where: list[int] = []
    locs: list[tuple[str, int] | None] = []
    from_bucket: list[bool] = []
    for k in keys:
        if k in index:
            where.append(0)
            locs.append(None)
            from_bucket.append(False)
            continue
        for j, p in enumerate(planners):
            loc = p.locate(k)
            if loc is not None:
                where.append(j + 1)
                locs.append(loc)
                from_bucket.append(False)
                break
        else:
            loc = bucket.locate(k, me, now) if bucket is not None and sj is not None else None
            if loc is None:
                break
            assert sj is not None
            where.append(sj + 1)
            locs.append(loc)
            from_bucket.append(True)
    for p in planners:
        p.note_request(keys)
    # 3. load: pin DRAM hits first, then promote the lower-tier ones
    pinned: list[int] = []
    for pos, w in enumerate(where):
        if w == 0:
            k = keys[pos]
            index.touch(k)
            s = index.slot(k)
            assert s is not None
            index.pin(s)
            pinned.append(s)
    reads: dict[tuple[int, str, bool], list[int]] = {}
    hits = cross = 0
    for pos, w in enumerate(where):
        tokens = block_tokens_in(block_tokens, rq.input_length, pos)
        if w == 0:
            stats[0].hit_tokens += tokens
            stats[0].hit_blocks += 1
            hits += tokens
            continue
        k = keys[pos]
        loc = locs[pos]
        assert loc is not None
        alloc = index.allocate(k, keys[pos - 1] if pos else None)
        if alloc is None:
            break  # no slot to read into: the rest is recomputed
        if alloc.evicted is not None:
            for p in planners:
                p.on_cpu_evict(alloc.slot, alloc.evicted)
        index.pin(alloc.slot)
        pinned.append(alloc.slot)
        reads.setdefault((w - 1, loc[0], from_bucket[pos]), []).append(loc[1])
        stats[w].hit_tokens += tokens
        stats[w].hit_blocks += 1
        hits += tokens
        if from_bucket[pos] and bucket is not None and bucket.writer_of(loc[0]) != me:
            cross += tokens
    for (j, fid, in_bucket), positions in reads.items():
        if not in_bucket:
            planners[j].index.touch(fid)
        if j == sj and bucket is not None:
            bucket.touch(fid)
        positions.sort()
        runs = 1 + sum(1 for a, b in zip(positions, positions[1:], strict=False) if b != a + 1)
        stats[j + 1].read_ops += runs * inst.tiers[j].objects_per_chunk
    # the load is done before the request computes: its slots are free to go again
    for s in pinned:
        index.unpin(s)
    # 4. save every block not stored yet, a step at a time, 5. each step's writes below
    step = setup.step_blocks or max(1, len(keys))
    n_save = len(keys)
    if not setup.save_partial_blocks and n_save and block_tokens_in(block_tokens, rq.input_length, n_save - 1) < block_tokens:
        n_save -= 1
    for lo in range(0, max(1, len(keys)), step):
        saved: set[BlockKey] = set()
        held: list[int] = []
        for pos in range(lo, min(lo + step, n_save)):
            k = keys[pos]
            if k in index:
                index.touch(k)
                continue
            alloc = index.allocate(k, keys[pos - 1] if pos else None)
            if alloc is None:
                continue
            for j, p in enumerate(planners):
                # the engine's index of the bucket knows a listed block: not written again
                listed = j == sj
                if alloc.evicted is not None and not (listed and _in_bucket(bucket, alloc.evicted, me, now)):
                    p.on_cpu_evict(alloc.slot, alloc.evicted)
                if not (listed and _in_bucket(bucket, k, me, now)):
                    p.on_cpu_save(alloc.slot, k)
            # held until the step's save is planned (SavePlanner): a later block of the
            # same step must not evict it
            index.pin(alloc.slot)
            held.append(alloc.slot)
            saved.add(k)
        for s in held:
            index.unpin(s)
        for j, p in enumerate(planners):
            for report in step_writes(p, stats[j + 1], inst.tiers[j], saved, index.slot):
                if confirm is not None:
                    confirm(p, report)
                    continue
                p.on_worker_meta(report)
                if j == sj and bucket is not None:
                    bucket.publish(p, report, me, now)
    return hits, cross
