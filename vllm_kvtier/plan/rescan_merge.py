"""The rescans' deltas a chunk tier has not applied yet, handed out in slices.

Who calls it: :class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner`, from vLLM's scheduler
thread. The catalog's rescan thread computed the deltas
(:class:`~vllm_kvtier.catalog.base.RescanDelta`). Here they are only queued and sliced.
One step applies at most :data:`MERGE_SLICE` chunks each way. So a listing that changed by
400k objects costs the scheduler thread ~3 ms a step, instead of one long stall.
"""

from __future__ import annotations

from collections import OrderedDict

from vllm_kvtier.catalog.base import RescanDelta
from vllm_kvtier.keys import BlockKey

#: Chunks of a rescan's delta applied per step at most (each way).
MERGE_SLICE = 4096

#: chunk id -> (keys, bytes per rank, block bytes), as a rescan found it
Added = tuple[str, tuple[tuple[BlockKey, ...], int, int]]


class RescanMerge:
    """Deltas queued by chunk id (a chunk added then removed before its slice is in
    neither queue), one slice per step."""

    def __init__(self) -> None:
        self._to_add: OrderedDict[str, tuple[tuple[BlockKey, ...], int, int]] = OrderedDict()
        self._to_remove: OrderedDict[str, None] = OrderedDict()
        self._sliced = False  # a slice was handed out in this step already
        #: chunks a rescan no longer lists, for the writers' manifests (:meth:`take_forgets`)
        self._forgets: list[str] = []

    def queue(self, delta: RescanDelta) -> None:
        for fid in delta.removed:
            self._to_add.pop(fid, None)
            self._to_remove[fid] = None
        for fid, entry in delta.added.items():
            self._to_remove.pop(fid, None)
            self._to_add[fid] = entry

    def next_slice(self) -> tuple[list[str], list[Added]] | None:
        """(chunks to remove, chunks to add), at most :data:`MERGE_SLICE` each, oldest
        first; None when nothing waits or this step had its slice. A removed chunk is
        also queued for :meth:`take_forgets`."""
        if self._sliced or not (self._to_remove or self._to_add):
            return None
        self._sliced = True
        removed = [self._to_remove.popitem(last=False)[0] for _ in range(min(MERGE_SLICE, len(self._to_remove)))]
        self._forgets += removed
        added = [self._to_add.popitem(last=False) for _ in range(min(MERGE_SLICE, len(self._to_add)))]
        return removed, added

    def new_step(self) -> None:
        """A step begins: the next slice may be handed out."""
        self._sliced = False

    def removing(self, chunk_id: str) -> bool:
        """Whether a rescan no longer lists ``chunk_id`` and its removal waits for a slice."""
        return bool(self._to_remove) and chunk_id in self._to_remove

    def drop(self, chunk_id: str) -> None:
        """Never add ``chunk_id`` from the deltas taken so far."""
        self._to_add.pop(chunk_id, None)

    def take_forgets(self) -> list[str]:
        out, self._forgets = self._forgets, []
        return out

    def pending(self) -> int:
        """Chunks queued, added or removed."""
        return len(self._to_add) + len(self._to_remove)
