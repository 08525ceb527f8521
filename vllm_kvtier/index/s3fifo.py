"""S3-FIFO eviction (Yang et al., SOSP 2023): a scan-resistant policy from three FIFOs.

Same contract as :class:`~vllm_kvtier.index.policy.EvictionPolicy` (one owner thread,
pure bookkeeping). How it works, and why it suits a KV-block pool:

* New keys enter the **small** queue (half of the pool, :data:`DEFAULT_SMALL_FRACTION`).
  When the pool is full and the small queue holds at least its share, the victim comes
  from there. Its oldest key leaves if it was not reused since it entered; its name goes
  to the **ghost** queue. If it was reused, it moves to the main queue. A one-off
  document's blocks are never reused, so they only ever cycle through the small queue.
* The **main** queue (the other half) is a CLOCK with a 2-bit counter: its oldest key is
  evicted if its counter is 0, else the counter drops by one and the key goes back to
  the tail. A system prompt reused by many requests keeps a high counter and stays.
* The **ghost** queue remembers as many evicted names as the main queue holds (no data).
  A key stored again while its name is there was evicted too early: it enters main.

Keys the ``evictable`` predicate refuses (pinned) are skipped: in the small queue they go
back to its tail, in the main queue they are reinserted like a reused key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

#: The small queue's share of the pool. The paper's 10% lets a new block go after a tenth
#: of the pool's worth of insertions unless reused by then; in conversation traffic a turn's
#: blocks come back with the next turn, later than that (Mooncake's conversation trace:
#: median reuse distance 8.6k blocks), so at 10k-30k blocks S3-FIFO fell 0.8-1.4 points of
#: prompt tokens below LRU on the first half of that trace. Half the pool keeps it within
#: 0.3 points of LRU at every size from 300 to 50k blocks and 0.6-2.7 points above it up
#: to 5k, and keeps its scan resistance (bench/trace_replay.py's workload replayed with
#: ``kvtier plan --trace``: within 0.5 points of 10%, 7-8 above LRU). docs/planning.md.
DEFAULT_SMALL_FRACTION = 0.5


class S3FIFOPolicy(Generic[K]):
    name = "s3fifo"

    def __init__(self, capacity: int, *, small_fraction: float = DEFAULT_SMALL_FRACTION, max_freq: int = 3) -> None:
        """``capacity``: keys the pool holds. ``small_fraction``: the small queue's share
        (0.1 in the paper; :data:`DEFAULT_SMALL_FRACTION` says why ours is 0.5)."""
        if capacity < 0 or not 0.0 < small_fraction < 1.0 or max_freq < 1:
            raise ValueError(f"bad S3-FIFO parameters: {capacity=}, {small_fraction=}, {max_freq=}")
        self.capacity = capacity
        self.small_target = max(1, round(capacity * small_fraction)) if capacity else 0
        self.ghost_capacity = max(1, capacity - self.small_target)
        self.max_freq = max_freq
        # key -> reuse counter, oldest first.
        self._small: OrderedDict[K, int] = OrderedDict()
        self._main: OrderedDict[K, int] = OrderedDict()
        self._ghost: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K, parent: K | None = None) -> None:
        if key in self._ghost:  # evicted from the small queue too early: straight to main
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0

    def access(self, key: K) -> None:
        for q in (self._small, self._main):
            f = q.get(key)
            if f is not None:
                q[key] = min(f + 1, self.max_freq)
                return

    def discard(self, key: K) -> None:
        if self._small.pop(key, None) is None:
            self._main.pop(key, None)

    def evict(self, evictable: Callable[[K], bool]) -> K | None:
        if len(self._small) >= self.small_target or not self._main:
            victim = self._evict_small(evictable)
            if victim is not None:
                return victim
        victim = self._evict_main(evictable)
        if victim is not None:
            return victim
        return self._evict_any(evictable)

    def _evict_small(self, evictable: Callable[[K], bool]) -> K | None:
        for _ in range(len(self._small)):
            key, freq = self._small.popitem(last=False)
            if freq > 0:
                self._main[key] = 0  # reused while on probation: promoted, bits cleared
            elif not evictable(key):
                self._small[key] = 0
            else:
                self._ghost[key] = None
                if len(self._ghost) > self.ghost_capacity:
                    self._ghost.popitem(last=False)
                return key
        return None

    def _evict_main(self, evictable: Callable[[K], bool]) -> K | None:
        # Every counter is at most max_freq, so max_freq + 1 rounds reach every evictable key.
        for _ in range(len(self._main) * (self.max_freq + 1)):
            key, freq = self._main.popitem(last=False)
            if freq > 0:
                self._main[key] = freq - 1
            elif not evictable(key):
                self._main[key] = 0
            else:
                return key
        return None

    def _evict_any(self, evictable: Callable[[K], bool]) -> K | None:
        """Last resort when the queues' preferred victims are all pinned."""
        for q in (self._small, self._main):
            key = next((k for k in q if evictable(k)), None)
            if key is not None:
                del q[key]
                return key
        return None

    def in_main(self, key: K) -> bool:
        """Whether ``key`` has earned a place in the main queue (for tests and tools)."""
        return key in self._main

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __iter__(self) -> Iterator[K]:
        return iter([*self._small, *self._main])
