"""A store as a kernel and a medium (:class:`KernelStore`): what every medium's store is.

A store holds its :class:`~vllm_kvtier.tiers.kernel.StoreKernel` and its medium; it does not
inherit the kernel's state. The contract's methods go to the kernel, unchanged. A store adds
what its medium can do beyond the contract (a scan, a manifest, an ``exists``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from vllm_kvtier.chunkformat import ChunkHeader
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.auth import ChunkAuth
from vllm_kvtier.tiers.base import IOResult
from vllm_kvtier.tiers.buffers import BufferPool, WriteBuffer
from vllm_kvtier.tiers.kernel.engine import StoreKernel
from vllm_kvtier.tiers.kernel.jobs import KernelStats
from vllm_kvtier.tiers.medium import Medium

__all__ = ["KernelStore"]

M = TypeVar("M", bound=Medium)


class KernelStore(Generic[M]):
    """A :class:`~vllm_kvtier.tiers.base.ChunkStore` that is ``kernel`` over ``medium``.

    Every method is the kernel's: see :class:`~vllm_kvtier.tiers.base.ChunkStore` for who
    calls it and what it promises. A subclass builds its medium, then its kernel, and
    calls this constructor; it overrides a method only to add to the kernel's."""

    def __init__(self, medium: M, kernel: StoreKernel) -> None:
        #: the byte primitives (public for tools and tests that wrap or inspect the medium)
        self.medium = medium
        self.kernel = kernel

    # ---- what the kernel was built with ----------------------------------------------------

    @property
    def namespace(self) -> str:
        return self.kernel.namespace

    @property
    def rank(self) -> int:
        """The store rank (stamped into every header, required of every header read)."""
        return self.kernel.rank

    @property
    def block_bytes(self) -> int:
        return self.kernel.block_bytes

    @property
    def max_chunk_blocks(self) -> int:
        return self.kernel.max_chunk_blocks

    @property
    def read_deadline_s(self) -> float:
        return self.kernel.read_deadline_s

    @property
    def buffers(self) -> BufferPool:
        return self.kernel.buffers

    @property
    def auth(self) -> ChunkAuth | None:
        return self.kernel.auth

    @property
    def authenticated(self) -> bool:
        """Chunks are signed (write buffers need :class:`WriteBuffer`'s ``authenticated``)."""
        return self.kernel.authenticated

    # ---- the contract ----------------------------------------------------------------------

    def submit_write(self, job_id: int, chunk_id: str, wb: WriteBuffer) -> bool:
        return self.kernel.submit_write(job_id, chunk_id, wb)

    def submit_read(self, job_id: int, chunk_id: str, header: ChunkHeader | None, positions: Sequence[int],
                    keys: Sequence[bytes]) -> None:
        self.kernel.submit_read(job_id, chunk_id, header, positions, keys)

    def submit_delete(self, chunk_id: str) -> None:
        self.kernel.submit_delete(chunk_id)

    def poll(self) -> list[IOResult]:
        return self.kernel.poll()

    def wait(self, timeout_s: float) -> bool:
        return self.kernel.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        self.kernel.close(timeout_s)

    def op_stats(self) -> KernelStats:
        """Operations and failures so far (any thread)."""
        return self.kernel.op_stats()

    def refuses(self, chunk_id: str, h: ChunkHeader) -> FailureReason | None:
        """See :meth:`~vllm_kvtier.tiers.kernel.StoreKernel.refuses`."""
        return self.kernel.refuses(chunk_id, h)
