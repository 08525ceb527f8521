"""What the scheduler half tells the worker half each step (inside ``SchedulerOutput``).

Plain frozen dataclasses of ints and bytes: cheap to pickle to every worker process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class SaveJob:
    """Copy ``block_ids[i]`` of the engine's KV cache into CPU ``slots[i]`` (key ``keys[i]``)."""

    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class LoadJob:
    """Copy CPU ``slots[i]`` into engine ``block_ids[i]``; ``asynchronous`` jobs are
    reported through ``finished_recving``, sync jobs complete before the forward."""

    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]
    asynchronous: bool


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    #: Slots of the CPU pool; the worker allocates the pool when it first sees this.
    num_slots: int
    saves: list[SaveJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    #: Finished requests whose blocks the scheduler holds for us: report each in
    #: ``finished_sending`` once all its transfers are complete.
    release: list[str] = field(default_factory=list)
    #: Requests preempted this step: their blocks may be rewritten by this step's forward,
    #: so saves still in flight from them must finish first.
    preempted: list[str] = field(default_factory=list)
    #: Step counter, to run each step's saves exactly once.
    step: int = 0
