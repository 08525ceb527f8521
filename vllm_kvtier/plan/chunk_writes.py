"""What a chunk tier writes and deletes at its next step.

Who calls it: :class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner`, from vLLM's scheduler
thread. Pure bookkeeping: no I/O, nothing blocks. The planner decides what is admitted;
this queue only holds the pairs (CPU slot, key) until the step's jobs are cut.

* **Demotes** (write-back): blocks the CPU tier evicted, copied out before the step's saves.
* **Write-through**: blocks saved to the CPU tier, copied after the step's saves.
* **Dirty** (write-back with ``flush_interval_s``): blocks only in DRAM. One is flushed
  once it is that old, or at once when the engine is idle. At most
  :data:`FLUSH_CHUNKS_PER_STEP` chunks of them go per step.
* **Deletes**: chunk ids the workers delete at the next step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from vllm_kvtier.keys import BlockKey

#: Background flushes planned per step at most, in chunks (a bound on one step's writes).
FLUSH_CHUNKS_PER_STEP = 4

#: A block to write: (its CPU slot, its key).
SlotKey = tuple[int, BlockKey]


class WriteQueue:
    """The writes and deletes a chunk tier queued since its last step."""

    def __init__(self, *, flush_interval_s: float, chunk_blocks: int, clock: Callable[[], float]) -> None:
        """``clock``: the dirty blocks' ages (a test passes its own)."""
        self._demote: list[SlotKey] = []
        self._through: list[SlotKey] = []
        #: write-back: blocks only in DRAM, oldest save first -> (slot, saved at)
        self._dirty: OrderedDict[BlockKey, tuple[int, float]] = OrderedDict()
        self._deletes: list[str] = []
        self._flush_interval_s = flush_interval_s
        self._flush_budget = FLUSH_CHUNKS_PER_STEP * chunk_blocks
        self._clock = clock

    def demote(self, slot: int, key: BlockKey) -> None:
        self._demote.append((slot, key))

    def write_through(self, slot: int, key: BlockKey) -> None:
        self._through.append((slot, key))

    def mark_dirty(self, slot: int, key: BlockKey) -> None:
        """``key`` was saved to ``slot`` and is stored only in DRAM: flush it once due."""
        self._dirty[key] = (slot, self._clock())
        self._dirty.move_to_end(key)

    def forget_dirty(self, key: BlockKey) -> None:
        """``key`` left DRAM (evicted): no background flush of it."""
        self._dirty.pop(key, None)

    def delete(self, chunk_ids: Iterable[str]) -> None:
        self._deletes.extend(chunk_ids)

    def has_flush_work(self, *, paused: bool) -> bool:
        """Deletes to send, or dirty blocks to flush (unless writes are ``paused``)."""
        return bool(self._deletes) or (bool(self._dirty) and not paused)

    def take(self, saved_this_step: set[BlockKey],
             cpu_slot_of: Callable[[BlockKey], int | None]) -> tuple[list[SlotKey], list[SlotKey]]:
        """(demotes, write-through writes) whose slot holds their key when copied; both
        queues are emptied. A demoted key saved in this same step never reached its slot. A
        write-through key's slot may have been reused later in the step."""
        demote = [(s, k) for s, k in self._demote if k not in saved_this_step]
        through = [(s, k) for s, k in self._through if cpu_slot_of(k) == s]
        self._demote, self._through = [], []
        return demote, through

    def take_flush(self, cpu_slot_of: Callable[[BlockKey], int | None], *, idle: bool,
                   stored: Callable[[BlockKey], bool]) -> list[SlotKey]:
        """Dirty blocks due now (all of them when ``idle``), oldest first, bounded per step.

        A block no longer in its slot (evicted, or its slot reused), or ``stored`` below
        already, is forgotten."""
        due = self._clock() - self._flush_interval_s
        out: list[SlotKey] = []
        while self._dirty and len(out) < self._flush_budget:
            key, (slot, saved_at) = next(iter(self._dirty.items()))
            if not idle and saved_at > due:
                break
            del self._dirty[key]
            if cpu_slot_of(key) == slot and not stored(key):
                out.append((slot, key))
        return out

    def take_deletes(self) -> list[str]:
        out, self._deletes = self._deletes, []
        return out
