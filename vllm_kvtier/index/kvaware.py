"""KV-aware eviction: prefix structure, reuse history and age, in one deadline per block.

Same contract as :class:`~vllm_kvtier.index.policy.EvictionPolicy` (one owner thread,
pure bookkeeping), plus the parent of each key at :meth:`KVAwarePolicy.insert`. The clock
counts the policy's operations (inserts and reuses), so it measures traffic, not time.

* **Age.** Each block has a deadline: the clock at its last use plus the pool's size.
  The block with the earliest deadline leaves. With nothing else, this is LRU.
* **Reuse history.** A block reused by another request, or stored again while its name
  is in the **history** (names of evicted blocks, no data), has shown reuse. Its
  deadline gets :data:`PROTECT_OPS` more operations. Chat turns come back thousands of
  blocks later, long after a small pool has cycled. A burst ages out: the extra time
  is counted from the last use.
* **Two feedback loops**, ARC-like, each one number. One is how far back the history
  counts (its window). It grows when a block it protected is hit. It shrinks when one
  leaves unused. A conversation that came back is a good bet; a document read once more
  is not. The other is a new block's lifetime (a share of the pool). It grows when a
  block evicted unused comes back. It shrinks when a reused one does. So one-off tails
  leave sooner.
* **Prefix structure.** A block without its parent never hits. A child's deadline is
  capped by its parent's, and ties go to the deeper block. So a chain leaves from its
  tail, and a parent only after its children (unless a child is pinned). A block stored
  while its parent is gone has the earliest deadline.
* **Request hints.** A key pinned with a TTL (``kvtier_pin_ttl_s``) counts as reused:
  the index calls :meth:`KVAwarePolicy.note_pin` when it pins it.
* **The tier below.** :meth:`KVAwarePolicy.note_below` marks a block that a lower tier
  also stores (the scheduler calls it when a chunk is confirmed on every rank). Dropping
  it from DRAM loses only a copy: it loses its extra time, not its place in time.
  Over a write-back tier (``staging``), DRAM is where new blocks wait to be written. The
  NVMe tier writes a block seen once only if it is still in DRAM when the background
  flush comes. Protecting reused blocks there shortens that wait. On Mooncake's trace
  (1k DRAM over 30k NVMe) it cut the hierarchy's share from 0.30 to 0.21. So over such a
  tier nothing gets extra time: LRU, with the prefix order.

Costs: a heap of (deadline, -depth) with lazy deletion, so every operation is O(log n)
amortised. State per block: deadline, depth, level, parent. The history holds at most
:data:`HISTORY_FACTOR` names per slot.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

#: Extra lifetime of a block that has shown reuse, in policy operations (about 15k
#: blocks of traffic). The median gap between two turns of a conversation in Mooncake's
#: conversation trace is 7.6k blocks; 20k to 80k served within 0.5 points of each other
#: on that trace and on a document-QA trace (docs/planning.md).
PROTECT_OPS = 32768
#: History names kept per slot of the pool.
HISTORY_FACTOR = 8
#: Bounds and step of the adaptation of a new block's lifetime (share of the pool).
MIN_NEW_SHARE = 1 / 16
ADAPT_STEP = 1.01
#: Adaptation of the history's window (in pools of evictions).
MIN_WINDOW = 0.5
WINDOW_STEP = 1.05
#: Saturation of the per-block reuse count.
MAX_LEVEL = 255


class _Entry:
    __slots__ = ("below", "deadline", "depth", "level", "parent", "trial", "used")

    def __init__(self, depth: int, level: int, parent: object) -> None:
        self.deadline = 0
        #: the clock at its last use
        self.used = 0
        self.depth = depth
        self.level = level
        self.parent = parent
        self.below = False
        #: protected on the history's word only, not hit since: a trial of the history
        self.trial = False


class _History(Generic[K]):
    """Names of evicted keys (no data), and how far back a name still counts (its window).

    The window is in pools of evictions. It adapts like ARC's target: it grows when a block
    protected on its word is hit, and shrinks when one leaves unused."""

    def __init__(self, capacity: int, history_factor: float) -> None:
        self.pool = capacity
        self.capacity = int(capacity * history_factor)
        self._names: OrderedDict[K, tuple[int, int]] = OrderedDict()  # name -> (level, eviction number)
        self.evictions = 0
        self.max_window = history_factor
        #: how far back (evictions, in pools) a name still counts (adapts)
        self.window = history_factor / 2

    def recall(self, key: K) -> int:
        """The level ``key`` had when it left, if it left within the window; else -1.
        Forgets the name."""
        old = self._names.pop(key, None)
        if old is not None and self.evictions - old[1] <= self.window * self.pool:
            return old[0]
        return -1

    def remember(self, key: K, level: int, trial: bool) -> None:
        """``key`` was evicted at ``level``. ``trial``: it was protected on the history's word
        and never hit: trust only more recent history."""
        self.evictions += 1
        if trial:
            self.window = max(MIN_WINDOW, self.window / WINDOW_STEP)
        if self.capacity:
            self._names[key] = (level, self.evictions)
            if len(self._names) > self.capacity:
                self._names.popitem(last=False)

    def trusted(self) -> None:
        """A block protected on the history's word was hit: trust it further back."""
        self.window = min(self.max_window, self.window * WINDOW_STEP)


class KVAwarePolicy(Generic[K]):
    name = "kvaware"

    def __init__(self, capacity: int, *, protect_ops: int = PROTECT_OPS, history_factor: float = HISTORY_FACTOR,
                 staging: bool = False) -> None:
        """``capacity``: keys the pool holds. ``protect_ops``: extra lifetime of a reused
        block. ``history_factor``: names of evicted keys kept per slot. ``staging``: a
        write-back tier below takes what DRAM evicts (module doc)."""
        if capacity < 0 or protect_ops < 0 or history_factor < 0:
            raise ValueError(f"bad kvaware parameters: {capacity=}, {protect_ops=}, {history_factor=}")
        self.capacity = capacity
        self.staging = staging
        self.protect_ops = 0 if staging else protect_ops
        self.min_new_share = 1.0 if staging else MIN_NEW_SHARE
        self.clock = 0
        #: lifetime of a block with no reuse yet, as a share of the pool (adapts)
        self.new_share = 1.0
        self._held: dict[K, _Entry] = {}
        self._heap: list[tuple[int, int, int, K]] = []  # (deadline, -depth, tiebreak, key)
        self._history: _History[K] = _History(capacity, history_factor)

    def _schedule(self, key: K, e: _Entry) -> None:
        self.clock += 1
        e.used = self.clock
        if e.level:
            deadline = self.clock + self.capacity + (0 if e.below else self.protect_ops)
        else:
            deadline = self.clock + int(self.capacity * self.new_share)
        self._push(key, e, deadline)

    def _push(self, key: K, e: _Entry, deadline: int) -> None:
        if e.parent is not None:
            p = self._held.get(e.parent)  # type: ignore[arg-type]
            deadline = e.used if p is None else min(deadline, p.deadline)
        e.deadline = deadline
        heapq.heappush(self._heap, (deadline, -e.depth, e.used, key))
        if len(self._heap) > 2 * len(self._held) + 64:  # drop stale entries
            self._heap = [(x.deadline, -x.depth, 0, k) for k, x in self._held.items()]
            heapq.heapify(self._heap)

    def insert(self, key: K, parent: K | None = None) -> None:
        p = self._held.get(parent) if parent is not None else None
        level = self._history.recall(key) + 1
        trial = level > 0
        if level == 1:  # a new block was evicted too early: give new blocks more time
            self.new_share = min(1.0, self.new_share * ADAPT_STEP)
        elif level > 1:  # a reused block was: give new blocks less
            self.new_share = max(self.min_new_share, self.new_share / ADAPT_STEP)
        e = _Entry(p.depth + 1 if p is not None else 0, level, parent)
        e.trial = trial
        self._held[key] = e
        self._schedule(key, e)

    def access(self, key: K) -> None:
        e = self._held.get(key)
        if e is not None:
            if e.trial:  # the history was right to protect it: trust it further back
                e.trial = False
                self._history.trusted()
            e.level = min(e.level + 1, MAX_LEVEL)
            self._schedule(key, e)

    def note_pin(self, key: K) -> None:
        """A request pinned ``key`` with a TTL: it declared it hot, a reuse."""
        self.access(key)

    def note_below(self, key: K) -> None:
        """A lower tier stores ``key`` too: dropping it from DRAM costs only a read."""
        e = self._held.get(key)
        if e is not None and not e.below:
            e.below = True
            if e.level:  # not a use: it keeps its last use, and loses its extra time
                self._push(key, e, e.used + self.capacity)

    def discard(self, key: K) -> None:
        self._held.pop(key, None)

    def evict(self, evictable: Callable[[K], bool]) -> K | None:
        refused = []
        victim = None
        while self._heap:
            item = heapq.heappop(self._heap)
            e = self._held.get(item[3])
            if e is None or e.deadline != item[0] or -e.depth != item[1]:
                continue  # stale: the key left or was rescheduled
            if not evictable(item[3]):
                refused.append(item)
                continue
            victim = item[3]
            break
        for item in refused:
            heapq.heappush(self._heap, item)
        if victim is None:
            return None
        e = self._held.pop(victim)
        self._history.remember(victim, e.level, e.trial)
        return victim

    @property
    def window(self) -> float:
        """How far back the history counts, in pools of evictions (adapts)."""
        return self._history.window

    def level(self, key: K) -> int | None:
        """How often a held key showed reuse (for tests and tools); None if not held."""
        e = self._held.get(key)
        return None if e is None else e.level

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[K]:
        return iter(sorted(self._held, key=lambda k: (self._held[k].deadline, -self._held[k].depth)))
