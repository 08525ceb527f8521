"""The state every part of the store kernel shares (:class:`KernelCore`): the settings, the
queues, the pending reads, the results and the stats, and the small steps both the read
path and the write path take (count an operation, classify a failure, take a buffer, claim
a job, emit a result). The engine (:mod:`.engine`) adds the threads."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time

from vllm_kvtier.chunkformat import ChunkFormatError, max_chunk_bytes
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.auth import ChunkAuth
from vllm_kvtier.tiers.base import IOResult
from vllm_kvtier.tiers.buffers import BufferPool, Releasable, out_of_memory
from vllm_kvtier.tiers.kernel.jobs import Failed, KernelStats, Op, Part, QueueItem, ReadJob, WriteJob
from vllm_kvtier.tiers.medium import AllocatingMedium, BatchingMedium, Medium

__all__ = ["KernelCore"]

logger = logging.getLogger("vllm_kvtier.tiers.kernel")


class KernelCore:
    """The shared state and steps of :class:`~vllm_kvtier.tiers.kernel.StoreKernel` (its
    constructor's arguments are documented there)."""

    def __init__(
        self, medium: Medium, *, namespace: str, block_bytes: int, max_chunk_blocks: int,
        buffers: BufferPool, read_deadline_s: float, write_deadline_s: float = 60.0, io_threads: int = 2,
        write_threads: int = 0, max_queued_writes: int = 64, auth: ChunkAuth | None = None, rank: int,
    ) -> None:
        if block_bytes <= 0 or max_chunk_blocks < 1 or io_threads < 1 or read_deadline_s <= 0:
            raise ValueError(f"need block_bytes, max_chunk_blocks, io_threads, read_deadline_s > 0, got "
                             f"{block_bytes}, {max_chunk_blocks}, {io_threads}, {read_deadline_s}")
        #: the byte primitives (public for tools and tests that wrap or inspect the medium)
        self.medium = medium
        self.namespace = namespace
        #: the store rank (stamped into every header, required of every header read)
        self.rank = rank
        self.block_bytes = block_bytes
        self.max_chunk_blocks = max_chunk_blocks
        self.buffers = buffers
        self.read_deadline_s = read_deadline_s
        self.write_deadline_s = write_deadline_s
        self.max_queued_writes = max_queued_writes
        self.auth = auth
        #: Chunks are signed (write buffers need :class:`WriteBuffer`'s ``authenticated``).
        self.authenticated = auth is not None
        self._max_bytes = max_chunk_bytes(max_chunk_blocks, block_bytes)
        self._batch = medium.max_batch if isinstance(medium, BatchingMedium) else 1
        self._lock = threading.Lock()
        self._done: queue.SimpleQueue[IOResult] = queue.SimpleQueue()
        self._has_done = threading.Event()
        self._pending: set[ReadJob] = set()
        self._queued_writes = 0
        self._closed = False
        self._seq = itertools.count()
        self._ops: dict[str, int] = {}
        self._failures: dict[FailureReason, int] = {}
        self._reads_q: queue.PriorityQueue[QueueItem] = queue.PriorityQueue()
        self._writes_q = self._reads_q if write_threads <= 0 else queue.PriorityQueue()

    def _enqueue(self, q: queue.PriorityQueue[QueueItem], op: Op, *, read: ReadJob | None = None,
                 part: Part | None = None, write: WriteJob | None = None, chunk_id: str = "") -> None:
        """Queue one item for the I/O threads of ``q`` (any thread; never blocks)."""
        q.put(QueueItem(op.priority, next(self._seq), op, read, part, write, chunk_id))

    def op_stats(self) -> KernelStats:
        """Operations and failures so far (any thread)."""
        with self._lock:
            return KernelStats(dict(self._ops), dict(self._failures))

    def _count(self, op: str) -> None:
        with self._lock:
            self._ops[op] = self._ops.get(op, 0) + 1

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
                self._failures[res.reason] = self._failures.get(res.reason, 0) + 1
        self._done.put(res)
        self._has_done.set()
