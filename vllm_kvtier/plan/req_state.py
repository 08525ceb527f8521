"""What the scheduler half keeps about one request it follows (admitted, not finished):
its blocks, what was saved and loaded, and what an async load of it pins.

Who uses it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner` and
:class:`~vllm_kvtier.plan.save_plan.SavePlanner`, from vLLM's scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_kvtier.keys import BlockKey, TierName

if TYPE_CHECKING:
    from vllm_kvtier.plan.chunk_plan import ChunkPlanner


@dataclass
class ReqState:
    request: Any  # vllm.v1.request.Request (live object owned by the scheduler)
    block_ids: list[int]
    #: Blocks [0, next_save) are stored, being stored, or were skipped.
    next_save: int = 0
    #: Slots pinned by an async load of this request, released on finished_recving.
    pinned_slots: list[int] = field(default_factory=list)
    #: block id -> key for blocks loaded into this request, to map load errors to keys.
    loaded: dict[int, BlockKey] = field(default_factory=dict)
    #: key -> (lower tier, chunk) it is promoted from, to cool that chunk down on failure.
    sources: dict[BlockKey, tuple[ChunkPlanner, str]] = field(default_factory=dict)
    #: Whether any save was issued for this request's blocks.
    saves_issued: bool = False
    #: Lower-tier chunks (tier, id) pinned by an async load of this request, and keys
    #: being promoted.
    pinned_files: list[tuple[ChunkPlanner, str]] = field(default_factory=list)
    promoting: list[BlockKey] = field(default_factory=list)
    #: An async load of this request is in flight (until finished_recving).
    async_loading: bool = False
    #: position -> key of every block this request saved, to undo the ones computed on
    #: top of a block that then failed to load.
    saved: dict[int, BlockKey] = field(default_factory=dict)
    #: time.monotonic() when its async load was issued, and the slowest tier it reads
    #: (for the load-wait histogram, observed on finished_recving).
    load_issued_s: float | None = None
    load_tier: str = TierName.CPU
    #: blocks of that async load read from a tier below CPU (for the load-time estimate)
    load_lower_blocks: int = 0
    #: The key-pin TTL its prompt blocks get once stored (``kvtier_pin_ttl_s``, as
    #: :func:`~vllm_kvtier.plan.request_params.request_pin_ttl_s` allowed it), or None.
    pin_ttl_s: float | None = None
    #: Its KV depends on blocks read from a peer not in ``nixl.trusted_peers``: nothing of
    #: it is stored (not its prompt's blocks, not what it computes on top of them).
    private: bool = False
    #: Keys read from such a peer into CPU slots for this request only: dropped from the
    #: CPU index once its load ended.
    private_keys: list[BlockKey] = field(default_factory=list)
    #: Which block positions are worth saving (a sliding-window group's view:
    #: :class:`~vllm_kvtier.index.groups.SaveFilter`); None: every one.
    keep: Callable[[int], bool] | None = None
