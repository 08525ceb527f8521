"""What the scheduler's planners share (:class:`PlanParts`), the optional parts that some
of them consult (:class:`PlanExtras`), and the engine they plan for (:class:`PlannerSetup`).

Who builds them: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`, once. Who reads
them: its lookup, load, prefetch and verification planners, on vLLM's scheduler thread.
Nothing here blocks or does I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters

if TYPE_CHECKING:
    from vllm_kvtier.plan.chunk_plan import ChunkPlanner
    from vllm_kvtier.plan.load_policy import LoadPolicy
    from vllm_kvtier.plan.peer_plan import PeerPlanner
    from vllm_kvtier.plan.prefetch import Prefetcher
    from vllm_kvtier.plan.promotions import Promotions
    from vllm_kvtier.plan.verify_plan import VerifyPlanner

__all__ = ["Locate", "PlanExtras", "PlanParts", "PlannerSetup"]

#: The fastest lower tier holding a key: (planner, chunk id, position), or None.
Locate = Callable[[BlockKey], "tuple[ChunkPlanner, str, int] | None"]


@dataclass(frozen=True)
class PlanParts:
    """The CPU tier's index, the tiers below it, the counters, the promotions under way
    (slots being filled from below) and where a key is below CPU."""

    index: SlotIndex
    #: The tiers below CPU, fastest first.
    lower: list[ChunkPlanner]
    counters: Counters
    promotions: Promotions
    locate: Locate


@dataclass(frozen=True)
class PlanExtras:
    """The parts a configuration may leave out (None: off)."""

    #: P/D: reads from a prefill instance's NIXL agent.
    peer_plan: PeerPlanner | None = None
    prefetcher: Prefetcher | None = None
    #: Load or recompute: a hit is served only when loading beats recomputing it.
    load_policy: LoadPolicy | None = None
    #: Shadow verification of sampled hits.
    verify: VerifyPlanner | None = None


@dataclass(frozen=True)
class PlannerSetup:
    """The engine the scheduler plans for: its shape and the namespace of its KV."""

    #: Tokens per engine block.
    block_size: int
    #: CPU tier slots (resized by
    #: :meth:`~vllm_kvtier.plan.scheduler.SchedulerPlanner.size_pool` at start-up).
    num_slots: int
    #: Bytes of one block over all TP ranks (for usage gauges).
    slot_bytes_total: int
    #: Worker ranks of the engine.
    world_size: int = 1
    #: The namespace this process computed. It is sent in every step plan, so that each
    #: worker checks it computed the same (``""``: nothing to check).
    namespace: str = ""
