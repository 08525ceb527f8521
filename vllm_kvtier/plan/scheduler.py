"""The scheduler-side planner: the index and the policy, in the EngineCore process.

Who calls it: :class:`~vllm_kvtier.connector.scheduler.SchedulerHalf`, which translates
vLLM's hooks into these methods, from vLLM's scheduler thread only. Nothing here blocks,
does I/O or imports vLLM or torch. It decides, on plain inputs
(:mod:`vllm_kvtier.plan.inputs`). The worker moves bytes (the
:class:`~vllm_kvtier.jobs.StepPlan` it returns).

Per request: :meth:`SchedulerPlanner.lookup` (how many tokens could be loaded),
:meth:`~SchedulerPlanner.on_alloc` (vLLM gave it blocks: plan its load),
:meth:`~SchedulerPlanner.on_finished` (save what is left, hold its blocks). Per step:
:meth:`~SchedulerPlanner.plan_step`, then :meth:`~SchedulerPlanner.on_worker_output`.

What it decides each step (``plan_step``):

* **loads**: for a new request, the longest run of its prompt's block keys present in the
  CPU index (:mod:`~vllm_kvtier.plan.lookup_plan`). The run starts after vLLM's own
  prefix-cache hit. It never includes the last prompt token: vLLM must compute at least
  one token to produce logits. Slots read by a load are pinned until the load is known to
  be done (:mod:`~vllm_kvtier.plan.load_plan`).
* **saves**: every block whose KV is complete once this step's forward ran and whose key
  is not stored yet. That means prompt blocks, and generated blocks if
  ``save_decode_blocks``. The worker copies them right after the forward
  (``wait_for_save``). So they are stored even if the engine never steps again. Blocks of
  a request that sync-loads in this step wait for the next step. A failed load would make
  the KV computed on top of it wrong. What a finished request still lacks is saved before
  the next forward. vLLM holds its blocks for us meanwhile (``on_finished`` returns True).
  They are released on ``finished_sending``.
* **eviction**: ``kvaware`` (the default), S3-FIFO, ARC or LRU, among unpinned slots
  (:class:`~vllm_kvtier.index.slot_index.SlotIndex`). Under ``kvaware``, a prompt's head
  outlives its tail, and reused blocks live longer (:mod:`vllm_kvtier.index.kvaware`). A
  request may pin its prompt's blocks for a while with ``kv_transfer_params:
  {"kvtier_pin_ttl_s": N}`` if ``cpu.request_pins`` is on. The TTL is at most
  ``cpu.max_pin_ttl_s``, and pins are bounded by ``cpu.max_pinned_fraction``. Every
  request-level parameter is checked against the config once per request
  (:mod:`vllm_kvtier.plan.request_params`): clients can send them.
* **Lower tiers** (NVMe, S3 when configured, :mod:`vllm_kvtier.plan.chunk_plan`): a
  prefix may continue into blocks stored below the CPU tier. Each key is looked up in
  CPU, then NVMe, then S3. Such a load is always async. Each block is promoted into a CPU
  slot: read there by the worker, then copied into the engine's block. Blocks evicted
  from the CPU tier are demoted (write-back) or written at once (write-through), per tier.

* **Hybrid models** (several KV cache groups): the connector presents each group of a
  request as a request of its own (:class:`~vllm_kvtier.engine.scheduler.GroupView`). It
  decides the hit every group can serve. Here, vLLM's null block is neither loaded nor
  saved, and every load is async (:meth:`SchedulerPlanner.plan_views`). A request's
  ``keep`` filter limits what a sliding-window group saves. A load failed as a whole
  (``WorkerOutput.failed_loads``) drops every block that request loaded.

A key is readable as soon as its save is issued. The worker runs each step's saves before
its loads and keeps steps in order, so a load issued later always sees the bytes.

**KV events** (``events``, only when vLLM's KV cache events are on): the CPU index and each
lower tier's index report to one :class:`~vllm_kvtier.plan.events.EventLog`. They report
what becomes loadable and what stops being so. :meth:`SchedulerPlanner.take_events` hands
a step's worth to vLLM (:mod:`vllm_kvtier.plan.events`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.config.secrets import load_remote_decode_secret
from vllm_kvtier.errors import run_all
from vllm_kvtier.index.cost import CostModel
from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.jobs import SaveJob, StepPlan
from vllm_kvtier.keys import BlockKey, TierName
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner
from vllm_kvtier.plan.cpu_gauges import CpuGauges
from vllm_kvtier.plan.events import EventLog, TierEvent
from vllm_kvtier.plan.inputs import Request, StepInput, WorkerOutput
from vllm_kvtier.plan.load_plan import LoadOptions, LoadPlanner
from vllm_kvtier.plan.load_policy import LoadPolicy
from vllm_kvtier.plan.lookup_plan import LookupPlanner
from vllm_kvtier.plan.parts import PlanExtras, PlannerSetup, PlanParts
from vllm_kvtier.plan.peer_plan import PeerPlanner
from vllm_kvtier.plan.pool_handoff import PoolHandoff
from vllm_kvtier.plan.prefetch import Prefetcher
from vllm_kvtier.plan.promotions import Promotions
from vllm_kvtier.plan.req_state import ReqState, RequestTable
from vllm_kvtier.plan.request_params import IgnoredParams
from vllm_kvtier.plan.save_plan import SavePlanner
from vllm_kvtier.plan.verify_plan import VerifyPlanner

__all__ = ["PlannerSetup", "SchedulerPlanner"]

logger = logging.getLogger(__name__)

TIER = TierName.CPU


class SchedulerPlanner:
    """The whole step's policy, over its parts.

    The parts are :class:`LookupPlanner` (hits), :class:`LoadPlanner` (loads),
    :class:`SavePlanner` (saves) and :class:`RequestTable` (the requests followed). Also
    the lower tiers' planners, prefetch, P/D and verification. It owns the step count and
    the wiring between the parts."""

    def __init__(self, cfg: KVTierConfig, setup: PlannerSetup, *, lower: list[ChunkPlanner] | None = None,
                 counters: Counters | None = None, events: EventLog | None = None) -> None:
        """``lower``: the tiers below CPU, fastest first (NVMe, then S3). ``events``: where
        KV events go. None means vLLM's KV events are off, and no event work is done.

        What every part reads is the :attr:`parts` (the CPU index, the lower tiers, the
        counters). The parts a configuration may leave out are the :attr:`extras` (P/D
        peer, prefetch, load or recompute, verification)."""
        self.cfg = cfg
        self.setup = setup
        block_size, world_size = setup.block_size, setup.world_size
        lower = list(lower or [])
        staging = any(t.policy.mode == "write-back" for t in lower)
        index = SlotIndex(setup.num_slots, eviction=cfg.cpu.eviction,
                          max_pinned_fraction=cfg.cpu.max_pinned_fraction, staging=staging)
        counters = counters if counters is not None else Counters()
        # Keys whose CPU slot is being filled from a lower tier: not readable from CPU yet.
        self.parts = parts = PlanParts(index, lower, counters, Promotions(index, lower), self._locate)
        self.gauges = CpuGauges(index, counters, slot_bytes_total=setup.slot_bytes_total)
        for tier in lower:  # what is stored below is cheaper to drop from DRAM
            tier.on_durable = index.note_below
        self.events = events
        if events is not None:
            index.watch = lambda key, present: events.record(TIER, (key,), present)
            for tier in lower:
                tier.attach_events(events)
        self.saves = SavePlanner(index, lower, counters, block_size=block_size,
                                 save_decode_blocks=cfg.save_decode_blocks, events=events)
        # request-level kv_transfer_params not acted on (counted, rate-limited warnings)
        ignored = IgnoredParams(counters)
        self.requests = RequestTable(cfg.cpu, ignored)
        mc = cfg.mooncake
        self.handoff = PoolHandoff(counters, block_size=block_size,
                                   wait_s=mc.handoff_wait_s if mc is not None else 0.0,
                                   enabled=mc is not None and mc.accept_handoffs, ignored=ignored)
        peer_plan = None
        if cfg.nixl is not None:
            peer_plan = PeerPlanner(index, counters, world_size=world_size, cfg=cfg.nixl,
                                    ignored=ignored, secret=load_remote_decode_secret(cfg.nixl))
        self._step = 0
        lr = cfg.load_or_recompute
        load_policy = None
        if lr.enabled and lower:
            load_policy = LoadPolicy(
                CostModel(lr.prefill_tokens_per_s, lr.probe_interval_s), counters,
                block_bytes=lower[0].block_bytes, block_size=block_size,
                lower_tiers=[t.tier for t in lower], measure_prefill=lr.measure_prefill,
            )
        prefetcher = None
        if cfg.prefetch.enabled and lower:
            prefetcher = Prefetcher(parts, world_size=world_size, max_inflight_blocks=cfg.prefetch.max_inflight_blocks,
                                    max_age_s=cfg.prefetch.max_age_s)
        # Shadow verification (``verify.sample_rate`` > 0 only: otherwise no code path).
        verify = VerifyPlanner(cfg.verify, parts, world_size=world_size) if cfg.verify.sample_rate > 0 else None
        self.extras = extras = PlanExtras(peer_plan, prefetcher, load_policy, verify)
        options = LoadOptions()
        self.lookups = LookupPlanner(cfg, parts, options, self.handoff, extras, block_size=block_size)
        self.loads = LoadPlanner(parts, options, extras, load_mode=cfg.load_mode, events=events)

    @property
    def index(self) -> SlotIndex:
        """The CPU tier's index."""
        return self.parts.index

    @property
    def lower(self) -> list[ChunkPlanner]:
        """The tiers below CPU, fastest first."""
        return self.parts.lower

    @property
    def counters(self) -> Counters:
        return self.parts.counters

    @property
    def block_size(self) -> int:
        return self.setup.block_size

    @property
    def load_options(self) -> LoadOptions:
        """How loads are shaped: set by the connector (hybrid models, vLLM's V2 model runner)."""
        return self.loads.options

    def plan_views(self, views_per_request: int) -> None:
        """Each vLLM request comes as ``views_per_request`` views (one per KV cache group).
        With more than one, every load is async (vLLM takes a failed load per request for
        async loads only), null blocks are skipped, and the connector observes merged loads."""
        hybrid = views_per_request > 1
        options = self.load_options
        options.always_async = hybrid
        options.skip_null_blocks = self.saves.skip_null_blocks = hybrid
        options.observe_loads = not hybrid
        options.views_per_request = views_per_request

    def size_pool(self, num_slots: int) -> None:
        """Plan for a CPU pool of ``num_slots`` slots: the smallest worker's, from vLLM's
        start-up handshake, before any request. Raises ValueError once a slot is in use."""
        if num_slots != self.index.num_slots:
            self.index.resize(num_slots)

    # ---- lookups (LookupPlanner) ----------------------------------------------------

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens`` (:meth:`LookupPlanner.lookup`)."""
        return self.lookups.lookup(request, num_computed_tokens)

    def lookups_pending(self, request: Request, lo: int, hi: int) -> bool:
        """Whether a pool lookup of keys ``[lo, hi)`` is under way (:meth:`LookupPlanner.lookups_pending`)."""
        return self.lookups.lookups_pending(request, lo, hi)

    def present(self, request: Request, lo: int, hi: int) -> list[bool]:
        """Whether each key at ``[lo, hi)`` could be loaded now (:meth:`LookupPlanner.present`)."""
        return self.lookups.present(request, lo, hi)

    def note_match_start(self, request: Request, num_computed_tokens: int) -> None:
        """What :meth:`lookup` records, for a hit decided elsewhere (:meth:`LookupPlanner.note_start`)."""
        self.lookups.note_start(request, num_computed_tokens)

    def record_lookup(self, request: Request) -> None:
        """Count a lookup, once per admission (:meth:`LookupPlanner.record`)."""
        self.lookups.record(request)

    def _locate(self, key: BlockKey) -> tuple[ChunkPlanner, str, int] | None:
        """The fastest lower tier holding ``key``: (planner, chunk id, position). Here, not
        in :class:`LookupPlanner`: the prefetcher needs it, and the lookup the prefetcher."""
        for tier in self.lower:
            if self.extras.verify is not None and self.extras.verify.quarantined(tier.tier):
                continue  # shadow verification found a wrong block there: no hits for now
            loc = tier.locate(key)
            if loc is not None:
                return tier, loc[0], loc[1]
        return None

    def lower_tier(self, name: str) -> ChunkPlanner | None:
        """The planner of lower tier ``name`` ("nvme", "s3"), if configured."""
        return next((t for t in self.lower if t.tier == name), None)

    # ---- per request ---------------------------------------------------------------

    def on_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` to ``request``, ``num_external_tokens`` of them to
        be loaded by us (vLLM's ``update_state_after_alloc``): plan that load."""
        req_id = request.request_id
        # Blocks before `start` are vLLM's own (GPU prefix cache) hit.
        start = self.lookups.take_start(req_id)
        state = self.requests.live.get(req_id)
        if state is None or num_external_tokens > 0 or request.num_computed_tokens == 0:
            # New, or resumed after preemption (its old blocks are gone): start afresh.
            state = self.requests.start(request, block_ids)
        else:
            # Second call after an async load completed: vLLM may have added blocks.
            state.block_ids = list(block_ids)
            return
        for tier in self.lower:
            tier.note_request(request.block_hashes[: self.lookups.loadable_blocks(request)])
        if self.extras.load_policy is not None:
            # Count the decision even when it was to load nothing (all recomputed).
            self.extras.load_policy.commit(req_id)
        if num_external_tokens <= 0:
            if self.extras.verify is not None:
                self.extras.verify.begin(state, start, self._locate)  # a sampled hit: hold its stored blocks
            return
        n = num_external_tokens // self.block_size
        plan = self.extras.peer_plan.take_plan(req_id) if self.extras.peer_plan is not None else None
        if plan is not None:
            self.loads.plan_peer(state, plan, start, n)
        else:
            self.loads.plan(state, start, n)

    # ---- per step ----------------------------------------------------------------

    def plan_step(self, step: StepInput) -> StepPlan:
        """What the workers do in this step (vLLM's ``build_connector_meta``)."""
        self._step += 1
        preempted = list(step.preempted)
        # Its blocks are freed (and may be reused this step): nothing left to save.
        # Unless it was resumed in this same step (reset_prefix_cache preempts outside
        # schedule()): then its state, and any async-load pins, are new and stay.
        for req_id in self.requests.take_preempted(preempted):
            self._drop(req_id)
        self.requests.refresh_block_ids(step)
        live = self.requests.live
        # Before this step's saves are planned: a prefetch slot is pinned, so no save of
        # this step can take it, and it can only evict blocks saved in earlier steps.
        prefetches = self.extras.prefetcher.take_jobs() if self.extras.prefetcher is not None else []
        if self.extras.peer_plan is not None:
            self.extras.peer_plan.expire()
        if self.extras.load_policy is not None:
            self.extras.load_policy.observe_step(sum(
                n for req_id, n in step.num_scheduled_tokens.items()
                if (st := live.get(req_id)) is not None
                and st.request.num_computed_tokens < st.request.num_prompt_tokens
            ) // self.load_options.views_per_request)
        saves = self.saves.take_final()
        saves_after: list[SaveJob] = []
        loads = self.loads.take_jobs()
        # A block computed on top of a sync load that then fails would hold wrong KV: for
        # a request loading in this step, save only blocks computed before it.
        sync_loading = {job.req_id for job in loads if not job.asynchronous}
        for req_id, n_sched in step.num_scheduled_tokens.items():
            state = live.get(req_id)
            if state is None:
                continue
            computed = state.request.num_computed_tokens  # before this step
            if req_id not in sync_loading:
                computed += n_sched  # complete once this step's forward ran
            job = self.saves.plan(state, self.saves.saveable_blocks(state.request, computed))
            if job is not None:
                saves_after.append(job)
        # Sync loads run in this step, before any later step's save can reuse their
        # slots (the worker keeps steps in order), so their pins end here: after saves
        # were planned, so no save of this step evicts a slot that this step reads.
        for load in loads:
            if not load.asynchronous:
                for s in load.slots:
                    self.index.unpin(s)
        verifies = []
        if self.extras.verify is not None:
            verifies = self.extras.verify.take_jobs(live, step.num_scheduled_tokens, self.block_size)
            self.extras.verify.publish()
        meta = StepPlan(
            num_slots=self.index.num_slots, saves=saves, loads=loads, saves_after=saves_after,
            freed=self.requests.take_freed(), preempted=preempted, step=self._step, prefetches=prefetches,
            verifies=verifies, namespace=self.setup.namespace,
        )
        saved = {BlockKey(k) for job in saves + saves_after for k in job.keys} if self.lower else set()
        idle = not live  # nothing running: write back what DRAM holds (see chunk_plan)
        for tier in self.lower:
            demotes, through, deletes = tier.take_jobs(saved, self.index.slot, idle=idle)
            meta.demotes += demotes
            meta.write_through += through
            meta.deletes += [(tier.tier, fid) for fid in deletes]
            meta.forgets += [(tier.tier, fid) for fid in tier.take_forgets()]
            if tier.policy.mode == "write-back":
                # At a clean shutdown the worker flushes every block still only in DRAM,
                # whatever its admission count: the next process starts warm.
                meta.persist_slots[tier.tier] = [
                    s for job in saves + saves_after for s, k in zip(job.slots, job.keys, strict=True)
                    if not tier.index.knows(BlockKey(k))
                ]
        self.gauges.publish()
        return meta

    def _drop(self, req_id: str) -> None:
        self.lookups.forget(req_id)
        if self.extras.verify is not None:
            self.extras.verify.forget(req_id)
        state = self.requests.pop(req_id)
        if state is not None:
            self.loads.end(state)

    def on_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Save what is left and hold the blocks while the worker copies them.

        This is vLLM's ``request_finished``. Returns (whether we hold the blocks,
        ``kv_transfer_params`` to return).

        A request aborted during its async load is not held by us. vLLM itself keeps its
        blocks until the load is reported in ``finished_recving``. Holding it too would
        free the blocks twice.
        """
        self.lookups.forget(request.request_id)  # aborted before admission
        self.handoff.forget(request.request_id)
        if self.extras.verify is not None:
            self.extras.verify.forget(request.request_id)
        pool = self.lower_tier(TierName.MOONCAKE)
        params = self.handoff.params_for(request, writes_pool=pool is not None and pool.policy.mode != "read-only")
        if self.extras.peer_plan is not None:
            self.extras.peer_plan.forget(request.request_id)
        if self.extras.load_policy is not None:
            self.extras.load_policy.forget(request.request_id)
        state = self.requests.pop(request.request_id)
        if state is None:
            return False, params
        if state.async_loading:
            # vLLM keeps the blocks until finished_recving; the loaded range is not valid
            # KV yet, so nothing may be saved from it.
            self.requests.hold(request.request_id, state)  # unpinned on finished_recving
            return False, None
        state.block_ids = list(block_ids)
        upto = self.saves.saveable_blocks(request, request.num_computed_tokens)
        job = self.saves.plan_final(state, upto)
        if self.extras.prefetcher is not None:
            # Its next turn starts with these blocks: bring back the ones that left DRAM.
            self.extras.prefetcher.predict([BlockKey(h) for h in request.block_hashes[:upto]])
        if self.extras.peer_plan is not None:
            peer = self.extras.peer_plan.params_for(request, self.block_size)
            if peer is not None:
                params = {**(params or {}), **peer}
        # A final save copies these blocks in the next step, and a runner may zero or copy
        # into freed blocks before any hook of ours (vLLM's V2 runner does): vLLM holds them
        # until the worker reports the copies done (``finished_sending``). Rare: a step's
        # completed blocks are saved after its forward, except those computed on top of a
        # sync load. Saves issued before are complete when their step ends, so any other
        # request is freed at once (holding all of them would queue every request behind
        # a finished one for a step when vLLM's cache is full).
        if job is not None:
            return True, params
        if state.saves_issued:
            self.requests.free(request.request_id)
        return False, params

    def on_worker_output(self, out: WorkerOutput) -> None:
        """What the workers reported after a step (vLLM's ``update_connector_output``)."""
        read_s = out.report.load_read_seconds if out.report is not None else {}
        for req_id in out.finished_recving:
            state = self.requests.get(req_id)
            if state is not None:
                self.loads.observe_done(state, read_s.get(req_id))
                self.loads.end(state)
                self.requests.release(req_id)
        bad = out.invalid_block_ids
        if bad:
            for state in self.requests.states():
                self._undo_loads(state, bad & state.loaded.keys())
        for req_id in out.failed_loads:
            # A request-level failure (hybrid models): every block it loaded is suspect,
            # and vLLM recomputes the whole request.
            state = self.requests.get(req_id)
            if state is not None:
                self._undo_loads(state, set(state.loaded))
        if self.extras.load_policy is not None and out.stats is not None:
            self.extras.load_policy.observe_stats(out.stats)
        meta = out.report
        if meta is not None:
            for tier in self.lower:
                tier.on_worker_meta(meta)
            if self.extras.prefetcher is not None:
                self.extras.prefetcher.on_worker_meta(meta)
            if self.extras.peer_plan is not None:
                self.extras.peer_plan.on_worker_meta(meta)
            if self.extras.verify is not None:
                self.extras.verify.on_worker_meta(meta)

    def _undo_loads(self, state: ReqState, bad: Iterable[int]) -> None:
        """Engine blocks ``bad`` of ``state`` failed to load.

        Drop their keys, and cool their source chunks down. Undo the saves computed on top
        of them."""
        dropped = 0
        for b in bad:
            dropped += self.loads.drop(state, b)
            if b in state.block_ids:
                self.saves.drop_after(state, state.block_ids.index(b))
        if dropped:
            logger.warning("kvtier: dropped %d block(s) that failed to load", dropped)

    def drop_stored(self, key: BlockKey) -> None:
        """Remove ``key`` from the CPU tier and every lower tier (:meth:`SavePlanner.drop_stored`)."""
        self.saves.drop_stored(key)

    # ---- introspection (tests, `kvtier inspect`) --------------------------------------

    def tracked_requests(self) -> set[str]:
        """Requests whose blocks we follow (admitted, not finished)."""
        return set(self.requests.live)

    def held_requests(self) -> set[str]:
        """Finished requests whose async load still runs."""
        return self.requests.held_ids()

    def pending_final_saves(self) -> list[SaveJob]:
        return self.saves.pending_final()

    def has_pending_work(self) -> bool:
        """Whether vLLM should keep stepping an otherwise idle engine for us.

        It should when there are saves and releases to issue, write-back blocks to flush,
        or chunk writes not yet reported durable (for
        :data:`~vllm_kvtier.plan.chunk_plan.WRITE_SETTLE_S` at most). It should too while
        prefetches are queued or in flight (they land between
        requests)."""
        pf = self.extras.prefetcher
        return bool(self.saves.pending_final() or self.loads.has_jobs()
                    or (pf is not None and pf.has_work())
                    or (self.extras.verify is not None and self.extras.verify.has_work())  # reads to land
                    # write-back blocks only in DRAM: written in idle steps (a restart or
                    # an abort afterwards finds them on the lower tier); chunks being
                    # written: step until the ranks report them durable, so the next
                    # request finds them below
                    or (not self.requests.live
                        and any(t.has_flush_work() or t.awaits_writes() for t in self.lower))
                    # blocks held for a decode instance: keep stepping to see its read's
                    # notification (or the hold expire); and one step at start, in which
                    # the workers publish their NIXL address (else the first hand-off,
                    # finished before it arrives, could not be offered)
                    or (self.extras.peer_plan is not None
                        and (self.extras.peer_plan.holding() > 0 or not self.extras.peer_plan.published())))

    def stats(self) -> dict[str, dict[str, float]] | None:
        return self.counters.drain()

    def take_events(self) -> list[TierEvent]:
        """The tier events since the last call (vLLM's ``take_events``, once a step); none
        when vLLM's KV events are off."""
        return self.events.take() if self.events is not None else []

    def close(self) -> None:
        """Shutdown: stop background rescans of the lower tiers.

        All of them stop, even when one fails to close. The first failure is raised
        after."""
        run_all(tier.close for tier in self.lower)
