"""ARC eviction (Megiddo and Modha, FAST 2003): recency and frequency, self-tuning.

Same contract as :class:`~vllm_kvtier.index.policy.EvictionPolicy`. Here as the peers'
best general-purpose option (LMCache and vLLM's native offloading ship it), so that
``kvtier plan --trace`` compares against it; the engine can run it too.

* ``T1`` holds keys seen once recently, ``T2`` keys seen at least twice. Both are LRU.
* ``B1`` and ``B2`` remember the names evicted from each (no data).
* A miss found in ``B1`` means recency needed room: the target size ``p`` of ``T1``
  grows. Found in ``B2``: frequency needed room, ``p`` shrinks.
* The victim comes from ``T1`` when it holds more than ``p`` keys, else from ``T2``.

Keys the ``evictable`` predicate refuses are skipped in LRU order; when every key of the
preferred list is refused, the other list gives the victim. O(1) amortised per operation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class ARCPolicy(Generic[K]):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.p = 0.0
        self._t1: OrderedDict[K, None] = OrderedDict()  # oldest first
        self._t2: OrderedDict[K, None] = OrderedDict()
        self._b1: OrderedDict[K, None] = OrderedDict()
        self._b2: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K, parent: K | None = None) -> None:
        c = self.capacity
        if key in self._b1:
            self.p = min(float(c), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        # the directory (lists and ghosts) holds at most 2c names, T1 + B1 at most c
        while len(self._t1) + len(self._b1) > c and self._b1:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c and self._b2:
            self._b2.popitem(last=False)

    def access(self, key: K) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def discard(self, key: K) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            self._t2.pop(key, None)

    def evict(self, evictable: Callable[[K], bool]) -> K | None:
        first_t1 = bool(self._t1) and (len(self._t1) > self.p or not self._t2)
        order = ((self._t1, self._b1), (self._t2, self._b2))
        for live, ghost in order if first_t1 else order[::-1]:
            key = next((k for k in live if evictable(k)), None)
            if key is not None:
                del live[key]
                ghost[key] = None
                return key
        return None

    def in_t2(self, key: K) -> bool:
        """Whether ``key`` was seen at least twice (for tests and tools)."""
        return key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[K]:
        return iter([*self._t1, *self._t2])
