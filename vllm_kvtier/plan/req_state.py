"""What the scheduler half keeps about one request it follows (admitted, not finished):
its blocks, what was saved and loaded, and what an async load of it pins. And the table of
those requests, by stage (:class:`RequestTable`).

Who uses it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`, its load and save
planners, from vLLM's scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_kvtier.config import CPUTierConfig
from vllm_kvtier.keys import BlockKey, TierName
from vllm_kvtier.plan.inputs import StepInput
from vllm_kvtier.plan.request_params import IgnoredParams, request_pin_ttl_s

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


class RequestTable:
    """The requests the scheduler planner follows, by stage. Owns each one's
    :class:`ReqState` while it is live (admitted, not finished) or held (finished, its
    async load still running). Knows which requests are new since the last step, and
    which finished ones have saves to order before the next forward."""

    def __init__(self, cpu: CPUTierConfig, ignored: IgnoredParams) -> None:
        """``cpu``, ``ignored``: to check a request's key-pin TTL once (:meth:`start`)."""
        self.cpu = cpu
        self.ignored = ignored
        #: Admitted, not finished.
        self.live: dict[str, ReqState] = {}
        #: Finished requests whose async load still runs (vLLM keeps their blocks until
        #: ``finished_recving``).
        self._held: dict[str, ReqState] = {}
        #: Requests given a fresh state since the last step.
        self._fresh: set[str] = set()
        #: Finished requests with saves out of their blocks issued: vLLM has freed those
        #: blocks, and the worker orders the saves before the next forward.
        self._freed: list[str] = []

    def start(self, request: Any, block_ids: list[int]) -> ReqState:
        """A fresh state for ``request``: new, or resumed after preemption (its old blocks
        are gone). Its key-pin TTL is checked here, once per state."""
        state = ReqState(request, list(block_ids))
        state.pin_ttl_s = request_pin_ttl_s(request, self.cpu, self.ignored)
        self.live[request.request_id] = state
        self._fresh.add(request.request_id)
        return state

    def get(self, req_id: str) -> ReqState | None:
        """The state of a live or held request, else None."""
        return self.live.get(req_id) or self._held.get(req_id)

    def states(self) -> list[ReqState]:
        """Every live and held request's state."""
        return list(self.live.values()) + list(self._held.values())

    def pop(self, req_id: str) -> ReqState | None:
        """Stop following live request ``req_id``. Its state, if it was live."""
        return self.live.pop(req_id, None)

    def take_preempted(self, preempted: Iterable[str]) -> list[str]:
        """A step starts: the preempted requests whose state to drop. Not one resumed
        since the last step (``reset_prefix_cache`` preempts outside ``schedule()``): its
        state is new and stays. No request is new after this call."""
        stale = [req_id for req_id in preempted if req_id not in self._fresh]
        self._fresh.clear()
        return stale

    def refresh_block_ids(self, step: StepInput) -> None:
        """The block tables of ``step``: whole ones replace, new blocks extend."""
        for req_id, ids in step.block_ids.items():
            state = self.live.get(req_id)
            if state is not None:
                state.block_ids = list(ids)
        for req_id, new in step.new_block_ids.items():
            state = self.live.get(req_id)
            if state is not None:
                state.block_ids.extend(new)

    def hold(self, req_id: str, state: ReqState) -> None:
        """Finished ``req_id``'s async load still runs: keep its state until :meth:`release`."""
        self._held[req_id] = state

    def release(self, req_id: str) -> None:
        """The async load of held ``req_id`` ended."""
        self._held.pop(req_id, None)

    def held_ids(self) -> set[str]:
        return set(self._held)

    def free(self, req_id: str) -> None:
        """vLLM freed finished ``req_id``'s blocks after saves out of them were issued.
        The next step's plan names it (:meth:`take_freed`)."""
        self._freed.append(req_id)

    def take_freed(self) -> list[str]:
        """The requests freed since the last call (once a step)."""
        freed, self._freed = self._freed, []
        return freed
