"""Scheduler half: vLLM's scheduler-side hooks, translated for the planner.

Who calls it: :class:`~vllm_kvtier.connector.KVTierConnector` in the scheduler role, from
vLLM's scheduler thread only. The decisions are
:class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`'s (no vLLM there); this class only
reads vLLM's ``SchedulerOutput`` and ``KVConnectorOutput`` into the planner's plain inputs
(:mod:`vllm_kvtier.plan.inputs`) and wraps its :class:`~vllm_kvtier.jobs.StepPlan` as the
connector metadata vLLM carries to the workers. A vLLM ``Request`` is passed as it is: it
has the attributes of :class:`~vllm_kvtier.plan.inputs.Request`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm_kvtier.connector.metadata import KVTierMetadata
from vllm_kvtier.index.identity import AdapterFingerprints, AdapterKeys
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import TierName
from vllm_kvtier.plan.inputs import Request, StepInput, WorkerOutput
from vllm_kvtier.plan.scheduler import SchedulerPlanner

logger = logging.getLogger("vllm_kvtier")

#: LoRA request views kept at most (one per live LoRA request; vLLM finishes each).
MAX_VIEWS = 65536


def step_input(scheduler_output: Any) -> StepInput:
    """The planner's view of a ``SchedulerOutput``: tokens scheduled per request, the
    preempted ones, and the block tables (whole from vLLM's ``kv_connector_block_state``
    when it has one, else the deltas of ``scheduled_cached_reqs``)."""
    scheduled = dict(scheduler_output.num_scheduled_tokens)
    preempted = tuple(getattr(scheduler_output, "preempted_req_ids", None) or ())
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    if block_state is not None:
        whole = {r: list(ids[0]) for r in scheduled if (ids := block_state.get_block_ids(r)) is not None}
        return StepInput(scheduled, preempted, block_ids=whole)
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", ())
    replace: dict[str, list[int]] = {}
    append: dict[str, list[int]] = {}
    for req_id, new in zip(cached.req_ids, cached.new_block_ids, strict=False):
        if new is not None:
            (replace if req_id in resumed else append)[req_id] = list(new[0])
    return StepInput(scheduled, preempted, block_ids=replace, new_block_ids=append)


def worker_output(connector_output: Any) -> WorkerOutput:
    """The planner's view of a ``KVConnectorOutput`` (merged over the workers)."""
    stats = getattr(connector_output, "kv_connector_stats", None)
    report = getattr(connector_output, "kv_connector_worker_meta", None)
    return WorkerOutput(
        finished_recving=frozenset(connector_output.finished_recving or ()),
        finished_sending=frozenset(connector_output.finished_sending or ()),
        invalid_block_ids=frozenset(connector_output.invalid_block_ids or ()),
        stats=getattr(stats, "data", None),
        report=report if isinstance(report, WorkerReport) else None,
    )


class AdapterRequest:
    """A LoRA request as the planners see it: vLLM's live ``Request`` with its block
    hashes bound to the adapter's content (:class:`~vllm_kvtier.index.identity.AdapterKeys`).
    vLLM folds only the adapter's *name* into its block hashes, so without this a
    rewritten adapter under the same name would be served its old KV. ``adapter`` None (no
    fingerprint could be taken): no block hashes, so the request neither loads from nor
    saves to the tiers."""

    def __init__(self, request: Any, adapter: bytes | None) -> None:
        self.live = request
        self._keys: Sequence[bytes] = AdapterKeys(request, adapter) if adapter is not None else ()

    @property
    def block_hashes(self) -> Sequence[bytes]:
        return self._keys

    def __getattr__(self, name: str) -> Any:  # everything else: the live request's
        return getattr(self.live, name)


class SchedulerHalf(SchedulerPlanner):
    """The planner under vLLM's hook names and types (its introspection is the planner's).
    A request with a LoRA adapter reaches the planner as an :class:`AdapterRequest`, the
    same object on every hook until it finishes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._adapters = AdapterFingerprints()
        self._views: dict[str, AdapterRequest] = {}

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
            self.counters.add("lora_unkeyed_requests", TierName.ALL)
            logger.warning("kvtier: LoRA adapter %r at %r cannot be fingerprinted (%s): its requests skip the "
                           "tiers", getattr(lora, "lora_name", ""), path, e)
        if len(self._views) >= MAX_VIEWS:  # looked up and never finished: forget the oldest
            self._views.pop(next(iter(self._views)))
        view = self._views[request.request_id] = AdapterRequest(request, adapter)
        return view

    def record_lookup(self, request: Request) -> None:
        super().record_lookup(self._view(request))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.lookup(self._view(request), num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.on_alloc(self._view(request), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        return KVTierMetadata.from_plan(self.plan_step(step_input(scheduler_output)))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        view = self._view(request)
        self._views.pop(request.request_id, None)
        return self.on_finished(view, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self.on_worker_output(worker_output(connector_output))
