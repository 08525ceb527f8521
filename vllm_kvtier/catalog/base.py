"""The catalog contract: how the scheduler learns what a tier below CPU holds.

A planner (:class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner`) decides; it never lists a
bucket or asks a pool. A catalog does that on a thread of its own and hands the results
over. Two abilities, one protocol each, checked with ``isinstance``:

* :class:`Rescans`: changes pushed. A listed tier (S3) is rescanned in the background; the
  planner takes the deltas each step (:meth:`Rescans.take`).
* :class:`PoolLookups`: lookups answered asynchronously. A pool that cannot be listed
  (Mooncake) is asked which chunks exist; the planner submits ids and takes the answers
  on a later step (:meth:`PoolLookups.take_answers`).

Every method is called from vLLM's scheduler thread. None blocks or does I/O there: each
holds a lock for a few dict updates at most. A failed listing or lookup is logged (and
counted where the implementation says) and is a miss; nothing raises into the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from vllm_kvtier.chunkformat import ChunkHeader
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import CounterName

#: One index per TP rank: chunk id -> header, as found in the tier.
Found = list[dict[str, ChunkHeader]]


def common_chunks(found: Found) -> dict[str, ChunkHeader]:
    """The chunks of ``found`` present on every rank, rank 0's headers, in rank 0's order."""
    if not found:
        return {}
    rest = found[1:]
    return {fid: h for fid, h in found[0].items() if all(fid in r for r in rest)}


@dataclass(frozen=True)
class RescanDelta:
    """What changed between two listings of a tier, computed on the rescan thread.

    ``added``: the chunks present on every rank that the previous listing did not show.
    It maps chunk id -> (keys, bytes per rank, block bytes), oldest first. ``removed``: the
    chunks the previous listing (or this instance's own confirmed writes) showed that this
    one does not. They were deleted out of band or expired by a lifecycle rule."""

    added: dict[str, tuple[tuple[BlockKey, ...], int, int]]
    removed: frozenset[str]
    #: chunk ids listed on some ranks only (a write in flight, or a crashed writer's)
    partial: int = 0
    #: counter -> increment, from the scan's own report (e.g. ``manifests_collected``)
    counts: dict[CounterName, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LookupAnswer:
    """A pool's answer: whether each chunk of ``ids`` exists on every rank."""

    ids: tuple[str, ...]
    present: tuple[bool, ...]


@runtime_checkable
class Catalog(Protocol):
    """What every catalog can do: stop. ``close`` is called once, at shutdown, from the
    scheduler thread; it stops the catalog's thread without waiting for a listing or a
    lookup in flight, and releases the stores it reads through."""

    def close(self) -> None: ...


@runtime_checkable
class Rescans(Catalog, Protocol):
    """A listed tier, rescanned in the background: changes pushed."""

    def take(self) -> list[RescanDelta]:
        """The changes since the last call, merged into one delta (none: empty). Never
        blocks. Counters of the catalog's own bounds ride in :attr:`RescanDelta.counts`."""
        ...

    def note_written(self, chunk_id: str) -> None:
        """``chunk_id`` is durable on every rank: a listing that starts after this call and
        does not show it means it was deleted. Never blocks; bounded (an id past the bound
        is dropped and counted)."""
        ...


@runtime_checkable
class PoolLookups(Catalog, Protocol):
    """A pool that cannot be listed, asked by chunk id: lookups answered asynchronously."""

    def submit(self, ids: Sequence[str]) -> bool:
        """Ask whether ``ids`` exist. Never blocks: the ids are queued for the lookup
        thread (an id queued or asked already is not asked twice). False when refused
        (nothing queued): a lookup runs past its deadline (a pool that hangs is not asked
        more), or the queue is full. A refused id is a miss."""
        ...

    def waiting(self, ids: Sequence[str]) -> bool:
        """Whether an answer about one of ``ids`` is still to come within its deadline, or
        has come and was not taken yet: worth asking again next step. Never blocks."""
        ...

    def take_answers(self) -> list[LookupAnswer]:
        """The answers that came since the last call, oldest first. Never blocks."""
        ...


class Listed:
    """A tier listed once, at start-up, and never again (rescans off): nothing changes
    after. ``close`` runs ``on_close`` (the stores the listing used)."""

    def __init__(self, on_close: Callable[[], None] | None = None) -> None:
        self._on_close = on_close

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()


@dataclass
class Listing:
    """What the scheduler knows of one tier below CPU at start-up (a spec's
    ``open_catalog``, :mod:`vllm_kvtier.tiers.registry`): the chunks found, and where
    later changes come from. The planner takes it whole; nothing here does I/O."""

    #: What the start-up listing found, one index per rank.
    found: Found
    #: Where later changes come from (None: only this instance's own writes).
    catalog: Catalog | None = None
    #: Bytes per rank the tier holds that are not chunks (taken off the capacity).
    reserved_bytes_per_rank: int = 0
    #: Chunks some rank saw but could not read: never indexed, never reclaimed.
    unread: frozenset[str] = frozenset()
    #: The chunks of ``found`` this instance wrote (None: the planner's default).
    local_chunks: frozenset[str] | None = None
    #: False: nothing is written to the tier (turned off, or a read-only pool).
    writable: bool = True
    #: Chunks to delete at once: debris a previous run left on only some ranks.
    reclaim: tuple[str, ...] = ()

    @classmethod
    def empty(cls, world_size: int, *, writable: bool = True) -> Listing:
        """A tier that knows no chunk (disabled at start, or nothing listed)."""
        return cls([{} for _ in range(world_size)], writable=writable)


class MemoryLookups:
    """:class:`PoolLookups` answered from memory at submit (``exists``: ids -> present, a
    function of plain data, no I/O). The reference implementation, and the fake pool of the
    planner's tests: an answer is taken at the first :meth:`take_answers` after its
    submit."""

    def __init__(self, exists: Callable[[list[str]], list[bool]]) -> None:
        self._exists = exists
        self._answers: list[LookupAnswer] = []

    def submit(self, ids: Sequence[str]) -> bool:
        asked = list(ids)
        self._answers.append(LookupAnswer(tuple(asked), tuple(self._exists(asked))))
        return True

    def waiting(self, ids: Sequence[str]) -> bool:
        wanted = set(ids)
        return any(not wanted.isdisjoint(a.ids) for a in self._answers)

    def take_answers(self) -> list[LookupAnswer]:
        out, self._answers = self._answers, []
        return out

    def close(self) -> None:
        pass
