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
import logging
from collections.abc import Sequence
from typing import Any

from vllm_kvtier.index.adapters import AdapterFingerprints, AdapterKeys
from vllm_kvtier.index.groups import GroupKeys, GroupLayout, GroupSpec, KeyOrigins, SaveFilter, sliding_hit
from vllm_kvtier.jobs import LoadJob, StepPlan
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, HistogramName
from vllm_kvtier.plan.inputs import Request, StepInput, WorkerOutput
from vllm_kvtier.plan.scheduler import SchedulerPlanner
from vllm_kvtier.plan.short_first import ShortFirst

logger = logging.getLogger("vllm_kvtier")

#: LoRA request views kept at most (one per live LoRA request; vLLM finishes each).
MAX_VIEWS = 65536


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


class AdapterRequest:
    """A LoRA request as the planners see it.

    It is vLLM's live ``Request`` with its block hashes bound to the adapter's content
    (:class:`~vllm_kvtier.index.adapters.AdapterKeys`). vLLM folds only the adapter's
    *name* into its block hashes. Without this, a rewritten adapter under the same name
    would be served its old KV. ``adapter`` None means no fingerprint could be taken. Then
    there are no block hashes, so the request neither loads from nor saves to the tiers."""

    def __init__(self, request: Any, adapter: bytes | None) -> None:
        self.live = request
        self._keys: Sequence[bytes] = AdapterKeys(request, adapter) if adapter is not None else ()

    @property
    def block_hashes(self) -> Sequence[bytes]:
        return self._keys

    def __getattr__(self, name: str) -> Any:  # everything else: the live request's
        return getattr(self.live, name)


#: Separates a request id from its group in a :class:`GroupView`'s id.
GROUP_SEP = "\x1fg"


def view_id(req_id: str, group: int) -> str:
    return f"{req_id}{GROUP_SEP}{group}"


def real_id(req_id: str) -> str:
    """vLLM's request id of a group view's id (an id without a group: itself)."""
    return req_id.rpartition(GROUP_SEP)[0] or req_id


class GroupView:
    """One KV cache group of a live request as the planners see it.

    It has its own id and the group's keys (:class:`~vllm_kvtier.index.groups.GroupKeys`;
    group 0: the request's own). Everything else is the live request's. ``base`` is
    vLLM's request or a LoRA view."""

    def __init__(self, base: Any, group: int, origins: KeyOrigins | None = None) -> None:
        self.live = base
        self.group = group
        self.request_id = view_id(base.request_id, group)
        self._keys: Sequence[bytes] | None = GroupKeys(base, group, origins) if group else None

    @property
    def block_hashes(self) -> Sequence[bytes]:
        return self._keys if self._keys is not None else self.live.block_hashes

    def __getattr__(self, name: str) -> Any:  # everything else: the live request's
        return getattr(self.live, name)


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

    def __init__(self, *args: Any, layout: GroupLayout | None = None, swa_checkpoint_tokens: int = 0,
                 **kwargs: Any) -> None:
        """``layout``: the engine's KV cache groups (None: one full-attention group)."""
        super().__init__(*args, **kwargs)
        self._adapters = AdapterFingerprints()
        self._views: dict[str, AdapterRequest] = {}
        self.layout = layout if layout is not None else GroupLayout((GroupSpec("full", self.block_size),))
        self.hybrid = self.layout.hybrid
        #: with >1 group a failed load is reported per request: vLLM allows it for async loads only
        self.load_options.always_async = self.hybrid
        self.load_options.skip_null_blocks = self.saves.skip_null_blocks = self.hybrid
        self.load_options.observe_loads = not self.hybrid  # observed per merged job (build_connector_meta)
        self.load_options.views_per_request = len(self.layout.groups)
        self._checkpoint_blocks = swa_checkpoint_tokens // self.block_size
        #: derived key -> (vLLM's hash, group), for the keys derived here (KV events)
        self.key_origins = KeyOrigins()
        self._groups: dict[str, tuple[GroupView, ...]] = {}
        #: blocks put in load jobs, per group (introspection: tests, ``kvtier inspect``)
        self.group_loaded_blocks = [0] * len(self.layout.groups)
        sc = self.cfg.schedule
        #: ``schedule.order: short-first`` (None: vLLM's order untouched)
        self.order = (ShortFirst(short_tokens=sc.short_tokens, max_wait_s=sc.max_wait_s, counters=self.counters)
                      if sc.order == "short-first" else None)

    def _view(self, request: Any) -> Any:
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return request
        view = self._views.get(request.request_id)
        if view is not None and view.live is request:
            return view
        path = str(getattr(lora, "lora_path", "") or getattr(lora, "path", ""))
        try:
            adapter: bytes | None = self._adapters.get(path)
        except OSError as e:
            adapter = None
            self.counters.add(CounterName.LORA_UNKEYED_REQUESTS, TierName.ALL)
            logger.warning("kvtier: LoRA adapter %r at %r cannot be fingerprinted (%s): its requests skip the "
                           "tiers", getattr(lora, "lora_name", ""), path, e)
        if len(self._views) >= MAX_VIEWS:  # looked up and never finished: forget the oldest
            self._views.pop(next(iter(self._views)))
        view = self._views[request.request_id] = AdapterRequest(request, adapter)
        return view

    def group_views(self, request: Any) -> tuple[GroupView, ...]:
        """The views of ``request``, one per group, the same objects until it finishes."""
        base = self._view(request)
        views = self._groups.get(request.request_id)
        if views is not None and views[0].live is base:
            return views
        if len(self._groups) >= MAX_VIEWS:
            self._groups.pop(next(iter(self._groups)))
        views = self._groups[request.request_id] = tuple(
            GroupView(base, g, self.key_origins) for g in range(len(self.layout.groups)))
        return views

    def stored_units_per_group(self) -> list[int]:
        """Units in the CPU tier per KV cache group (introspection: tests, ``kvtier inspect``)."""
        counts = [0] * len(self.layout.groups)
        for key, _ in self.index.items():
            counts[self.key_origins.origin(key)[1]] += 1
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
        for g, v in enumerate(self.group_views(request)):
            self.on_alloc(v, list(block_ids[g]), num_external_tokens)
            spec = self.layout.groups[g]
            state = self.requests.live.get(v.request_id)
            if spec.kind == "sliding" and state is not None and state.keep is None:
                state.keep = SaveFilter(spec, request.num_prompt_tokens, self._checkpoint_blocks)

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
        self._views.pop(request.request_id, None)
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
        self._groups.pop(request.request_id, None)
        self._views.pop(request.request_id, None)
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
