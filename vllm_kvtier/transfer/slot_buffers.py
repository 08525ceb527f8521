"""Bytes between CPU pool slots and a chunk store's buffers (:class:`SlotBuffers`).

Who calls it: a :class:`~vllm_kvtier.transfer.tier_io.ChunkWorker`, from the worker's
main thread. A deferred write buffer is filled later, on the store's I/O thread. See
:mod:`vllm_kvtier.transfer.tier_io` for why most writes copy there.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_kvtier.tiers.buffers import BufferPool, WriteBuffer
from vllm_kvtier.transfer.fp8 import BlockCodec
from vllm_kvtier.transfer.slots import SlotTable


class SlotBuffers:
    """Write buffers filled from slots, and read blocks copied back into slots.

    A tier that stores blocks encoded (``codec``: FP8) encodes and decodes them here. Its
    write buffers are always filled on this thread: torch ops on an I/O thread would
    start an OpenMP team of their own beside the compute threads'."""

    def __init__(self, slots: SlotTable, codec: BlockCodec | None, buffers: BufferPool | None, *,
                 authenticated: bool) -> None:
        """``buffers``: where write buffers come from (None: the process default).
        ``authenticated``: the store signs its chunks (their headers need more room)."""
        self.slots = slots
        self.codec = codec
        self.buffers = buffers
        self.authenticated = authenticated

    def write_buffer(self, keys: tuple[bytes, ...], slots: tuple[int, ...], *, copy_now: bool) -> WriteBuffer:
        """A write buffer of ``slots``: copied now with ``copy_now`` or a codec, else
        filled on the store's I/O thread (:meth:`deferred`)."""
        if copy_now or self.codec is not None:
            return self.copied(keys, slots)
        return self.deferred(keys, slots)

    def copied(self, keys: tuple[bytes, ...], slots: tuple[int, ...]) -> WriteBuffer:
        """A write buffer holding ``slots`` copied now (on this thread)."""
        wb = self._new(keys)
        self._copy_out(wb, slots)
        return wb

    def deferred(self, keys: tuple[bytes, ...], slots: tuple[int, ...]) -> WriteBuffer:
        """A write buffer the store fills on its I/O thread, from ``slots`` as they are
        now: their generations now must be theirs after the copy, else it is dropped."""
        table = self.slots
        gens = tuple(table.generation(s) for s in slots)

        def unchanged() -> bool:
            return all(table.generation(s) == g for s, g in zip(slots, gens, strict=True))

        def fill(wb: WriteBuffer) -> bool:
            if not unchanged():
                return False
            self._copy_out(wb, slots)
            return unchanged()  # a claim during the copy: its bytes may be torn

        return self._new(keys, fill)

    def fill_slot(self, slot: int, data: memoryview) -> None:
        """Copy a read block into ``slot`` (decoded, with a codec). ValueError: wrong size."""
        pool = self.slots.pool
        if self.codec is None:
            pool.copy_slot_in(slot, data)
        else:
            self.codec.decode(data, [p[slot] for p in pool.planes])

    def _new(self, keys: tuple[bytes, ...], fill: Callable[[WriteBuffer], bool] | None = None) -> WriteBuffer:
        pool = self.slots.pool
        return WriteBuffer(list(keys), pool.slot_bytes if self.codec is None else self.codec.stored_bytes,
                           self.buffers, authenticated=self.authenticated, fill=fill)

    def _copy_out(self, wb: WriteBuffer, slots: tuple[int, ...]) -> None:
        codec, pool = self.codec, self.slots.pool
        for i, s in enumerate(slots):
            if codec is None:
                pool.copy_slot_out(s, wb.block(i))
            else:  # straight from the slot's rows into the buffer: no staging copy
                codec.encode([p[s] for p in pool.planes], wb.block(i))
