"""The step plan and the worker report as vLLM's connector metadata types.

The values themselves are plain (:mod:`vllm_kvtier.jobs`); these subclasses only add
vLLM's base classes, so that vLLM carries them inside ``SchedulerOutput`` (scheduler ->
workers) and ``KVConnectorOutput`` (workers -> scheduler, merged with ``aggregate``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_kvtier.jobs import StepPlan, WorkerReport


@dataclass
class KVTierMetadata(StepPlan, KVConnectorMetadata):
    """A :class:`~vllm_kvtier.jobs.StepPlan` vLLM hands to every worker."""


@dataclass
class KVTierWorkerMeta(WorkerReport, KVConnectorWorkerMetadata):  # type: ignore[misc]
    """A :class:`~vllm_kvtier.jobs.WorkerReport` vLLM merges over ranks and hands to the
    scheduler; ``aggregate`` returns this class."""
