"""The scheduler half without vLLM: the planner under vLLM's hook names.

It serves hybrid models and LoRA requests.

Who calls it: :class:`~vllm_kvtier.connector.scheduler.SchedulerHalf`, from vLLM's
scheduler thread only. It passes vLLM's ``Request`` objects as they are (they have the
attributes of :class:`~vllm_kvtier.plan.inputs.Request`) and plain step inputs.

Hybrid models (more than one KV cache group, vLLM's hybrid KV cache manager on): each
vLLM request reaches the planner as one :class:`GroupView` per group. A view has the id
``<request id>\x1fg<group>`` and the group's keys (:mod:`vllm_kvtier.index.groups`). So
the planner stores and loads units of every group with no notion of groups itself. This
module fans the inputs out to the views and maps the plan back to vLLM's ids. The loads of
one request become one async job. Saves and releases carry the real id. A failed load is
reported (and recomputed) per request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.engine.views import (
    GROUP_SEP,
    AdapterRequest,
    AdapterViews,
    GroupView,
    GroupViews,
    real_id,
    view_id,
)
from vllm_kvtier.index.groups import GroupLayout, GroupSpec, SaveFilter, sliding_hit
from vllm_kvtier.jobs import LoadJob, StepPlan
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters, HistogramName
from vllm_kvtier.plan.chunk_plan import ChunkPlanner
from vllm_kvtier.plan.events import EventLog
from vllm_kvtier.plan.inputs import Request, StepInput, WorkerOutput
from vllm_kvtier.plan.scheduler import PlannerSetup, SchedulerPlanner
from vllm_kvtier.plan.short_first import ShortFirst

__all__ = ["AdapterRequest", "GroupView", "GroupedPlanner", "PlannerSetup", "followed", "real_id", "to_real_ids",
           "view_id"]


def followed(request: Any) -> bool:
    """Whether ``schedule.order`` may judge ``request`` by this connector's hits.

    Not one that reads no cache (``prompt_logprobs``): vLLM replaces the lookup's answer,
    ``None`` too, with 0. Nor one whose KV another connector brings: a P/D decode request
    under vLLM's MultiConnector (``do_remote_prefill``). vLLM 0.34 renamed the flag
    ``skip_reading_external_kv``: either counts."""
    if getattr(request, "skip_reading_prefix_cache", False) or getattr(request, "skip_reading_external_kv", False):
        return False
    params = getattr(request, "kv_transfer_params", None)
    return not (isinstance(params, dict) and params.get("do_remote_prefill"))


def merge_loads(jobs: list[LoadJob], req_id: str) -> LoadJob:
    """The loads of one request's group views as one async job of vLLM's request."""
    return LoadJob(
        req_id,
        tuple(b for j in jobs for b in j.block_ids), tuple(s for j in jobs for s in j.slots),
        tuple(k for j in jobs for k in j.keys), True,
        reads=tuple(r for j in jobs for r in j.reads),
        unloadable=tuple(b for j in jobs for b in j.unloadable),
    )


def to_real_ids(plan: StepPlan) -> StepPlan:
    """A plan made for group views, with vLLM's request ids (what the workers know)."""
    loads: dict[str, list[LoadJob]] = {}
    for job in plan.loads:
        loads.setdefault(real_id(job.req_id), []).append(job)
    plan.loads = [merge_loads(jobs, rid) for rid, jobs in loads.items()]
    plan.saves = [dataclasses.replace(j, req_id=real_id(j.req_id)) for j in plan.saves]
    plan.saves_after = [dataclasses.replace(j, req_id=real_id(j.req_id)) for j in plan.saves_after]
    plan.freed = list(dict.fromkeys(real_id(r) for r in plan.freed))
    plan.preempted = list(dict.fromkeys(real_id(r) for r in plan.preempted))
    return plan


class GroupedPlanner(SchedulerPlanner):
    """The planner under vLLM's hook names, for any number of KV cache groups (its
    introspection is the planner's). A request with a LoRA adapter reaches the planner as
    an :class:`AdapterRequest`, the same object on every hook until it finishes."""

    def __init__(self, cfg: KVTierConfig, setup: PlannerSetup, *, lower: list[ChunkPlanner] | None = None,
                 counters: Counters | None = None, events: EventLog | None = None,
                 layout: GroupLayout | None = None) -> None:
        """``layout``: the engine's KV cache groups (None: one full-attention group). The
        rest is :class:`SchedulerPlanner`'s."""
        super().__init__(cfg, setup, lower=lower, counters=counters, events=events)
        self.adapters = AdapterViews(self.counters)
        self.groups = GroupViews(layout if layout is not None else GroupLayout((GroupSpec("full", self.block_size),)))
        self.plan_views(len(self.layout.groups))
        #: blocks put in load jobs, per group (introspection: tests, ``kvtier inspect``)
        self.group_loaded_blocks = [0] * len(self.layout.groups)
        sc = self.cfg.schedule
        #: ``schedule.order: short-first`` (None: vLLM's order untouched)
        self.order = (ShortFirst(short_tokens=sc.short_tokens, max_wait_s=sc.max_wait_s, counters=self.counters)
                      if sc.order == "short-first" else None)

    @property
    def layout(self) -> GroupLayout:
        """The engine's KV cache groups."""
        return self.groups.layout

    @property
    def hybrid(self) -> bool:
        """Whether the engine has more than one KV cache group."""
        return self.groups.layout.hybrid

    def _view(self, request: Any) -> Any:
        return self.adapters.view(request)

    def group_views(self, request: Any) -> tuple[GroupView, ...]:
        """The views of ``request``, one per group, the same objects until it finishes."""
        return self.groups.views(self._view(request))

    def stored_units_per_group(self) -> list[int]:
        """Units in the CPU tier per KV cache group (introspection: tests, ``kvtier inspect``)."""
        counts = [0] * len(self.layout.groups)
        for key, _ in self.index.items():
            counts[self.groups.key_origins.origin(key)[1]] += 1
        return counts

    def request_state(self, req_id: str) -> Any:
        """The planner's state of a request (or group view) it follows, else None."""
        return self.requests.get(req_id)

    def record_lookup(self, request: Request) -> None:
        if not self.hybrid:
            super().record_lookup(self._view(request))
            return
        # The units a whole hit would load: every group's blocks up to the hit's cap (a
        # sliding group: its window there), so a full hit still reads as 100%.
        m = max(0, (request.num_prompt_tokens - 1) // self.block_size)
        n = sum(m - spec.window_start(m) for spec in self.layout.groups)
        self.counters.add(CounterName.LOOKUP_BLOCKS, TierName.CPU, n)

    def on_new_request(self, request: Request) -> None:
        """vLLM queued ``request``: ``schedule.order`` follows it until admitted.

        Its tokens to compute are estimated from the tiers: the run of its blocks they
        hold. For a hybrid model it is the whole prompt until it is looked up."""
        if self.order is None or not followed(request):
            return
        stored = 0 if self.hybrid else self.lookups.stored_blocks(self._view(request))
        self.order.arrived(request.request_id, request.num_prompt_tokens - stored * self.block_size)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.hybrid:
            n, load_async = self.lookup(self._view(request), num_computed_tokens)
        else:
            n, load_async = self._hybrid_lookup(request, num_computed_tokens)
        if self.order is not None and n is not None and not self.order.admit(
                request.request_id, request.num_prompt_tokens - num_computed_tokens - n):
            return None, False  # a shorter request waits: vLLM asks again next step
        return n, load_async

    def _hybrid_lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The hit every group can serve.

        It is the shortest full-attention group hit. Then, per sliding-window group, it is
        the longest prefix within it whose window is stored. It never covers the block of
        the last prompt token. vLLM then computes from exactly the hit."""
        views = self.group_views(request)
        bs = self.block_size
        start = num_computed_tokens // bs
        hit = min(max(0, (request.num_prompt_tokens - 1) // bs), len(request.block_hashes))
        # Every group's pool lookups in one round, so no group's answer expires while
        # another group's is awaited.
        for tier in self.lower:
            tier.refresh()
        if any([self.lookups_pending(v, self._lookup_from(g, start), hit) for g, v in enumerate(views)]):
            return None, False
        for g in self.layout.full_groups:
            n, _ = self.lookup(views[g], num_computed_tokens)
            if n is None:
                return None, False
            hit = min(hit, start + n // bs)
        for g in self.layout.sliding_groups:
            if hit <= start:
                break
            spec = self.layout.groups[g]
            lo = spec.window_start(start + 1)
            present = [True] * lo + self.present(views[g], lo, hit)
            present += [False] * (hit - len(present))
            hit = sliding_hit(present, hit, spec, floor=start)
        for v in views:
            self.note_match_start(v, num_computed_tokens)
        if hit - start < max(1, self.cfg.min_load_blocks):
            return 0, False
        return (hit - start) * bs, True

    def _lookup_from(self, group: int, start: int) -> int:
        """The first block of group ``group`` a hit starting at block ``start`` may need.

        It is ``start``, or the start of a sliding window ending there."""
        spec = self.layout.groups[group]
        return spec.window_start(start + 1) if spec.kind == "sliding" else start

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if self.order is not None:
            self.order.gone(request.request_id)
        self.on_alloc(self._view(request), block_ids, num_external_tokens)

    def update_state_after_alloc_groups(self, request: Request, block_ids: Sequence[Sequence[int]],
                                        num_external_tokens: int) -> None:
        """``block_ids``: one list per KV cache group (vLLM's ``KVCacheBlocks.get_block_ids()``)."""
        if not self.hybrid:
            self.update_state_after_alloc(request, list(block_ids[0]), num_external_tokens)
            return
        if self.order is not None:
            self.order.gone(request.request_id)
        checkpoint_blocks = self.cfg.swa_checkpoint_tokens // self.block_size
        for g, v in enumerate(self.group_views(request)):
            self.on_alloc(v, list(block_ids[g]), num_external_tokens)
            spec = self.layout.groups[g]
            state = self.requests.live.get(v.request_id)
            if spec.kind == "sliding" and state is not None and state.keep is None:
                state.keep = SaveFilter(spec, request.num_prompt_tokens, checkpoint_blocks)

    def _merge_load_timing(self, req_id: str) -> None:
        """The async load of ``req_id`` ended.

        Its views' waits are one wait, observed once. The first view observes it: the
        slowest tier, every view's lower-tier blocks."""
        states = [st for g in range(len(self.layout.groups))
                  if (st := self.request_state(view_id(req_id, g))) is not None and st.load_issued_s is not None]
        if len(states) < 2:
            return
        first = states[0]
        first.load_issued_s = min(st.load_issued_s for st in states)
        first.load_tier = self.loads.slowest([st.load_tier for st in states])
        first.load_lower_blocks = sum(st.load_lower_blocks for st in states)
        for st in states[1:]:
            st.load_issued_s = None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        view = self._view(request)
        self.adapters.forget(request.request_id)
        if self.order is not None:
            self.order.gone(request.request_id)  # ended while waiting (an abort)
        return self.on_finished(view, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: Sequence[Sequence[int]]) -> tuple[bool, dict | None]:
        """Every group's view finished; held if any view is held. A sliding group's blocks
        stored while it decoded and outside every window a later request can use
        (:class:`~vllm_kvtier.index.groups.SaveFilter`) are dropped again."""
        if not self.hybrid:
            return self.request_finished(request, list(block_ids[0]))
        views = self.group_views(request)
        self.groups.forget(request.request_id)
        self.adapters.forget(request.request_id)
        if self.order is not None:
            self.order.gone(request.request_id)
        hold, params = False, None
        for g, v in enumerate(views):
            state = self.requests.live.get(v.request_id)
            stale: list[int] = []
            if state is not None and isinstance(state.keep, SaveFilter):
                state.keep.with_final(self.saves.saveable_blocks(v, request.num_computed_tokens))
                stale = [p for p in state.saved if not state.keep(p)]
            h, p = self.on_finished(v, list(block_ids[g]))
            if state is not None:
                for pos in stale:
                    self.drop_stored(state.saved.pop(pos))
            hold = hold or h
            if p:
                params = {**(params or {}), **p}
        return hold, params

    def plan_groups(self, per_group: list[StepInput]) -> StepPlan:
        """The plan of one step, from each group's view of vLLM's schedule.

        It uses vLLM's request ids. The loads of one request are one async job."""
        if not self.hybrid:
            return self.plan_step(per_group[0])
        first = per_group[0]
        n = range(len(per_group))
        step = StepInput(
            {view_id(r, g): t for r, t in first.num_scheduled_tokens.items() for g in n},
            tuple(view_id(r, g) for r in first.preempted for g in n),
            block_ids={view_id(r, g): ids for g in n for r, ids in per_group[g].block_ids.items()},
            new_block_ids={view_id(r, g): ids for g in n for r, ids in per_group[g].new_block_ids.items()},
        )
        plan = self.plan_step(step)
        for job in plan.loads:
            g = int(job.req_id.rpartition(GROUP_SEP)[2] or 0)
            self.group_loaded_blocks[g] += len(job.block_ids)
        plan = to_real_ids(plan)
        for job in plan.loads:  # one observation per vLLM request, as for one group
            for tier, count in self.loads.tier_counts(job).items():
                if count > 0:
                    self.counters.observe(HistogramName.REQUEST_LOADED_BLOCKS, tier, count)
        return plan

    def on_grouped_output(self, out: WorkerOutput) -> None:
        """What the workers reported, fanned out to every group's view of each request."""
        if self.hybrid:
            n = range(len(self.layout.groups))

            def fan(ids: frozenset[str]) -> frozenset[str]:
                return frozenset(view_id(r, g) for r in ids for g in n)

            for rid in out.finished_recving:
                self._merge_load_timing(rid)
            out = dataclasses.replace(out, finished_recving=fan(out.finished_recving),
                                      finished_sending=fan(out.finished_sending),
                                      failed_loads=fan(out.failed_loads))
        self.on_worker_output(out)
