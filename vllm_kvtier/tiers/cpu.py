"""The CPU DRAM tier: a fixed pool of block slots in host memory.

Who uses it: the worker half, from the worker's main thread (saves, sync loads) and from
one background copy thread (async loads). The pool itself holds no locks: the scheduler
allocates slots so that no slot is written while a transfer reads it (see
:mod:`vllm_kvtier.index.slot_index`).

The pool is allocated once, at its full size, and never grows: ``num_slots`` rows of every
byte plane of :class:`~vllm_kvtier.transfer.layout.KVLayout`. Its size is what the
operator budgeted, rounded down to whole blocks.
"""

from __future__ import annotations

import ctypes
import logging
import zlib

import numpy as np
import torch

logger = logging.getLogger(__name__)


class CPUPool:
    def __init__(
        self, num_slots: int, plane_bytes: tuple[int, ...], *, pin: bool, prefault: bool
    ) -> None:
        self.num_slots = num_slots
        self.plane_bytes = plane_bytes
        self.slot_bytes = sum(plane_bytes)
        total = num_slots * self.slot_bytes
        # One allocation for every plane: one pinned registration on CUDA, and the budget
        # is exactly what the operator configured.
        self._buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        if prefault and total:
            self._buf.zero_()
        planes = []
        off = 0
        for pb in plane_bytes:
            planes.append(self._buf[off : off + num_slots * pb].view(num_slots, pb))
            off += num_slots * pb
        self.planes: tuple[torch.Tensor, ...] = tuple(planes)
        self.pinned = pin
        logger.info(
            "kvtier CPU pool: %d slots x %d B = %.1f MiB%s",
            num_slots, self.slot_bytes, total / 2**20, " (pinned)" if pin else "",
        )

    @property
    def buffer(self) -> torch.Tensor:
        """The one allocation behind every plane (for registering it with NIXL)."""
        return self._buf

    @property
    def nbytes(self) -> int:
        return self._buf.numel()

    def copy_slot_out(self, slot: int, out: memoryview) -> None:
        """Copy the slot's bytes (all planes, in order) into ``out`` (len == slot_bytes)."""
        self._copy(slot, out, to_slot=False)

    def copy_slot_in(self, slot: int, data: memoryview) -> None:
        """Fill the slot from ``data`` as laid out by :meth:`copy_slot_out`."""
        self._copy(slot, data, to_slot=True)

    def _copy(self, slot: int, buf: memoryview, *, to_slot: bool) -> None:
        # ctypes.memmove, not torch copy_: one small torch op per plane costs dispatch and
        # an OpenMP fork/join; with OpenMP threads spinning on few cores, ~10x slower
        # (bench/pd_ttft.py profile: 386 copy_ calls for 25 MB took 2.2 s). memmove
        # releases the GIL. The pool lives in host memory (pinned or not).
        if len(buf) != self.slot_bytes:
            raise ValueError(f"buffer of {len(buf)} B for a slot of {self.slot_bytes} B")
        arr = np.frombuffer(buf, dtype=np.uint8)  # a view, for the address (no copy)
        base = arr.ctypes.data
        off = 0
        for p in self.planes:
            pb = p.shape[1]
            row = p.data_ptr() + slot * p.stride(0)
            if to_slot:
                ctypes.memmove(row, base + off, pb)
            else:
                ctypes.memmove(base + off, row, pb)
            off += pb
        del arr  # drop the export before the caller releases ``buf``

    def checksum(self, slot: int) -> int:
        """CRC32 of the slot's bytes over all planes (CPU-side; call only when the slot
        is not being written)."""
        crc = 0
        for p in self.planes:
            crc = zlib.crc32(p[slot].numpy().data, crc)
        return crc
