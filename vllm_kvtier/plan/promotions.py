"""Promotions: CPU slots being filled from a lower tier (or a P/D peer) right now.

Who calls it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner` (loads) and
:class:`~vllm_kvtier.plan.prefetch.Prefetcher` (prefetches), from vLLM's scheduler thread
only. This is the one owner of "which keys are being filled". A key promoted here has a
pinned CPU slot whose bytes are not there yet. So it must not be read from the CPU tier (a
lookup stops at it), nor promoted a second time. It leaves when its read ends
(:meth:`end`) or is undone (:meth:`undo`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.plan.chunk_plan import ChunkPlanner


class Promotions:
    def __init__(self, index: SlotIndex, lower: Sequence[ChunkPlanner]) -> None:
        self.index = index
        self.lower = lower
        self._filling: set[BlockKey] = set()

    def __contains__(self, key: object) -> bool:
        return key in self._filling

    def __len__(self) -> int:
        return len(self._filling)

    def begin(self, key: BlockKey, parent: BlockKey | None = None) -> int | None:
        """A pinned CPU slot for ``key``, about to be read from below; None if every slot
        is pinned. A key evicted for it is offered to the lower tiers (demotion).
        ``parent``: the block before it in its prompt, when known (for the eviction policy)."""
        alloc = self.index.allocate(key, parent)
        if alloc is None:
            return None
        if alloc.evicted is not None:
            self.on_cpu_evict(alloc.slot, alloc.evicted)
        self.index.pin(alloc.slot)
        self._filling.add(key)
        return alloc.slot

    def end(self, keys: Iterable[BlockKey]) -> None:
        """The reads of ``keys`` ended (done or failed; the caller unpins their slots)."""
        self._filling.difference_update(keys)

    def undo(self, key: BlockKey, slot: int) -> None:
        """Give back the slot :meth:`begin` took for ``key`` (nothing was read into it)."""
        self.index.unpin(slot)
        self.index.remove(key)
        self._filling.discard(key)

    def on_cpu_evict(self, slot: int, key: BlockKey) -> None:
        """The CPU tier evicted ``key`` from ``slot``: each lower tier may demote it."""
        for tier in self.lower:
            tier.on_cpu_evict(slot, key)
