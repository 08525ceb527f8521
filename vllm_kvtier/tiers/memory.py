"""The reference :class:`~vllm_kvtier.tiers.base.ChunkStore`: chunks in a dict, in process
memory, through the same :class:`~vllm_kvtier.tiers.kernel.StoreKernel` as every medium.

It is what the contract means, with the plainest possible medium. It is also the fake
that higher layers test against. A test can read, damage or forge the stored bytes of a
chunk (:meth:`MemoryStore.raw`, :meth:`MemoryStore.forge`). Every read still goes through
the kernel's verified path (bounded sizes, keys, CRC32s).
"""

from __future__ import annotations

import threading

from vllm_kvtier.chunkformat import ChunkFormatError
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.auth import ChunkAuth
from vllm_kvtier.tiers.buffers import BufferPool, shared_pool
from vllm_kvtier.tiers.kernel import KernelSettings, KernelStore, ReadShape, StoreKernel

__all__ = ["MemoryMedium", "MemoryStore"]


class MemoryMedium:
    """Chunk id -> bytearray. ``put`` replaces the entry in one step (atomic for readers)."""

    name = "memory"
    read_shape: ReadShape = "span"

    def __init__(self) -> None:
        self.objects: dict[str, bytearray] = {}
        self._lock = threading.Lock()

    def put(self, chunk_id: str, view: memoryview, deadline: float) -> None:
        data = bytearray(view)
        with self._lock:
            self.objects[chunk_id] = data

    def read_into(self, chunk_id: str, offset: int, dst: memoryview, deadline: float) -> None:
        with self._lock:
            data = self.objects.get(chunk_id)
        if data is None:
            raise KeyError(chunk_id)
        end = offset + dst.nbytes
        if end > len(data):
            raise ChunkFormatError(f"truncated: {len(data)} of {end} bytes", FailureReason.TRUNCATED)
        dst[:] = memoryview(data)[offset:end]

    def delete(self, chunk_id: str) -> None:
        with self._lock:
            self.objects.pop(chunk_id, None)

    def classify(self, exc: BaseException) -> FailureReason:
        return FailureReason.MISSING if isinstance(exc, KeyError) else FailureReason.ERROR

    def close(self) -> None:
        pass


class MemoryStore(KernelStore[MemoryMedium]):
    """Chunks in process memory. Same contract, threads and failure rules as every store."""

    def __init__(self, namespace: str, block_bytes: int, *, max_chunk_blocks: int = 16,
                 buffers: BufferPool | None = None, auth: ChunkAuth | None = None, rank: int = 0) -> None:
        """``rank``: the store rank (a dict has no path: each store is one rank's place)."""
        settings = KernelSettings(namespace, rank, block_bytes, max_chunk_blocks, read_deadline_s=5.0)
        medium = MemoryMedium()
        super().__init__(medium, StoreKernel(medium, settings, buffers=buffers or shared_pool(), auth=auth))

    def raw(self, chunk_id: str) -> bytearray | None:
        """The stored bytes of ``chunk_id`` themselves, not a copy: for fault drills (flip a
        byte, then a read must fail). None if absent."""
        return self.medium.objects.get(chunk_id)

    def forge(self, chunk_id: str, data: bytes) -> None:
        """Store ``data`` as ``chunk_id`` bypassing the kernel (no header stamped): what a
        foreign or malicious writer could leave in a shared medium."""
        self.medium.objects[chunk_id] = bytearray(data)

    def chunk_ids(self) -> list[str]:
        """What is stored now (any order)."""
        return list(self.medium.objects)
