"""Explicit pins on keys, each with a deadline, under a budget.

Who calls it: :class:`~vllm_kvtier.index.slot_index.SlotIndex` only, from the thread that
owns the index. Not thread-safe; pure bookkeeping: the caller passes the time in (``now``,
seconds on a monotonic clock), so tests need no sleeping.

A pinned key is never evicted until its deadline passes. Unlike a slot pin (a reference
count held while a transfer reads the slot, released by the transfer), a key pin is a
promise to the user ("keep this prefix for ttl_s"), released by time or by
:meth:`KeyPins.unpin`. The budget bounds how much of the pool such promises may hold, so
the pool always keeps room for ordinary traffic; pins beyond it are refused and counted.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from enum import Enum
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class PinOutcome(Enum):
    """What :meth:`SlotIndex.pin_key` did."""

    PINNED = "pinned"  # newly pinned
    EXTENDED = "extended"  # already pinned; the deadline is now the later of the two
    ABSENT = "absent"  # the key is not stored: nothing to pin
    REFUSED = "refused"  # the pin budget is spent (counted in ``pin_refusals``)


class KeyPins(Generic[K]):
    def __init__(self, max_pins: int) -> None:
        if max_pins < 0:
            raise ValueError(f"max_pins must be >= 0, got {max_pins}")
        self.max_pins = max_pins
        self.refusals = 0
        self._deadline: dict[K, float] = {}
        # (deadline, tie-breaker, key); entries whose deadline no longer matches
        # _deadline (extended or unpinned since) are stale and skipped.
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()

    def pin(self, key: K, deadline: float) -> PinOutcome:
        """Pin ``key`` until ``deadline``; extending an existing pin never shortens it."""
        old = self._deadline.get(key)
        if old is None and len(self._deadline) >= self.max_pins:
            self.refusals += 1
            return PinOutcome.REFUSED
        if old is not None and old >= deadline:
            return PinOutcome.EXTENDED
        self._deadline[key] = deadline
        heapq.heappush(self._heap, (deadline, next(self._seq), key))
        if len(self._heap) > 2 * len(self._deadline) + 64:
            # Repeated extensions leave stale entries behind: rebuild, O(pins).
            self._heap = [(d, next(self._seq), k) for k, d in self._deadline.items()]
            heapq.heapify(self._heap)
        return PinOutcome.EXTENDED if old is not None else PinOutcome.PINNED

    def unpin(self, key: K) -> bool:
        """Release ``key``'s pin at once. False if it was not pinned."""
        return self._deadline.pop(key, None) is not None

    def expire(self, now: float) -> list[K]:
        """Release every pin whose deadline is at or before ``now``; return their keys."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            deadline, _, key = heapq.heappop(self._heap)
            if self._deadline.get(key) == deadline:
                del self._deadline[key]
                out.append(key)
        return out

    def deadline(self, key: K) -> float | None:
        """When ``key``'s pin ends (it may have passed if :meth:`expire` was not called)."""
        return self._deadline.get(key)

    @property
    def heap_entries(self) -> int:
        """Deadline entries held, stale ones included: at most 2 x pins + 65 (memory bound)."""
        return len(self._heap)

    def __contains__(self, key: object) -> bool:
        return key in self._deadline

    def __len__(self) -> int:
        return len(self._deadline)
