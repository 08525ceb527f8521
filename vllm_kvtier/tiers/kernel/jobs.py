"""The kernel's jobs and queue items: a read (:class:`ReadJob`) and its ranges (:class:`Part`),
a write (:class:`WriteJob`), and what its I/O threads take off their priority queues
(:class:`QueueItem`: reads first, then writes, deletes, and the stop that ends a thread)."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any

from vllm_kvtier.chunkformat import ChunkHeader
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.keys import SAFE_ID
from vllm_kvtier.tiers.buffers import Releasable, WriteBuffer

__all__ = ["Failed", "KernelStats", "Op", "Part", "QueueItem", "ReadJob", "WriteJob", "check_id", "per_item", "runs_of"]


@dataclass(frozen=True)
class Part:
    """One range of a read: chunk bytes ``[offset, offset + length)`` into the job's
    buffer at ``buf_off``; the positions whose blocks lie in it."""

    offset: int
    length: int
    buf_off: int
    positions: tuple[int, ...]
    #: the whole object (a :class:`~vllm_kvtier.tiers.medium.WholeObjectMedium` reads it with ``read_whole_into``)
    whole: bool = False


@dataclass(eq=False)
class ReadJob:
    """One read, from submission to its one result (claimed under ``lock``)."""

    job_id: int
    chunk_id: str
    header: ChunkHeader | None
    positions: list[int]
    keys: list[bytes]
    deadline: float
    t0: float
    buffer: Releasable | None = None
    offsets: dict[int, int] = field(default_factory=dict)
    remaining: int = 0
    nbytes: int = 0
    reason: FailureReason | None = None
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class WriteJob:
    """One write: its buffer, and the header stamped into it."""

    job_id: int
    chunk_id: str
    wb: WriteBuffer
    t0: float
    header: ChunkHeader | None = None


@dataclass(frozen=True)
class KernelStats:
    """What a store did so far: operations by kind and failures by reason."""

    ops: dict[str, int]
    failures: dict[FailureReason, int]


class Failed(Exception):
    """A failure the kernel found itself, with its reason."""

    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Op(enum.Enum):
    """What a queue item asks of an I/O thread."""

    #: a read with no header: fetch and verify the header first (:meth:`VerifiedReads._probe`)
    PROBE = "probe"
    #: one range of a read
    PART = "part"
    WRITE = "write"
    DELETE = "delete"
    #: the thread ends
    STOP = "stop"

    @property
    def priority(self) -> int:
        """Lower first: reads (probes and ranges alike, in submission order) before writes,
        writes before deletes; the stop after all queued work."""
        return _PRIORITY[self]


_PRIORITY = {Op.PROBE: 0, Op.PART: 0, Op.WRITE: 1, Op.DELETE: 2, Op.STOP: 9}


@dataclass(frozen=True, order=True)
class QueueItem:
    """One entry of an I/O thread's priority queue, ordered by (``priority``, ``seq``) only:
    ``seq`` (a counter) keeps submission order within a priority. The payload by ``op``:
    ``read`` (PROBE; PART with ``part``), ``write`` (WRITE), ``chunk_id`` (DELETE)."""

    priority: int
    seq: int
    op: Op = field(compare=False)
    read: ReadJob | None = field(default=None, compare=False)
    part: Part | None = field(default=None, compare=False)
    write: WriteJob | None = field(default=None, compare=False)
    chunk_id: str = field(default="", compare=False)


def per_item(errors: Any, n: int) -> list[BaseException | None]:
    """A batching medium's answer, checked: one entry per item (else it raises, and the
    caller fails every item)."""
    if not isinstance(errors, list) or len(errors) != n:
        raise RuntimeError(f"the medium answered {type(errors).__name__} "
                           f"{len(errors) if isinstance(errors, list) else ''} for a batch of {n}")
    return errors


def runs_of(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct positions as inclusive (first, last) runs: [1,2,3,7] -> [(1,3),(7,7)]."""
    runs: list[tuple[int, int]] = []
    for p in sorted(set(positions)):
        if runs and p == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], p)
        else:
            runs.append((p, p))
    return runs


def check_id(chunk_id: str) -> None:
    if not SAFE_ID.match(chunk_id):
        raise ValueError(f"chunk id {chunk_id!r}: 1-128 of A-Z a-z 0-9 _ . -")
