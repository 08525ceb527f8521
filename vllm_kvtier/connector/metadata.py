"""The step plan, the worker report and the start-up handshake as vLLM's connector metadata types.

The values themselves are plain (:mod:`vllm_kvtier.jobs`); these subclasses only add
vLLM's base classes, so that vLLM carries them inside ``SchedulerOutput`` (scheduler ->
workers) and ``KVConnectorOutput`` (workers -> scheduler, merged with ``aggregate``).
:class:`KVTierHandshake` goes once, from each worker to the scheduler, at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
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


@dataclass(frozen=True)
class KVTierHandshake(KVConnectorHandshakeMetadata):
    """What one worker tells the scheduler once, after ``register_kv_caches`` and before
    the first request: the size of the CPU pool it allocated. vLLM collects one per rank
    and hands them to the scheduler's ``set_xfer_handshake_metadata``."""

    rank: int
    num_slots: int
