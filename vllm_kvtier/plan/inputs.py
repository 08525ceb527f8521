"""What the scheduler-side planners read: plain values, filled in by the connector from
vLLM's objects (:mod:`vllm_kvtier.connector.scheduler`).

Who builds them: the connector, on vLLM's scheduler thread, once per hook call. The
planners never see a vLLM class: a request is anything with the five attributes of
:class:`Request` (vLLM's ``Request`` has them; tests use a small dataclass), a step's
schedule is a :class:`StepInput`, what the workers reported is a :class:`WorkerOutput`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_kvtier.jobs import WorkerReport


class Request(Protocol):
    """The live request the planners follow (owned by vLLM's scheduler, read only here):
    its counts move as vLLM computes it, so a planner keeps the object, not a copy."""

    @property
    def request_id(self) -> str: ...

    #: one hash per full block of the request's tokens (prompt, then output), in order
    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    #: the request's ``kv_transfer_params`` (pins, P/D offers, pool hand-off), if any
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class StepInput:
    """One step's schedule, as ``build_connector_meta`` sees it."""

    #: request id -> tokens scheduled for it in this step
    num_scheduled_tokens: Mapping[str, int]
    #: requests preempted in this step (their engine blocks are freed)
    preempted: tuple[str, ...] = ()
    #: request id -> its whole block table now (replaces what the planner knew)
    block_ids: Mapping[str, Sequence[int]] = field(default_factory=dict)
    #: request id -> blocks appended to its table in this step (older vLLM: deltas)
    new_block_ids: Mapping[str, Sequence[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerOutput:
    """What the workers reported after a step (merged over ranks by vLLM)."""

    #: async loads done (their blocks may be used, or are in ``invalid_block_ids``)
    finished_recving: frozenset[str] = frozenset()
    #: held requests whose transfers are all done (their blocks go back to vLLM)
    finished_sending: frozenset[str] = frozenset()
    #: engine blocks whose load failed (vLLM recomputes them)
    invalid_block_ids: frozenset[int] = frozenset()
    #: requests whose async load failed as a whole (hybrid models: vLLM recomputes them)
    failed_loads: frozenset[str] = frozenset()
    #: the workers' counters of the step (``KVTierStats.data``), if any came
    stats: Mapping[str, Any] | None = None
    report: WorkerReport | None = None
