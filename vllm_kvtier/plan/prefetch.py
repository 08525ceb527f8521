"""Prefetch: promote a prefix that is predictably coming back into the CPU tier.

The prefix comes from NVMe / S3 / the pool, before its request arrives. So that request
loads it synchronously from DRAM instead of waiting for a lower tier.

Who calls it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`, from vLLM's
scheduler thread. Nothing blocks: this plans promotions; the workers' I/O threads read.

What is predicted: a conversation's next turn. When a request finishes, some blocks of its
prompt and answer are no longer in DRAM. They were evicted while it ran (e.g. by
concurrent traffic) and demoted below. Those blocks are queued. The next turn's prompt
starts with exactly those blocks. A request that asked to pin its prompt
(``kvtier_pin_ttl_s``) is treated the same.

Budget and cancellation: at most ``max_inflight_blocks`` promotions are in flight. A
prefetch never evicts a block of the chain it is restoring (those are pinned while slots
are chosen). It never takes a slot when every slot is pinned. Then it is cancelled,
counted, and the rest of its queue dropped: memory is needed for live requests. Queued
prefetches older than ``max_age_s`` are dropped. A block being prefetched is not readable
from DRAM until every TP rank reported it. A request that needs it meanwhile is asked
again next step. Its KV is about to be in DRAM; a read fails or completes within its
deadline.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from vllm_kvtier.jobs import ChunkRead, PrefetchJob, WorkerReport
from vllm_kvtier.keys import BlockKey, TierName
from vllm_kvtier.metrics import CounterName
from vllm_kvtier.plan.chunk_plan import ChunkPlanner
from vllm_kvtier.plan.parts import PlanParts

TIER = TierName.CPU
#: Prefetched keys remembered until a hit counts them (~100 B each: ~6 MB at most).
MAX_PREFETCHED_KEYS = 1 << 16


@dataclass
class _Queued:
    chain: tuple[BlockKey, ...]
    queued_s: float


@dataclass
class _InFlight:
    keys: list[BlockKey]
    slots: list[int]
    files: list[tuple[ChunkPlanner, str]]
    acks: int = 0
    tiers: dict[str, int] = field(default_factory=dict)


class Prefetcher:
    def __init__(self, parts: PlanParts, *, world_size: int, max_inflight_blocks: int, max_age_s: float,
                 max_prefetched_keys: int = MAX_PREFETCHED_KEYS) -> None:
        """``parts``: the scheduler's; its promotions are shared with the loads (slots being
        filled). ``max_prefetched_keys``: the bound of :attr:`prefetched`."""
        self.max_prefetched_keys = max_prefetched_keys
        self.parts = parts
        self.world_size = world_size
        self.max_inflight_blocks = max_inflight_blocks
        self.max_age_s = max_age_s
        self._queue: deque[_Queued] = deque()
        self._inflight: dict[int, _InFlight] = {}
        self._ids = itertools.count(1)
        #: Keys brought up by a prefetch and not used yet (to count useful prefetches),
        #: oldest first, at most :data:`MAX_PREFETCHED_KEYS` (the oldest unused is forgotten:
        #: its slot was long since reused, a later hit on it is not the prefetch's).
        self.prefetched: OrderedDict[BlockKey, None] = OrderedDict()

    def is_inflight(self, key: BlockKey) -> bool:
        """``key`` is being prefetched into DRAM right now (readable within a read's time)."""
        return any(key in f.keys for f in self._inflight.values())

    def has_work(self) -> bool:
        return bool(self._queue or self._inflight)

    def inflight_blocks(self) -> int:
        return sum(len(f.keys) for f in self._inflight.values())

    def predict(self, chain: list[BlockKey]) -> None:
        """A request over ``chain`` (its full blocks, in order) ended: its next turn will
        start with them. Queue the ones that left DRAM."""
        if any(k not in self.parts.index and k not in self.parts.promotions for k in chain):
            self._queue.append(_Queued(tuple(chain), time.monotonic()))

    def note_hit(self, key: BlockKey) -> None:
        if key in self.prefetched:
            del self.prefetched[key]
            self.parts.counters.add(CounterName.PREFETCH_USED_BLOCKS, TIER)

    def take_jobs(self) -> list[PrefetchJob]:
        """Promotions to issue in this step, within the budget."""
        jobs: list[PrefetchJob] = []
        now = time.monotonic()
        while self._queue and self.inflight_blocks() < self.max_inflight_blocks:
            q = self._queue.popleft()
            if now - q.queued_s > self.max_age_s:
                self.parts.counters.add(CounterName.PREFETCH_DROPPED, TIER, 1)
                continue
            job = self._plan(q.chain)
            if job is None:  # no slot without evicting live data: memory is needed
                self.parts.counters.add(CounterName.PREFETCH_CANCELLED, TIER, len(self._queue) + 1)
                self._queue.clear()
                break
            if job.reads:
                jobs.append(job)
        return jobs

    def _plan(self, chain: tuple[BlockKey, ...]) -> PrefetchJob | None:
        # Pin the chain's blocks still in DRAM: restoring its head must not evict its tail.
        held = [s for k in chain if (s := self.parts.index.slot(k)) is not None]
        for s in held:
            self.parts.index.pin(s)
        try:
            budget = self.max_inflight_blocks - self.inflight_blocks()
            keys: list[BlockKey] = []
            slots: list[int] = []
            reads: dict[tuple[ChunkPlanner, str], list[tuple[int, int, BlockKey]]] = {}
            for k in chain:
                if k in self.parts.index or k in self.parts.promotions:
                    continue
                loc = self.parts.locate(k)
                if loc is None:
                    break  # the rest of the chain is useless without this block
                if len(keys) >= budget:
                    break
                slot = self.parts.promotions.begin(k)
                if slot is None:
                    self._undo(keys, slots)
                    return None
                keys.append(k)
                slots.append(slot)
                tier, fid, pos = loc
                reads.setdefault((tier, fid), []).append((pos, slot, k))
        finally:
            for s in held:
                self.parts.index.unpin(s)
        pid = next(self._ids)
        flight = _InFlight(keys, slots, [])
        for (tier, fid), items in reads.items():
            tier.index.pin(fid)
            flight.files.append((tier, fid))
            flight.tiers[tier.tier] = flight.tiers.get(tier.tier, 0) + len(items)
        if keys:
            self._inflight[pid] = flight
        return PrefetchJob(pid, tuple(
            ChunkRead(tier.tier, fid, tuple(p for p, _, _ in items), tuple(s for _, s, _ in items),
                      tuple(k for _, _, k in items))
            for (tier, fid), items in reads.items()
        ))

    def _undo(self, keys: list[BlockKey], slots: list[int]) -> None:
        for k, s in zip(keys, slots, strict=True):
            self.parts.promotions.undo(k, s)

    def on_worker_meta(self, meta: WorkerReport) -> None:
        for pid in meta.prefetch_failed:
            f = self._inflight.pop(pid, None)
            if f is not None:
                self._finish(f)
                for k in f.keys:
                    self.parts.index.remove(k)  # its slot holds nothing valid
                self.parts.counters.add(CounterName.PREFETCH_FAILURES, TIER, len(f.keys))
        for pid, n in meta.prefetched.items():
            f = self._inflight.get(pid)
            if f is None:
                continue
            f.acks += n
            if f.acks >= self.world_size:
                del self._inflight[pid]
                self._finish(f)
                self.prefetched.update(dict.fromkeys(f.keys))
                while len(self.prefetched) > self.max_prefetched_keys:
                    self.prefetched.popitem(last=False)
                for tier, count in f.tiers.items():
                    self.parts.counters.add(CounterName.PREFETCH_BLOCKS, tier, count)

    def _finish(self, f: _InFlight) -> None:
        for s in f.slots:
            self.parts.index.unpin(s)
        self.parts.promotions.end(f.keys)
        for tier, fid in f.files:
            tier.index.unpin(fid)
