"""The scheduler's index of one slot-addressed tier (the CPU pool).

Who calls it: the scheduler half of the connector, from the EngineCore thread only (not
thread-safe, by design: the scheduler is single-threaded). It never blocks and does no I/O.

The index maps :data:`BlockKey` -> slot number in ``[0, num_slots)``. Slots are chosen
here, not by the worker, so every TP rank writes its shard of a key into the same slot.

Policy: least-recently-used eviction among *unpinned* entries. A pin is a reference count
held while a transfer that reads the slot is in flight (an async load), so a slot is never
reused under a running transfer. Writes need no pin: the worker executes saves and loads
in the order the scheduler issued them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_kvtier.index.keys import BlockKey


@dataclass(frozen=True)
class Allocation:
    """Result of :meth:`SlotIndex.allocate`: the slot and the key it displaced, if any."""

    slot: int
    evicted: BlockKey | None


class SlotIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[BlockKey, int] = OrderedDict()  # LRU order: oldest first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives 0, 1, 2...
        self._pins: dict[int, int] = {}  # slot -> number of in-flight readers
        self._orphans: set[int] = set()  # slots removed from the index while pinned
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def slot(self, key: BlockKey) -> int | None:
        return self._slot_of.get(key)

    def match_prefix(self, keys: Sequence[BlockKey], start: int = 0) -> int:
        """Number of consecutive keys, from ``keys[start]``, that are present."""
        n = 0
        for k in keys[start:]:
            if k not in self._slot_of:
                break
            n += 1
        return n

    def touch(self, key: BlockKey) -> None:
        """Mark ``key`` most recently used."""
        if key in self._slot_of:
            self._slot_of.move_to_end(key)

    def pin(self, slot: int) -> None:
        """Hold ``slot`` against eviction and reuse until the matching :meth:`unpin`."""
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        n = self._pins.get(slot, 0)
        if n > 1:
            self._pins[slot] = n - 1
            return
        self._pins.pop(slot, None)
        if slot in self._orphans:
            self._orphans.discard(slot)
            self._free.append(slot)

    def is_pinned(self, slot: int) -> bool:
        return slot in self._pins

    def allocate(self, key: BlockKey) -> Allocation | None:
        """Give ``key`` a slot, evicting the least recently used unpinned key if full.

        Returns None when every slot is pinned (the caller skips the save). ``key`` must
        not be present already.
        """
        if key in self._slot_of:
            raise KeyError(f"key already present: {key!r}")
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._slot_of.items() if s not in self._pins), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            evicted = victim
            self.evictions += 1
        self._slot_of[key] = slot
        return Allocation(slot, evicted)

    def remove(self, key: BlockKey) -> bool:
        """Drop ``key`` (e.g. its block failed to load). A pinned slot returns to the free
        list only when its last reader unpins it."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return False
        if slot in self._pins:
            self._orphans.add(slot)
        else:
            self._free.append(slot)
        return True

    def items(self) -> list[tuple[BlockKey, int]]:
        """Snapshot of (key, slot), least recently used first."""
        return list(self._slot_of.items())

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)
