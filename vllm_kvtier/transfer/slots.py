"""The CPU pool's slots as the worker's data path sees them.

Who uses it: the worker's :class:`~vllm_kvtier.transfer.datapath.DataPath` holds one per
rank (made with the pool). It is handed once to each tier driver
(:class:`~vllm_kvtier.transfer.tier_io.ChunkWorker`) and to the P/D peer link. All calls
come from the worker's main thread, but reads of a key and a generation (below). Nothing
here blocks except :meth:`SlotTable.wait`. It waits for a device copy still using a slot
(CUDA, or a save on the host copy thread).

Per slot it keeps four things. First, which key the slot holds *completely* (None: nothing
valid, e.g. a save that failed or a read in progress). Second, a generation. It changes
whenever its key does or its bytes are about to (:meth:`SlotTable.claim`). Third, the
last device copy that reads or writes it. Fourth, the CRC32 of its bytes when
``cpu.checksum`` is on.

The one reader on another thread: a lower-tier write copies a slot out on the store's I/O
thread (:class:`~vllm_kvtier.transfer.tier_io.ChunkWorker`). It keeps the copy only if the
slot's generation is the same after the copy as when the write was queued. That is sound
because every writer of a slot's bytes claims the slot on this thread *before* the bytes
start to change. Such writers are a save, a lower-tier read landing, a P/D peer read. A
copy that overlapped such a write sees the new generation once it ends. The scheduler
decides what goes in which slot; this table records what really happened. So a tier
driver can refuse to write a slot whose save failed. And a load can refuse a slot that no
longer holds its key.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Protocol

from vllm_kvtier.tiers.cpu import CPUPool


class _Transfer(Protocol):
    def done(self) -> bool: ...
    def wait(self) -> None: ...


class _Stamps(Protocol):
    """Who else must know a slot's key (the NIXL peer link publishes it to readers)."""

    def stamp(self, slot: int, key: bytes | None) -> None: ...


class SlotTable:
    def __init__(self, pool: CPUPool) -> None:
        self.pool = pool
        self._key: list[bytes | None] = [None] * pool.num_slots
        self._gen: list[int] = [0] * pool.num_slots
        self._crc: list[int] = [0] * pool.num_slots
        #: slot -> the last device copy that uses it (only while it may still run)
        self._busy: dict[int, _Transfer] = {}
        self._stamps: _Stamps | None = None

    def stamp_with(self, stamps: _Stamps) -> None:
        """Tell ``stamps`` of every key change from now on (the P/D peer link)."""
        self._stamps = stamps

    # ---- keys ---------------------------------------------------------------------

    def key(self, slot: int) -> bytes | None:
        return self._key[slot]

    def holds(self, slot: int, key: bytes) -> bool:
        """Whether ``slot`` holds all of ``key``'s bytes."""
        return self._key[slot] == key

    def set_key(self, slot: int, key: bytes | None,
                stamp: Literal["now", "later", "unchanged"] = "now") -> None:
        """``slot`` now holds ``key`` (None: nothing valid).

        ``stamp`` "now": tell the stamp listener now. "later": the bytes may still be in
        flight (a CUDA save). So it hears None now, and the key from :meth:`stamp` once they
        landed. "unchanged": it already knows (the peer link itself filled the slot)."""
        self._key[slot] = key
        self._gen[slot] += 1
        if self._stamps is not None and stamp != "unchanged":
            self._stamps.stamp(slot, key if stamp == "now" else None)

    def claim(self, slots: Iterable[int]) -> None:
        """The bytes of ``slots`` are about to be rewritten (a save, a read landing in them).

        They hold nothing valid until the writer sets their key (or :meth:`stamp`s) after
        the copy. Call it BEFORE the first byte changes. The stamp listener hears None
        first. So a peer reading a slot never takes bytes being rewritten for its old key.
        And a copy out of them still running on another thread sees that it must be
        dropped."""
        for s in slots:
            self.set_key(s, None)

    def generation(self, slot: int) -> int:
        """Changes whenever ``slot``'s key changes or it is claimed (any thread may read it)."""
        return self._gen[slot]

    def stamp(self, slot: int) -> None:
        """The bytes of ``slot``'s key are complete now: tell the stamp listener."""
        if self._stamps is not None:
            self._stamps.stamp(slot, self._key[slot])

    # ---- device copies ----------------------------------------------------------------

    def mark_busy(self, slots: Iterable[int], transfer: _Transfer) -> None:
        """A device copy that reads or writes ``slots`` was submitted (host copies are done)."""
        if not transfer.done():
            for s in slots:
                self._busy[s] = transfer

    def wait(self, slot: int) -> None:
        """Before the host reads or writes ``slot``: wait for a device copy still using it."""
        t = self._busy.pop(slot, None)
        if t is not None:
            t.wait()

    # ---- checksums (cpu.checksum) -----------------------------------------------------

    def record_crc(self, slot: int) -> None:
        self._crc[slot] = self.pool.checksum(slot)

    def crc_matches(self, slot: int) -> bool:
        return self.pool.checksum(slot) == self._crc[slot]
