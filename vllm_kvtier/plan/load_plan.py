"""Load planning: a request's hit becomes a load job; the load's pins end or are undone.

Who calls it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`, from vLLM's
scheduler thread only. Nothing here blocks or does I/O. The worker moves the bytes.

A block whose key is in DRAM is read from its CPU slot, pinned until the load is done. A
block stored below is promoted: it gets a pinned CPU slot, the worker reads its chunk
there, then copies the slot into the engine's block. A block left without a slot is
unloadable: vLLM recomputes it. An async load's pins end at ``finished_recving``
(:meth:`LoadPlanner.end`). A sync load's pins end in the step that runs it
(:meth:`~vllm_kvtier.plan.scheduler.SchedulerPlanner.plan_step`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm_kvtier.jobs import ChunkRead, LoadJob, PeerRead
from vllm_kvtier.keys import BlockKey, TierName
from vllm_kvtier.metrics import CounterName, HistogramName
from vllm_kvtier.plan.chunk_plan import ChunkPlanner
from vllm_kvtier.plan.events import EventLog
from vllm_kvtier.plan.parts import PlanExtras, PlanParts
from vllm_kvtier.plan.peer_plan import PeerPlan
from vllm_kvtier.plan.req_state import ReqState

TIER = TierName.CPU
#: vLLM's null block: held by sliding-window groups outside the window; never loaded or saved.
NULL_BLOCK = 0


@dataclass
class LoadOptions:
    """How this engine's loads are shaped. The connector sets them once, before the first
    request. Lookups and loads read them."""

    #: Every load is async. Hybrid models: a failed load is reported per request, which
    #: vLLM supports for async loads only. vLLM's V2 model runner with the recompute
    #: policy: a rejected sync load gives wrong output there (see
    #: :func:`~vllm_kvtier.connector.wiring.sync_load_failures_unsafe`).
    always_async: bool = False
    #: Engine block id 0 is vLLM's null block. Sliding-window groups hold it outside the
    #: window. It is never loaded or saved (hybrid models).
    skip_null_blocks: bool = False
    #: Observe the per-request load histogram per load job. Off: the connector observes
    #: merged jobs (hybrid models).
    observe_loads: bool = True
    #: Requests per vLLM request (hybrid: one per group). Each prefill token is counted
    #: once for load-or-recompute.
    views_per_request: int = 1


class LoadPlanner:
    """Plans the loads of admitted requests. Owns the load jobs planned since the last
    step. What a load pins is kept in its request's :class:`ReqState`."""

    def __init__(self, parts: PlanParts, options: LoadOptions, extras: PlanExtras, *, load_mode: str,
                 events: EventLog | None = None) -> None:
        """``extras``: its prefetcher and load policy are used. ``events``: None when
        vLLM's KV events are off."""
        self.parts = parts
        self.options = options
        self.extras = extras
        self.load_mode = load_mode
        self.events = events
        self._jobs: list[LoadJob] = []

    def take_jobs(self) -> list[LoadJob]:
        """The load jobs planned since the last call (once a step)."""
        jobs, self._jobs = self._jobs, []
        return jobs

    def has_jobs(self) -> bool:
        return bool(self._jobs)

    def plan(self, state: ReqState, start: int, n: int) -> None:
        """A load of blocks ``[start, start + n)`` of ``state``'s request from DRAM and the
        lower tiers."""
        request = state.request
        # A sliding-window group holds the null block outside the window: nothing to load there.
        positions = [p for p in range(start, min(start + n, len(state.block_ids)))
                     if not (self.options.skip_null_blocks and state.block_ids[p] == NULL_BLOCK)]
        keys = [BlockKey(request.block_hashes[p]) for p in positions]
        # (planner, chunk) -> [(position, slot, key)]
        reads: dict[tuple[ChunkPlanner, str], list[tuple[int, int, BlockKey]]] = {}
        # Pin every key already in DRAM first: promoting the lower-tier ones below
        # allocates slots, and must not evict a key this same load reads from DRAM.
        slots = self._pin_dram_hits(keys)
        for i, k in enumerate(keys):
            if slots[i] is not None:
                continue
            loc = self.parts.locate(k)
            if loc is None:  # gone since the match (e.g. its chunk failed): recompute it
                continue
            tier, fid, pos = loc
            s = self._promote(k, keys[i - 1] if i else None)
            slots[i] = s
            if s is not None:
                reads.setdefault((tier, fid), []).append((pos, s, k))
                state.promoting.append(k)
                state.sources[k] = (tier, fid)
            self.parts.counters.add(CounterName.HIT_BLOCKS, tier.tier)
            if tier.origins.is_remote(fid):
                self.parts.counters.add(CounterName.REMOTE_HIT_BLOCKS, tier.tier)
        blocks = [state.block_ids[p] for p in positions]
        unloadable = tuple(b for b, s in zip(blocks, slots, strict=True) if s is None)
        asynchronous = (self.options.always_async or self.load_mode == "async" or bool(reads)
                        or bool(unloadable))
        chunk_reads = tuple(
            ChunkRead(tier.tier, fid, tuple(p for p, _, _ in items), tuple(s for _, s, _ in items),
                      tuple(k for _, _, k in items))
            for (tier, fid), items in reads.items()
        )
        for tier, fid in reads:
            tier.index.pin(fid)
            tier.index.touch(fid)
            state.pinned_files.append((tier, fid))
        job = self._load_job(request.request_id, blocks, slots, keys, asynchronous, reads=chunk_reads)
        self._jobs.append(job)
        if self.events is not None and reads:  # promoted into CPU slots: what a router sees of them
            self.events.note(request, range(start, start + n), keys)
        state.loaded.update(zip(blocks, keys, strict=True))
        state.async_loading = asynchronous
        if asynchronous:
            state.pinned_slots.extend(job.slots)
        self._observe_issued(state, job)

    def plan_peer(self, state: ReqState, plan: PeerPlan, start: int, n: int) -> None:
        """An async load of blocks ``start``.. read from a prefill instance's CPU tier. DRAM
        keys are pinned and used as they are. The others get a pinned slot to read into."""
        keys = list(plan.keys[:n])
        slots = self._pin_dram_hits(keys)
        if self.events is not None:  # read into CPU slots: what a router sees of them
            self.events.note(state.request, range(start, start + len(keys)), keys)
        remote, local, wanted = [], [], []
        for i, k in enumerate(keys):
            if slots[i] is not None or k in self.parts.promotions:  # the latter: recomputed
                continue
            s = self._promote(k, keys[i - 1] if i else None)
            slots[i] = s
            if s is not None:
                remote.append(plan.remote_slots[i])
                local.append(s)
                wanted.append(k)
                state.promoting.append(k)
        self.parts.counters.add(CounterName.HIT_BLOCKS, TierName.PEER, len(wanted))
        if not plan.trusted and wanted:
            # An untrusted peer's blocks serve this request only: dropped from the CPU
            # index when the load ends (lookups skip them meanwhile: they are promotions),
            # and nothing this request computes on top of them is stored.
            state.private = True
            state.private_keys.extend(wanted)
            self.parts.counters.add(CounterName.PEER_UNPROMOTED_BLOCKS, TierName.PEER, len(wanted))
        blocks = state.block_ids[start : start + len(keys)]
        # Even with nothing to read (all DRAM hits) the worker tells the prefill side, so
        # that it frees the offer now rather than after hold_s.
        read = PeerRead(state.request.request_id, plan.peer, tuple(remote), tuple(local), tuple(wanted),
                        notify=plan.notify)
        job = self._load_job(state.request.request_id, blocks, slots, keys, True, peer_read=read)
        self._jobs.append(job)
        state.loaded.update(zip(blocks, keys, strict=True))
        state.async_loading = True
        state.pinned_slots.extend(job.slots)

    def end(self, state: ReqState) -> None:
        """The async load of ``state`` ended, or its request was dropped: unpin what it
        pinned. An untrusted peer's keys leave the CPU index."""
        state.async_loading = False
        for s in state.pinned_slots:
            self.parts.index.unpin(s)
        state.pinned_slots = []
        for tier, fid in state.pinned_files:
            tier.index.unpin(fid)
        state.pinned_files = []
        self.parts.promotions.end(state.promoting)
        state.promoting = []
        for key in state.private_keys:
            self.parts.index.remove(key)  # an untrusted peer's block: used by this request only
        state.private_keys = []

    def drop(self, state: ReqState, block: int) -> bool:
        """Engine block ``block`` of ``state`` failed to load: forget it, cool its source
        chunk down, remove its key from the CPU tier. Whether the key was there."""
        key = state.loaded.pop(block)
        self.parts.promotions.end((key,))
        src = state.sources.pop(key, None)
        if src is not None:
            # Not offered again for a while: the request is rescheduled at
            # once, and a tier that just failed would fail it again (a loop).
            src[0].cool_down(src[1])
        return bool(self.parts.index.remove(key))

    @staticmethod
    def tier_counts(job: LoadJob) -> dict[str, int]:
        """Blocks of ``job`` copied from each tier (lower-tier ones are read into CPU first)."""
        per_tier: dict[str, int] = {TIER: len(job.slots)}
        for read in job.reads:
            per_tier[read.tier] = per_tier.get(read.tier, 0) + len(read.slots)
            per_tier[TIER] -= len(read.slots)
        return per_tier

    def slowest(self, tiers: list[str]) -> str:
        """The slowest of ``tiers`` (CPU when none)."""
        order: list[str] = [TIER, *(t.tier for t in self.parts.lower)]  # fastest first
        return max(tiers or [TIER], key=lambda t: order.index(t) if t in order else len(order))

    def observe_done(self, state: ReqState, read_s: float | None = None) -> None:
        """The async load of ``state`` is done: observe its wait, and its tier's load time.
        ``read_s``: its slowest lower-tier read as the workers timed it. The tier is judged
        by that: the wait also holds the engine steps the load overlapped (vLLM starts an
        async load after the step's forward and hears of it after a later one), seconds a
        step on a CPU engine, which would switch a fast tier off for good."""
        if state.load_issued_s is not None:
            waited = time.monotonic() - state.load_issued_s
            self.parts.counters.observe(HistogramName.REQUEST_LOAD_WAIT_SECONDS, state.load_tier, waited)
            if self.extras.load_policy is not None:
                sample = min(waited, read_s) if read_s else waited
                self.extras.load_policy.observe_load(state.load_tier, state.load_lower_blocks, sample)
            state.load_issued_s = None

    def _observe_issued(self, state: ReqState, job: LoadJob) -> None:
        """Per-request load histograms: blocks copied from each tier now. The wait is 0
        for a sync load (it runs in the step that computes on it). An async one's runs
        until ``finished_recving`` (:meth:`observe_done`)."""
        per_tier = self.tier_counts(job)
        if self.options.observe_loads:
            for tier, n in per_tier.items():
                if n > 0:
                    self.parts.counters.observe(HistogramName.REQUEST_LOADED_BLOCKS, tier, n)
        slowest = self.slowest([t for t, n in per_tier.items() if n > 0])
        if job.asynchronous:
            state.load_issued_s, state.load_tier = time.monotonic(), slowest
            state.load_lower_blocks = sum(len(r.slots) for r in job.reads)
        else:
            self.parts.counters.observe(HistogramName.REQUEST_LOAD_WAIT_SECONDS, slowest, 0.0)

    @staticmethod
    def _load_job(req_id: str, blocks: list[int], slots: list[int | None], keys: list[BlockKey],
                  asynchronous: bool, **parts: Any) -> LoadJob:
        """The job of a load whose block ``blocks[i]`` reads ``keys[i]`` from ``slots[i]``.
        Blocks without a slot go to ``unloadable``."""
        have = [i for i, s in enumerate(slots) if s is not None]
        return LoadJob(req_id, tuple(blocks[i] for i in have), tuple(slots[i] for i in have),  # type: ignore[misc]
                       tuple(keys[i] for i in have), asynchronous,
                       unloadable=tuple(b for b, s in zip(blocks, slots, strict=True) if s is None), **parts)

    def _pin_dram_hits(self, keys: list[BlockKey]) -> list[int | None]:
        """Pin the keys a load reads from DRAM. Their slots, None for the others (a block
        still without a slot when the job is sent is unloadable: recomputed)."""
        slots: list[int | None] = [None] * len(keys)
        for i, k in enumerate(keys):
            s = self.parts.index.slot(k)
            if s is not None and k not in self.parts.promotions:
                self.parts.index.touch(k)
                self.parts.index.pin(s)
                slots[i] = s
                self.parts.counters.add(CounterName.HIT_BLOCKS, TIER)
                if self.extras.prefetcher is not None:
                    self.extras.prefetcher.note_hit(k)
        return slots

    def _promote(self, key: BlockKey, parent: BlockKey | None = None) -> int | None:
        """A CPU slot for a lower-tier block about to be read (pinned), or None if none is free."""
        slot = self.parts.promotions.begin(key, parent)
        if slot is None:
            self.parts.counters.add(CounterName.STORE_SKIPPED, TIER)
        return slot
