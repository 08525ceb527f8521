"""Eviction policies of a slot-addressed index: which key leaves when the pool is full.

Who calls it: :class:`~vllm_kvtier.index.slot_index.SlotIndex` only, from the thread that
owns the index (vLLM's scheduler thread). Not thread-safe. Pure bookkeeping over hashable
keys (the tests use integers): no clock, no I/O, no knowledge of slots or pins. What may
not be evicted (a slot read by a transfer, a key pinned with a TTL) is the index's
business. It passes that in as the ``evictable`` predicate of :meth:`EvictionPolicy.evict`.

Two policies:

* ``lru``: least recently used.
* ``s3fifo``: S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction",
  SOSP 2023), :mod:`vllm_kvtier.index.s3fifo`. It was chosen over ARC and W-TinyLFU for
  four reasons. It is scan-resistant by construction. A key seen once only ever occupies
  the small queue, half of the pool. So a flood of one-off documents cannot push out a
  system prompt that was reused. It needs no tuning. ARC adapts a target that a long scan
  drags around. W-TinyLFU needs a count-min sketch, its width and an ageing period. Every
  operation is O(1) amortised with FIFO queues. And its "skip this one, look at the next"
  loop takes the index's pins naturally. ARC's ghost-list adaptation and TinyLFU's
  candidate-versus-victim admission duel both assume any victim can be taken.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, Protocol, TypeVar, get_args

from vllm_kvtier.keys import EvictionName

K = TypeVar("K", bound=Hashable)

#: Names accepted by ``cpu.eviction`` and :func:`make_policy`.
EVICTION_NAMES: tuple[str, ...] = get_args(EvictionName)


class EvictionPolicy(Protocol[K]):
    """The order in which keys of a full pool are given up.

    The owner tells the policy about every key it holds: :meth:`insert` once when the key
    is stored, :meth:`access` on every reuse, :meth:`discard` when it drops the key for
    another reason than eviction. :meth:`evict` picks a victim and forgets it. Every
    method is O(1) amortised except :meth:`evict`, which skips keys the predicate refuses
    (bounded by the number of keys held).
    """

    name: str

    def insert(self, key: K, parent: K | None = None) -> None:
        """``key`` was stored. It must not be held already. ``parent``: the key before it
        in its prompt, when known (policies that ignore prefix structure ignore it)."""

    def access(self, key: K) -> None:
        """``key`` was reused (a hit, or a save that found it stored). No-op if unknown."""

    def discard(self, key: K) -> None:
        """Forget ``key`` (no-op if unknown). Not an eviction: it leaves no history."""

    def evict(self, evictable: Callable[[K], bool]) -> K | None:
        """Choose a held key for which ``evictable`` is true, forget it and return it.

        None only when no held key is evictable; then nothing changed but the order of
        the keys the policy looked at."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[K]:
        """Held keys, roughly in the order they would be evicted (next victim first)."""


class LRUPolicy(Generic[K]):
    """Least recently used. :meth:`evict` scans from the oldest key past refused ones."""

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()  # oldest first

    def insert(self, key: K, parent: K | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def discard(self, key: K) -> None:
        self._order.pop(key, None)

    def evict(self, evictable: Callable[[K], bool]) -> K | None:
        victim = next((k for k in self._order if evictable(k)), None)
        if victim is not None:
            del self._order[victim]
        return victim

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._order))


def make_policy(name: str, capacity: int, *, staging: bool = False) -> EvictionPolicy:
    """A fresh policy for a pool of ``capacity`` keys; ``name`` is one of :data:`EVICTION_NAMES`.
    ``staging``: a write-back tier below takes the pool's evictions (``kvaware`` adapts)."""
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "s3fifo":
        from vllm_kvtier.index.s3fifo import S3FIFOPolicy

        return S3FIFOPolicy(capacity)
    if name == "arc":
        from vllm_kvtier.index.arc import ARCPolicy

        return ARCPolicy(capacity)
    if name == "kvaware":
        from vllm_kvtier.index.kvaware import KVAwarePolicy

        return KVAwarePolicy(capacity, staging=staging)
    raise ValueError(f"unknown eviction policy {name!r}; allowed: {', '.join(EVICTION_NAMES)}")
