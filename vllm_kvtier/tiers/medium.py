"""What a medium implements for the store kernel (:mod:`vllm_kvtier.tiers.kernel`).

That is the byte primitives (:class:`Medium`). It is also the optional abilities the
kernel looks for with ``isinstance``: :class:`SizedMedium`, :class:`AllocatingMedium`,
:class:`BatchingMedium`, :class:`WholeObjectMedium`, :class:`ExplainingMedium`. See the
kernel's module doc for how each medium maps onto them."""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.buffers import Releasable

__all__ = [
    "AllocatingMedium", "BatchingMedium", "ExplainingMedium", "Medium", "ReadShape", "SizedMedium",
    "WholeObjectMedium",
]

ReadShape = Literal["span", "runs", "whole"]


class Medium(Protocol):
    """The byte primitives of one medium for one (namespace, rank).

    Who calls it: the kernel's I/O threads, several at once, each call on its own chunk
    range and buffer. A call blocks its thread until done or failed. ``deadline`` is a
    ``time.monotonic()`` time; a medium that can bound its requests by it should. Failures
    RAISE. The kernel turns them into results with :meth:`classify` (and
    :class:`~vllm_kvtier.chunkformat.ChunkFormatError`'s own ``reason``)."""

    #: label in logs ("memory", "nvme", "s3", "mooncake")
    name: str
    #: how the kernel turns the wanted positions into ranges: "span" (one range from the
    #: first to the last wanted block, stride-aligned), "runs" (one range per contiguous
    #: run, fetched in parallel), "whole" (the whole object)
    read_shape: ReadShape

    def put(self, chunk_id: str, view: memoryview, deadline: float) -> None:
        """Store all of ``view`` as ``chunk_id``, atomically: a reader never sees part of it.

        An existing chunk of that id is replaced, or kept where ids name content."""
        ...

    def read_into(self, chunk_id: str, offset: int, dst: memoryview, deadline: float) -> None:
        """Fill all of ``dst`` from byte ``offset`` of the chunk, or raise (a chunk that
        ends first: ChunkFormatError ``truncated``; none: ``missing``)."""
        ...

    def delete(self, chunk_id: str) -> None:
        """Remove the chunk; absent is fine."""
        ...

    def classify(self, exc: BaseException) -> FailureReason:
        """The reason of a failure this medium raised (by type and code). The kernel takes
        a ChunkFormatError's own reason and asks the medium only about the rest."""
        ...

    def close(self) -> None:
        """Free the medium's resources; called once, after the kernel's threads stopped."""
        ...


@runtime_checkable
class SizedMedium(Protocol):
    """A medium that reads whole objects and can tell an object's size first (Mooncake)."""

    def size_of(self, chunk_id: str, deadline: float) -> int: ...


@runtime_checkable
class AllocatingMedium(Protocol):
    """A medium whose reads must land in its own (registered) memory; None: none free now."""

    def take_buffer(self, nbytes: int) -> Releasable | None: ...


@runtime_checkable
class BatchingMedium(Protocol):
    """A medium that moves many chunks per call. Each returns one entry per item: None
    (done) or the exception that item failed with."""

    max_batch: int

    def put_batch(self, items: list[tuple[str, memoryview]], deadline: float) -> list[BaseException | None]: ...

    def read_batch(
        self, items: list[tuple[str, int, memoryview]], deadline: float
    ) -> list[BaseException | None]: ...


@runtime_checkable
class WholeObjectMedium(Protocol):
    """A "runs" medium with a cheaper request for a whole object (S3: a GET without a
    Range).

    The kernel calls it instead of ``read_into`` for a read of every block of a chunk.
    ``dst`` is then ``header.total_bytes`` long, and the object must be exactly that."""

    def read_whole_into(self, chunk_id: str, dst: memoryview, deadline: float) -> None: ...


@runtime_checkable
class ExplainingMedium(Protocol):
    """A medium whose reads may come back short without saying so.

    That is S3 through NIXL's OBJ engine. A range ``[0, end)`` of a chunk may fail its
    checksum. Then the kernel asks why. The answer is an exception to report instead
    (``truncated``, from the object's real size). Or it is None: the checksum failure
    stands. It costs the medium a request only on a failure."""

    def explain_damage(self, chunk_id: str, end: int, deadline: float) -> BaseException | None: ...
