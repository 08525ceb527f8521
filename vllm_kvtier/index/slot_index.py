"""The scheduler's index of one slot-addressed tier (the CPU pool).

Who calls it: the scheduler half of the connector, from the EngineCore thread only (not
thread-safe, by design: the scheduler is single-threaded). It never blocks and does no I/O.

The index maps :data:`BlockKey` -> slot number in ``[0, num_slots)``. Slots are chosen
here, not by the worker, so every TP rank writes its shard of a key into the same slot.

Eviction: an :class:`~vllm_kvtier.index.policy.EvictionPolicy` (``kvaware``, ``s3fifo``,
``arc`` or ``lru``) picks the victim among keys that are neither slot-pinned nor
key-pinned. Two kinds of pin, kept apart:

* **slot pins** (:meth:`SlotIndex.pin` / :meth:`SlotIndex.unpin`): a reference count held
  while a transfer that reads the slot is in flight (an async load), so a slot is never
  reused under a running transfer. Writes need no pin: the worker executes saves and
  loads in the order the scheduler issued them.
* **key pins** (:meth:`SlotIndex.pin_key` / :meth:`SlotIndex.unpin_key`): "keep this
  prefix's blocks for ``ttl_s`` seconds", for prefixes the user declares hot. At most
  ``max_pinned_fraction`` of the slots may be key-pinned; further pins are refused and
  counted (``pin_refusals``). Deadlines are read from ``clock`` (monotonic seconds) and
  checked lazily, when a victim is needed or pins are queried.

**Watching** (KV events): :attr:`SlotIndex.watch`, when set, is called as ``watch(key,
True)`` when a key enters the index and ``watch(key, False)`` when it leaves (evicted,
removed), synchronously, on the caller's thread; None (the default) costs nothing.

Every method is atomic with respect to the index (one thread); none raises on a full or
pinned pool: :meth:`SlotIndex.allocate` returns None, :meth:`SlotIndex.pin_key` returns
an outcome.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from vllm_kvtier.index.key_pins import KeyPins, PinOutcome
from vllm_kvtier.index.policy import EvictionPolicy, make_policy
from vllm_kvtier.keys import BlockKey

__all__ = ["Allocation", "PinOutcome", "SlotIndex"]


@dataclass(frozen=True)
class Allocation:
    """Result of :meth:`SlotIndex.allocate`: the slot and the key it displaced, if any."""

    slot: int
    evicted: BlockKey | None


class _Slots:
    """The pool's slots: which are free, and which are read by a transfer in flight.

    A slot is pinned by a reference count while a load reads it. A slot given back while
    pinned (an orphan) becomes free only at its last unpin."""

    def __init__(self, num_slots: int) -> None:
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives 0, 1, 2...
        self._pins: dict[int, int] = {}  # slot -> number of in-flight readers
        self._orphans: set[int] = set()  # slots given back while pinned

    def take(self) -> int | None:
        """A free slot, or None if none is free."""
        return self._free.pop() if self._free else None

    def give_back(self, slot: int) -> None:
        """``slot`` holds nothing now: free at once, or at its last unpin."""
        if slot in self._pins:
            self._orphans.add(slot)
        else:
            self._free.append(slot)

    def pin(self, slot: int) -> None:
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

    def pinned(self, slot: int) -> bool:
        return slot in self._pins

    def free(self) -> int:
        """Slots free now."""
        return len(self._free)

    def busy(self) -> bool:
        """Whether a transfer reads a slot, or a slot waits for its last unpin."""
        return bool(self._pins or self._orphans)


class SlotIndex:
    def __init__(
        self,
        num_slots: int,
        *,
        eviction: str | EvictionPolicy[BlockKey] = "lru",
        max_pinned_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        staging: bool = False,
    ) -> None:
        """``eviction``: a policy name (``cpu.eviction``) or a policy object for this many
        slots. ``max_pinned_fraction``: the share of slots :meth:`pin_key` may hold.
        ``clock``: monotonic seconds, for pin deadlines (tests pass a fake one).
        ``staging``: a write-back tier below takes what this pool evicts (for the policy)."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {max_pinned_fraction}")
        self._eviction = eviction
        self._staging = staging
        self._max_pinned_fraction = max_pinned_fraction
        self._clock = clock
        self._size(num_slots)
        self.evictions = 0
        #: Called with (key, present) as keys enter and leave the index (KV events); None: off.
        self.watch: Callable[[BlockKey, bool], None] | None = None

    def _size(self, num_slots: int) -> None:
        self.num_slots = num_slots
        eviction = self._eviction
        self.policy: EvictionPolicy[BlockKey] = (
            make_policy(eviction, num_slots, staging=self._staging) if isinstance(eviction, str) else eviction
        )
        self._slot_of: dict[BlockKey, int] = {}
        self._slots = _Slots(num_slots)
        self._key_pins: KeyPins[BlockKey] = KeyPins(int(self._max_pinned_fraction * num_slots))

    def resize(self, num_slots: int) -> None:
        """Size the index for a pool of ``num_slots`` slots. Only while it holds nothing
        (the scheduler learns the workers' pool size at start-up, before any request).
        Raises ValueError when a slot is in use, or when the policy was given as an object."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if self._slot_of or self._slots.busy() or self._slots.free() != self.num_slots:
            raise ValueError("resize of a SlotIndex in use")
        if not isinstance(self._eviction, str):
            raise ValueError("resize of a SlotIndex with a policy object (built for its old size)")
        self._size(num_slots)

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
        """Record a reuse of ``key`` (a hit, or a save that found it stored).

        LRU makes it the most recently used. S3-FIFO raises its reuse counter."""
        if key in self._slot_of:
            self.policy.access(key)

    def note_below(self, keys: Iterable[BlockKey]) -> None:
        """A lower tier now stores ``keys`` durably (a write confirmed by every rank).
        The ``kvaware`` policy drops a held key's extra lifetime: losing it costs a read.
        Other policies ignore it. O(log n) per held key."""
        note = getattr(self.policy, "note_below", None)
        if note is None:
            return
        for k in keys:
            if k in self._slot_of:
                note(k)

    # ---- slot pins (in-flight transfers) -----------------------------------------------

    def pin(self, slot: int) -> None:
        """Hold ``slot`` against eviction and reuse until the matching :meth:`unpin`."""
        self._slots.pin(slot)

    def unpin(self, slot: int) -> None:
        self._slots.unpin(slot)

    def is_pinned(self, slot: int) -> bool:
        return self._slots.pinned(slot)

    # ---- key pins (hot prefixes, with a TTL) -------------------------------------------

    def pin_key(self, key: BlockKey, ttl_s: float) -> PinOutcome:
        """Keep ``key`` stored for ``ttl_s`` more seconds (never evicted meanwhile).

        Pinning a pinned key extends its deadline (never shortens it) and costs no budget.
        A key not stored is :attr:`PinOutcome.ABSENT` (pin a prefix after its blocks were
        saved); beyond the budget, :attr:`PinOutcome.REFUSED`. ``ttl_s`` must be a finite
        number > 0 (ValueError otherwise: the caller validates user input at its edge).
        """
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError(f"ttl_s must be a finite number > 0, got {ttl_s}")
        now = self._clock()
        self._key_pins.expire(now)
        if key not in self._slot_of:
            return PinOutcome.ABSENT
        outcome = self._key_pins.pin(key, now + ttl_s)
        note_pin = getattr(self.policy, "note_pin", None)
        if note_pin is not None and outcome is not PinOutcome.REFUSED:
            note_pin(key)  # a request declared it hot (kvaware counts it as a reuse)
        return outcome

    def unpin_key(self, key: BlockKey) -> bool:
        """Release ``key``'s pin now (it stays stored, under the eviction policy again)."""
        return self._key_pins.unpin(key)

    def key_pinned(self, key: BlockKey) -> bool:
        """Whether ``key`` holds an unexpired key pin."""
        self._key_pins.expire(self._clock())
        return key in self._key_pins

    def pin_deadline(self, key: BlockKey) -> float | None:
        """When ``key``'s key pin lapses (the index's clock), or None if it holds none."""
        self._key_pins.expire(self._clock())
        return self._key_pins.deadline(key)

    @property
    def pinned_keys(self) -> int:
        """Keys holding an unexpired key pin."""
        self._key_pins.expire(self._clock())
        return len(self._key_pins)

    @property
    def max_pinned_keys(self) -> int:
        return self._key_pins.max_pins

    @property
    def pin_refusals(self) -> int:
        """Key pins refused because the budget was spent (monotonic)."""
        return self._key_pins.refusals

    # ---- allocation ----------------------------------------------------------------------

    def _evictable(self, key: BlockKey) -> bool:
        return not self._slots.pinned(self._slot_of[key]) and key not in self._key_pins

    def allocate(self, key: BlockKey, parent: BlockKey | None = None) -> Allocation | None:
        """Give ``key`` a slot, evicting the policy's choice among unpinned keys if full.

        ``parent``: the key of the block before it in its prompt. It is None for a first
        block or when not known. The ``kvaware`` policy keeps parents over children.
        Returns None when every slot is pinned (the caller skips the save). ``key`` must
        not be present already.
        """
        if key in self._slot_of:
            raise KeyError(f"key already present: {key!r}")
        evicted = None
        slot = self._slots.take()
        if slot is None:
            if self._key_pins:
                self._key_pins.expire(self._clock())
            victim = self.policy.evict(self._evictable)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            evicted = victim
            self.evictions += 1
        self._slot_of[key] = slot
        self.policy.insert(key, parent)
        if self.watch is not None:
            if evicted is not None:
                self.watch(evicted, False)
            self.watch(key, True)
        return Allocation(slot, evicted)

    def remove(self, key: BlockKey) -> bool:
        """Drop ``key`` and its key pin (e.g. its block failed to load). A slot-pinned slot
        returns to the free list only when its last reader unpins it."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return False
        self.policy.discard(key)
        self._key_pins.unpin(key)
        if self.watch is not None:
            self.watch(key, False)
        self._slots.give_back(slot)
        return True

    def items(self) -> list[tuple[BlockKey, int]]:
        """Snapshot of (key, slot), in the policy's eviction order (next victim first;
        for LRU: least recently used first)."""
        return [(k, self._slot_of[k]) for k in self.policy]

    @property
    def eviction(self) -> str:
        """The eviction policy's name (``lru``, ``s3fifo``)."""
        return self.policy.name

    @property
    def used_slots(self) -> int:
        return self.num_slots - self._slots.free()
