"""Scheduler half: vLLM's scheduler-side hooks, translated for the planner.

Who calls it: :class:`~vllm_kvtier.connector.KVTierConnector` in the scheduler role, from
vLLM's scheduler thread only. The decisions, and every other hook, are the planner's
(:class:`~vllm_kvtier.engine.scheduler.GroupedPlanner`, no vLLM there). This module reads
vLLM's ``SchedulerOutput`` and ``KVConnectorOutput`` into its plain inputs
(:mod:`vllm_kvtier.plan.inputs`), and wraps its step plan as the workers' metadata."""

from __future__ import annotations

from typing import Any

from vllm_kvtier.connector.metadata import KVTierMetadata
from vllm_kvtier.engine.scheduler import GroupedPlanner
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.plan.inputs import StepInput, WorkerOutput


def step_input(scheduler_output: Any, group: int = 0) -> StepInput:
    """The planner's view of a ``SchedulerOutput``: tokens scheduled per request, the
    preempted ones, and the block tables of KV cache group ``group`` (whole from vLLM's
    ``kv_connector_block_state`` when it has one, else the deltas of
    ``scheduled_cached_reqs``)."""
    scheduled = dict(scheduler_output.num_scheduled_tokens)
    preempted = tuple(getattr(scheduler_output, "preempted_req_ids", None) or ())
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    if block_state is not None:
        whole = {r: list(ids[group]) for r in scheduled if (ids := block_state.get_block_ids(r)) is not None}
        return StepInput(scheduled, preempted, block_ids=whole)
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", ())
    replace: dict[str, list[int]] = {}
    append: dict[str, list[int]] = {}
    for req_id, new in zip(cached.req_ids, cached.new_block_ids, strict=False):
        if new is not None:
            (replace if req_id in resumed else append)[req_id] = list(new[group])
    return StepInput(scheduled, preempted, block_ids=replace, new_block_ids=append)


def worker_output(connector_output: Any) -> WorkerOutput:
    """The planner's view of a ``KVConnectorOutput`` (merged over the workers)."""
    stats = getattr(connector_output, "kv_connector_stats", None)
    report = getattr(connector_output, "kv_connector_worker_meta", None)
    return WorkerOutput(
        finished_recving=frozenset(connector_output.finished_recving or ()),
        finished_sending=frozenset(connector_output.finished_sending or ()),
        invalid_block_ids=frozenset(connector_output.invalid_block_ids or ()),
        failed_loads=frozenset(getattr(connector_output, "failed_recving", None) or ()),
        stats=getattr(stats, "data", None),
        report=report if isinstance(report, WorkerReport) else None,
    )


class SchedulerHalf:
    """The :attr:`planner`'s plan as vLLM's connector metadata, vLLM's output as its input."""

    def __init__(self, planner: GroupedPlanner) -> None:
        self.planner = planner

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        inputs = [step_input(scheduler_output, g) for g in range(len(self.planner.layout.groups))]
        return KVTierMetadata.from_plan(self.planner.plan_groups(inputs))

    def update_connector_output(self, connector_output: Any) -> None:
        self.planner.on_grouped_output(worker_output(connector_output))
