"""The state every part of the store kernel shares (:class:`KernelCore`).

It holds the settings, the queues, the pending reads, the results and the stats. It holds
the small steps both the read path and the write path take: count an operation, classify
a failure, take a buffer, claim a job, emit a result. The engine (:mod:`.engine`) adds the
threads."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_kvtier.chunkformat import ChunkFormatError, ChunkHeader, max_chunk_bytes
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.auth import ChunkAuth
from vllm_kvtier.tiers.base import IOResult
from vllm_kvtier.tiers.buffers import BufferPool, Releasable, out_of_memory
from vllm_kvtier.tiers.kernel.jobs import Failed, KernelStats, Op, Part, QueueItem, ReadJob, WriteJob
from vllm_kvtier.tiers.medium import AllocatingMedium, Medium

__all__ = ["KernelCore", "KernelSettings", "OnWritten"]

logger = logging.getLogger("vllm_kvtier.tiers.kernel")

#: Called on an I/O thread for every write that succeeded, just before its result is
#: queued (S3 keeps its manifest so). It must not raise or block for long.
OnWritten = Callable[[str, ChunkHeader], None]


@dataclass(frozen=True)
class KernelSettings:
    """What one store kernel is built with, beside its medium, buffers and key.

    ``max_chunk_blocks``: the most blocks this engine puts in a chunk (the config's
    ``chunk_blocks``): the bound of every block count read back. ``read_deadline_s``: see
    :meth:`~vllm_kvtier.tiers.kernel.StoreKernel.submit_read`. ``write_deadline_s``:
    handed to the medium's ``put``. ``io_threads`` threads serve reads first, then writes
    and deletes. With ``write_threads`` > 0, writes and deletes get threads of their own.
    ``rank``: the store rank whose chunks the medium holds (the ``r<rank>`` of its path).
    It is stamped into every header written, and required of every header read."""

    namespace: str
    rank: int
    block_bytes: int
    max_chunk_blocks: int
    read_deadline_s: float
    write_deadline_s: float = 60.0
    io_threads: int = 2
    write_threads: int = 0
    max_queued_writes: int = 64

    def __post_init__(self) -> None:
        sizes = (self.block_bytes, self.max_chunk_blocks, self.io_threads, self.read_deadline_s)
        if sizes[0] <= 0 or sizes[1] < 1 or sizes[2] < 1 or sizes[3] <= 0:
            raise ValueError("need block_bytes, max_chunk_blocks, io_threads, read_deadline_s > 0, got "
                             + ", ".join(str(x) for x in sizes))


class _Queues:
    """The I/O threads' priority queues: reads (and, without write threads, writes too)
    and writes. ``seq`` keeps submission order within a priority."""

    def __init__(self, write_threads: int) -> None:
        self.reads: queue.PriorityQueue[QueueItem] = queue.PriorityQueue()
        self.writes = self.reads if write_threads <= 0 else queue.PriorityQueue()
        self._seq = itertools.count()

    def put(self, q: queue.PriorityQueue[QueueItem], op: Op, read: ReadJob | None, part: Part | None,
            write: WriteJob | None, chunk_id: str) -> None:
        q.put(QueueItem(op.priority, next(self._seq), op, read, part, write, chunk_id))


class _Results:
    """Completed jobs, drained by ``poll``, and the event ``wait`` blocks on."""

    def __init__(self) -> None:
        self.done: queue.SimpleQueue[IOResult] = queue.SimpleQueue()
        self.has_done = threading.Event()

    def put(self, res: IOResult) -> None:
        self.done.put(res)
        self.has_done.set()


class KernelCore:
    """The shared state and steps of :class:`~vllm_kvtier.tiers.kernel.StoreKernel` (its
    constructor's arguments are documented there)."""

    def __init__(self, medium: Medium, settings: KernelSettings, *, buffers: BufferPool,
                 auth: ChunkAuth | None = None, on_written: OnWritten | None = None) -> None:
        #: the byte primitives (public for tools and tests that wrap or inspect the medium)
        self.medium = medium
        self.settings = settings
        self.buffers = buffers
        self.auth = auth
        self._on_written = on_written
        self._lock = threading.Lock()
        self._results = _Results()
        self._pending: set[ReadJob] = set()
        self._queued_writes = 0
        self._closed = False
        self._tally = KernelStats({}, {})
        self._queues = _Queues(settings.write_threads)

    # The settings, by the names the read and write paths use.
    @property
    def namespace(self) -> str:
        return self.settings.namespace

    @property
    def rank(self) -> int:
        """The store rank (stamped into every header, required of every header read)."""
        return self.settings.rank

    @property
    def block_bytes(self) -> int:
        return self.settings.block_bytes

    @property
    def max_chunk_blocks(self) -> int:
        return self.settings.max_chunk_blocks

    @property
    def read_deadline_s(self) -> float:
        return self.settings.read_deadline_s

    @property
    def write_deadline_s(self) -> float:
        return self.settings.write_deadline_s

    @property
    def max_queued_writes(self) -> int:
        return self.settings.max_queued_writes

    @property
    def authenticated(self) -> bool:
        """Chunks are signed (write buffers need :class:`WriteBuffer`'s ``authenticated``)."""
        return self.auth is not None

    @property
    def _max_bytes(self) -> int:
        return max_chunk_bytes(self.settings.max_chunk_blocks, self.settings.block_bytes)

    @property
    def _reads_q(self) -> queue.PriorityQueue[QueueItem]:
        return self._queues.reads

    @property
    def _writes_q(self) -> queue.PriorityQueue[QueueItem]:
        return self._queues.writes

    def _enqueue(self, q: queue.PriorityQueue[QueueItem], op: Op, *, read: ReadJob | None = None,
                 part: Part | None = None, write: WriteJob | None = None, chunk_id: str = "") -> None:
        """Queue one item for the I/O threads of ``q`` (any thread; never blocks)."""
        self._queues.put(q, op, read, part, write, chunk_id)

    def op_stats(self) -> KernelStats:
        """Operations and failures so far (any thread)."""
        with self._lock:
            return KernelStats(dict(self._tally.ops), dict(self._tally.failures))

    def _count(self, op: str) -> None:
        with self._lock:
            self._tally.ops[op] = self._tally.ops.get(op, 0) + 1

    def _reason(self, e: BaseException) -> FailureReason:
        if isinstance(e, (ChunkFormatError, Failed)):
            return e.reason
        try:
            return self.medium.classify(e)
        except Exception:
            return FailureReason.ERROR

    def _take(self, nbytes: int) -> Releasable | None:
        """A read buffer, or None (the read fails ``no_buffer``: a miss): none free in the
        medium's arena, or the host is out of memory (counted as the op ``no_memory``)."""
        if isinstance(self.medium, AllocatingMedium):
            return self.medium.take_buffer(nbytes)
        try:
            return self.buffers.take(nbytes)
        except (MemoryError, OSError) as e:
            if not out_of_memory(e):
                raise
            self._count("no_memory")
            logger.warning("kvtier %s: no memory for a %d B read buffer: %s", self.medium.name, nbytes, e)
            return None

    def _claim(self, job: ReadJob) -> bool:
        """Mark ``job`` reported; False if it already was (by poll's deadline or a thread)."""
        with job.lock:
            if job.done:
                return False
            job.done = True
        with self._lock:
            self._pending.discard(job)
        return True

    def _log_read(self, job: ReadJob, err: BaseException) -> None:
        logger.warning("kvtier %s: read of %s failed (%s): %s", self.medium.name, job.chunk_id, self._reason(err), err)

    def _emit_ok(self, job: ReadJob) -> None:
        h, buf = job.header, job.buffer
        assert h is not None and buf is not None
        blocks = [buf.view[job.offsets[p] : job.offsets[p] + h.block_bytes] for p in job.positions]
        self._emit(IOResult(job.job_id, "read", job.chunk_id, True, None, nbytes=job.nbytes,
                            seconds=time.perf_counter() - job.t0, header=h, blocks=blocks, buffer=buf))

    def _emit_read(self, job: ReadJob, reason: FailureReason | None) -> None:
        self._emit(IOResult(job.job_id, "read", job.chunk_id, False, reason, seconds=time.perf_counter() - job.t0))

    def _emit(self, res: IOResult) -> None:
        if res.reason is not None:
            with self._lock:
                self._tally.failures[res.reason] = self._tally.failures.get(res.reason, 0) + 1
        self._results.put(res)
