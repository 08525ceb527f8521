"""Where a chunk tier learns of chunks it did not write: its catalog
(:mod:`vllm_kvtier.catalog`).

Who calls it: :class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner`, from vLLM's scheduler
thread. Nothing here blocks. A listed tier's rescans arrive as deltas, handed out a slice a
step (:class:`~vllm_kvtier.plan.rescan_merge.RescanMerge`). A pool's lookups are submitted
here and answered on a later step; ids answered lately are not asked again
(:class:`~vllm_kvtier.plan.lookup_state.AnsweredIds`). The planner indexes what comes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from vllm_kvtier.catalog.base import Catalog, PoolLookups, Rescans
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import Counters, GaugeName
from vllm_kvtier.plan.lookup_state import AnsweredIds
from vllm_kvtier.plan.rescan_merge import Added, RescanMerge


class CatalogFeed:
    """A tier's catalog (None: nothing changes but by the planner's own writes), with the
    rescan deltas not applied yet and the pool's recent answers."""

    def __init__(self, catalog: Catalog | None) -> None:
        self._catalog = catalog
        self._rescans = catalog if isinstance(catalog, Rescans) else None
        self._lookups = catalog if isinstance(catalog, PoolLookups) else None
        self.answered = AnsweredIds()
        self.merge = RescanMerge()

    @property
    def rescans(self) -> Rescans | None:
        """The rescanned catalog, if the tier is listed (benchmarks run it by hand)."""
        return self._rescans

    @property
    def pooled(self) -> bool:
        """Whether the tier is a pool asked by id (its lookups answered later)."""
        return self._lookups is not None

    # ---- a pool's lookups ----------------------------------------------------------

    def take_answers(self) -> Iterator[tuple[str, bool]]:
        """(chunk id, present) of each answer that came, each id remembered as answered."""
        if self._lookups is None:
            return
        for answer in self._lookups.take_answers():
            for fid, present in zip(answer.ids, answer.present, strict=True):
                self.answered.add(fid)
                yield fid, present

    def unanswered(self, ids: Sequence[str]) -> list[str]:
        return [i for i in ids if i not in self.answered]

    def submit(self, ids: Sequence[str]) -> None:
        """Queue a lookup of ``ids`` (with any under way; refused while the pool hangs)."""
        assert self._lookups is not None
        self._lookups.submit(ids)

    def waiting(self, ids: Sequence[str]) -> bool:
        """Whether an answer about one of ``ids`` is still to come within its deadline."""
        return self._lookups is not None and self._lookups.waiting(ids)

    # ---- a listed tier's rescans ---------------------------------------------------

    def take_slice(self, counters: Counters, tier: TierName) -> tuple[list[str], list[Added]] | None:
        """Queue the finished rescans' deltas (their counters go to ``counters``), then hand
        out this step's slice: (chunks to remove, chunks to add), or None."""
        if self._rescans is None:
            return None
        for d in self._rescans.take():
            self.merge.queue(d)
            counters.set_gauge(GaugeName.PARTIAL_CHUNKS, tier, d.partial)
            for name, n in d.counts.items():
                counters.add(name, tier, n)
        return self.merge.next_slice()

    def note_written(self, chunk_id: str) -> None:
        """``chunk_id`` is durable on every rank: a later listing without it means deleted."""
        if self._rescans is not None:
            self._rescans.note_written(chunk_id)

    def close(self) -> None:
        """Shutdown (scheduler thread): close the catalog (its thread and stores)."""
        if self._catalog is not None:
            self._catalog.close()
