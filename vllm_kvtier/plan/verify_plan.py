"""Shadow verification, scheduler side.

It decides which hits are sampled, and what their check pins and reads. It decides what
a mismatch does (counters, a warning, a quarantine of the tier).

Who calls it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`, from vLLM's scheduler
thread only, and only when ``verify.sample_rate`` > 0. Otherwise it is never built and no
code path of it runs. Pure bookkeeping: the worker reads and compares the bytes
(:mod:`vllm_kvtier.transfer.verify`).

The life of a sampled hit has four steps.

1. In :meth:`VerifyPlanner.sample` (``lookup``), a request whose prefix would be loaded is
   drawn (seeded; every hit at rate 1.0). vLLM is then told 0 external tokens. The
   request recomputes its prefix, so its output is the recomputed one, never the loaded
   one.
2. In :meth:`~VerifyPlanner.begin` (``on_alloc``), the blocks it would have loaded are
   held. A CPU hit's slot is pinned. A lower-tier block gets a promotion slot (pinned).
   The worker fills it by the normal read path (into the CPU slot, never into an engine
   block).
3. In :meth:`~VerifyPlanner.take_jobs` (``plan_step``), a
   :class:`~vllm_kvtier.jobs.VerifyJob` goes to the workers. That happens in the step
   whose forward completes the last of those blocks. After the forward each rank compares
   its stored shard with the computed one.
4. In :meth:`~VerifyPlanner.on_worker_meta`, once every rank reported, the samples and
   mismatches are counted per tier. A mismatching block is dropped from its tier, never
   served again. A wrong DRAM block is dropped from the lower tiers too, whose copies were
   written from that slot. It is deleted from an exclusive tier. It is only forgotten by
   this instance on a shared one (see
   :meth:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner.distrust_key`). With
   ``verify.quarantine_s`` > 0, a tier may also be quarantined. That happens once
   ``verify.quarantine_mismatches`` checks of it mismatched within
   ``verify.quarantine_window_s``. Its lookups then answer miss for that long. Saves to it
   continue, so it is warm again after. A tier still broken is caught again by the next
   sample. A block that matched stays in the CPU tier (it was promoted there and is now
   known good). Pins are released.

A sampled request finished or preempted before its job was issued releases what step 2
held (:meth:`~VerifyPlanner.forget`). P/D peer reads (NIXL) are not sampled.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from vllm_kvtier.config import VerifyConfig
from vllm_kvtier.jobs import ChunkRead, VerifyJob, WorkerReport
from vllm_kvtier.keys import BlockKey, TierName
from vllm_kvtier.metrics import CounterName, GaugeName
from vllm_kvtier.plan.chunk_plan import ChunkPlanner
from vllm_kvtier.plan.parts import Locate, PlanParts
from vllm_kvtier.plan.req_state import ReqState

logger = logging.getLogger(__name__)



class Sampler:
    """Which hits are verified: every one at rate 1.0, else a seeded draw per hit (the
    same request order gives the same samples)."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self._rng = random.Random(seed)

    def draw(self) -> bool:
        return self.rate >= 1.0 or self._rng.random() < self.rate


@dataclass
class _Held:
    """What one sampled hit holds until its check is reported."""

    req_id: str
    #: block positions in the request, with the slot, key and tier of each
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    tiers: list[TierName] = field(default_factory=list)
    #: (planner, chunk) -> [(position in chunk, slot, key)] read into promotion slots
    reads: dict[tuple[ChunkPlanner, str], list[tuple[int, int, BlockKey]]] = field(default_factory=dict)
    #: key -> its lower-tier source, for keys being promoted (not readable from CPU yet)
    promoted: dict[BlockKey, tuple[ChunkPlanner, str]] = field(default_factory=dict)
    #: ranks that reported, and what they found
    ranks: int = 0
    mismatched: set[bytes] = field(default_factory=set)
    unread: set[bytes] = field(default_factory=set)
    inexact: set[bytes] = field(default_factory=set)


class MismatchWindow:
    """When a tier's mismatches call for a quarantine: ``threshold`` mismatching checks of
    it within ``window_s`` (pure: the caller passes the time)."""

    def __init__(self, threshold: int, window_s: float) -> None:
        self.threshold = threshold
        self.window_s = window_s
        self._times: dict[str, deque[float]] = {}

    def add(self, tier: str, now: float) -> bool:
        """Record one mismatching check of ``tier`` at ``now``; True when it makes
        ``threshold`` within the window (the count then starts again)."""
        times = self._times.setdefault(tier, deque())
        times.append(now)
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if len(times) < self.threshold:
            return False
        times.clear()
        return True


class VerifyPlanner:
    def __init__(self, cfg: VerifyConfig, parts: PlanParts, *, world_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``parts.lower``: the tiers below CPU (a wrong DRAM block is dropped from them too)."""
        self.cfg = cfg
        self.parts = parts
        self.world_size = world_size
        self._clock = clock
        self._sampler = Sampler(cfg.sample_rate, cfg.seed)
        #: request id -> whether its hit was drawn (kept while vLLM may ask again)
        self._decided: dict[str, bool] = {}
        #: request id -> the keys and tiers of its sampled hit, until on_alloc
        self._candidates: dict[str, tuple[list[BlockKey], list[str]]] = {}
        #: request id -> what its check holds, until its job is issued
        self._pending: dict[str, _Held] = {}
        #: verify id -> a job sent to the workers, until every rank reported
        self._issued: dict[int, _Held] = {}
        self._next_id = 1
        #: tier -> monotonic time until which it serves no hits
        self._quarantine_until: dict[str, float] = {}
        self._mismatches = MismatchWindow(cfg.quarantine_mismatches, cfg.quarantine_window_s)

    # ---- lookups ---------------------------------------------------------------------

    def quarantined(self, tier: str) -> bool:
        """Whether ``tier`` serves no hits now (a mismatch quarantined it)."""
        until = self._quarantine_until.get(tier)
        return until is not None and self._clock() < until

    def quarantined_tiers(self) -> frozenset[str]:
        now = self._clock()
        return frozenset(t for t, until in self._quarantine_until.items() if now < until)

    def sample(self, req_id: str, keys: Sequence[BlockKey], tiers: Sequence[str]) -> bool:
        """Whether the hit ``keys`` (found in ``tiers``) of ``req_id`` is verified instead
        of loaded; drawn once per request (vLLM may ask again before it admits it)."""
        drawn = self._decided.get(req_id)
        if drawn is None:
            drawn = self._decided[req_id] = self._sampler.draw()
        if drawn:
            self._candidates[req_id] = (list(keys), list(tiers))
        return drawn

    # ---- per request -------------------------------------------------------------------

    def begin(self, state: ReqState, start: int, locate: Locate) -> None:
        """``on_alloc`` of a request (told 0 external tokens): if its hit was sampled, hold
        the stored blocks it would have loaded, from block ``start``."""
        req_id = state.request.request_id
        self._decided.pop(req_id, None)
        cand = self._candidates.pop(req_id, None)
        if cand is None:
            return
        self.forget_pending(req_id)
        held = _Held(req_id)
        for i, key in enumerate(cand[0]):
            if key in self.parts.promotions:
                continue  # being filled by another request's read: not comparable now
            slot = self.parts.index.slot(key)
            if slot is not None:
                self.parts.index.touch(key)
                self.parts.index.pin(slot)
                tier: TierName = TierName.CPU
            else:
                loc = locate(key)
                if loc is None:
                    continue  # gone since the lookup
                planner, fid, pos = loc
                got = self.parts.promotions.begin(key)
                if got is None:
                    continue  # no free slot to read it into: not verified
                slot, tier = got, planner.tier
                held.reads.setdefault((planner, fid), []).append((pos, slot, key))
                held.promoted[key] = (planner, fid)
            held.positions.append(start + i)
            held.slots.append(slot)
            held.keys.append(key)
            held.tiers.append(tier)
        for planner, fid in held.reads:
            planner.index.pin(fid)
            planner.index.touch(fid)
        if held.keys:
            self._pending[req_id] = held

    def forget(self, req_id: str) -> None:
        """``req_id`` finished or was preempted: drop its draw and release a check whose
        job was not issued yet (an issued one runs on: its bytes were captured)."""
        self._decided.pop(req_id, None)
        self._candidates.pop(req_id, None)
        self.forget_pending(req_id)

    def forget_pending(self, req_id: str) -> None:
        held = self._pending.pop(req_id, None)
        if held is None:
            return
        for slot, key in zip(held.slots, held.keys, strict=True):
            if key in held.promoted:
                self.parts.promotions.undo(key, slot)  # nothing was read into it
            else:
                self.parts.index.unpin(slot)
        for planner, fid in held.reads:
            planner.index.unpin(fid)

    def take_jobs(self, reqs: Mapping[str, ReqState], scheduled: Mapping[str, int],
                  block_size: int) -> list[VerifyJob]:
        """``plan_step``: the checks whose blocks are all computed once this step's
        forward ran."""
        jobs: list[VerifyJob] = []
        for req_id, held in list(self._pending.items()):
            state, n = reqs.get(req_id), scheduled.get(req_id)
            if state is None or n is None:
                continue
            last = max(held.positions)
            if state.request.num_computed_tokens + n < (last + 1) * block_size or last >= len(state.block_ids):
                continue
            del self._pending[req_id]
            vid = self._next_id
            self._next_id += 1
            self._issued[vid] = held
            reads = tuple(
                ChunkRead(planner.tier, fid, tuple(p for p, _, _ in items), tuple(s for _, s, _ in items),
                          tuple(k for _, _, k in items))
                for (planner, fid), items in held.reads.items()
            )
            jobs.append(VerifyJob(vid, req_id, tuple(state.block_ids[p] for p in held.positions),
                                  tuple(held.slots), tuple(held.keys), tuple(held.tiers), reads))
        return jobs

    def has_work(self) -> bool:
        """Checks issued and not reported yet (their reads land in later steps)."""
        return bool(self._issued)

    # ---- reports -----------------------------------------------------------------------

    def on_worker_meta(self, meta: WorkerReport) -> None:
        for vid, n in meta.verified.items():
            held = self._issued.get(vid)
            if held is None:
                continue
            held.ranks += n
            held.mismatched |= {k for v, k in meta.verify_mismatched if v == vid}
            held.unread |= {k for v, k in meta.verify_unread if v == vid}
            held.inexact |= {k for v, k in meta.verify_inexact if v == vid}
            if held.ranks >= self.world_size:
                del self._issued[vid]
                self._finish(held)

    def _finish(self, held: _Held) -> None:
        """Every rank reported ``held``: count, drop what was wrong, quarantine, unpin."""
        bad_tiers: list[TierName] = []
        for slot, key, tier in zip(held.slots, held.keys, held.tiers, strict=True):
            source = held.promoted.get(key)
            if source is not None:
                self.parts.promotions.end((key,))
            self.parts.index.unpin(slot)
            if key in held.unread:
                self.parts.counters.add(CounterName.VERIFY_UNREAD, tier)
                if source is not None:
                    self.parts.index.remove(key)  # its slot holds nothing
                continue
            self.parts.counters.add(CounterName.VERIFY_SAMPLES, tier)
            if key in held.mismatched:
                self.parts.counters.add(CounterName.VERIFY_MISMATCHES, tier)
                self.parts.index.remove(key)  # never served again, from DRAM or (below) its tier
                # (deleted from an exclusive tier; only forgotten by this instance on a shared one)
                if source is not None:
                    source[0].distrust_key(key)
                else:  # wrong in DRAM: copies written from that slot may be wrong as well
                    for planner in self.parts.lower:
                        planner.distrust_key(key)
                if tier not in bad_tiers:
                    bad_tiers.append(tier)
            elif key in held.inexact:
                self.parts.counters.add(CounterName.VERIFY_INEXACT, tier)
        for planner, fid in held.reads:
            planner.index.unpin(fid)
        for tier in bad_tiers:
            self._quarantine(tier, held.req_id)

    def _quarantine(self, tier: str, req_id: str) -> None:
        q = self.cfg.quarantine_s
        if q <= 0:
            logger.warning("kvtier verify: tier %s served a wrong block (request %s); dropped it "
                           "(verify.quarantine_s is 0: the tier keeps serving)", tier, req_id)
            return
        if not self._mismatches.add(tier, self._clock()):
            logger.warning("kvtier verify: tier %s served a wrong block (request %s); dropped it "
                           "(the tier is quarantined after verify.quarantine_mismatches=%d within %.0f s)",
                           tier, req_id, self.cfg.quarantine_mismatches, self.cfg.quarantine_window_s)
            return
        logger.warning("kvtier verify: tier %s served a wrong block (request %s), %d within %.0f s; it serves "
                       "no hits for %.0f s (verify.quarantine_s)", tier, req_id, self.cfg.quarantine_mismatches,
                       self.cfg.quarantine_window_s, q)
        self._quarantine_until[tier] = self._clock() + q
        self.parts.counters.add(CounterName.VERIFY_QUARANTINES, tier)

    def publish(self) -> None:
        """Each step: the quarantine gauge of every tier ever quarantined."""
        for tier in self._quarantine_until:
            self.parts.counters.set_gauge(GaugeName.VERIFY_QUARANTINED, tier, 1 if self.quarantined(tier) else 0)
