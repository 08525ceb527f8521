"""The engine of the store kernel (:class:`StoreKernel`): submission (bounded, never
blocking), the I/O threads and their priority queues (reads first), results by ``poll``
(with read deadlines), ``wait`` and ``close``. The read path is :mod:`.reads`, the write
stamping :mod:`.stamping`; the module doc of :mod:`vllm_kvtier.tiers.kernel` tells the whole."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

from vllm_kvtier import cpus
from vllm_kvtier.chunkformat import ChunkHeader
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.auth import ChunkAuth
from vllm_kvtier.tiers.base import IOResult, drain
from vllm_kvtier.tiers.buffers import BufferPool, WriteBuffer
from vllm_kvtier.tiers.kernel.core import KernelSettings, OnWritten
from vllm_kvtier.tiers.kernel.jobs import Op, QueueItem, ReadJob, WriteJob, check_id
from vllm_kvtier.tiers.kernel.reads import VerifiedReads
from vllm_kvtier.tiers.kernel.stamping import StampedWrites
from vllm_kvtier.tiers.medium import BatchingMedium, Medium

__all__ = ["StoreKernel"]

logger = logging.getLogger("vllm_kvtier.tiers.kernel")


class StoreKernel(VerifiedReads, StampedWrites):
    """A :class:`~vllm_kvtier.tiers.base.ChunkStore` over ``medium`` (see the module doc).

    ``settings``: the sizes, deadlines, threads and rank (:class:`KernelSettings`).
    ``buffers``: where read buffers come from (injected: one pool per worker process).
    ``auth``: the keys this store signs and verifies with (None: unauthenticated chunks).
    :attr:`authenticated` tells a caller which header room its write buffers need.
    ``on_written``: called on an I/O thread for every write that succeeded, just before its
    result is queued. A store that keeps an index of its own (S3's manifest) passes it.
    It must not raise or block for long.

    A store holds a kernel and its medium (:class:`KernelStore`); it does not inherit one.
    """

    def __init__(self, medium: Medium, settings: KernelSettings, *, buffers: BufferPool,
                 auth: ChunkAuth | None = None, on_written: OnWritten | None = None) -> None:
        super().__init__(medium, settings, buffers=buffers, auth=auth, on_written=on_written)
        queues = [self._reads_q] * settings.io_threads + [self._writes_q] * max(0, settings.write_threads)
        batch = medium.max_batch if isinstance(medium, BatchingMedium) else 1
        self._workers = [
            (threading.Thread(target=self._run, args=(q, batch), name=f"kvtier-{medium.name}-{i}", daemon=True), q)
            for i, q in enumerate(queues)
        ]
        for t, _ in self._workers:
            t.start()

    # ---- submission (the caller's thread; never blocks) -----------------------------------

    def submit_write(self, job_id: int, chunk_id: str, wb: WriteBuffer) -> bool:
        """See :meth:`~vllm_kvtier.tiers.base.ChunkStore.submit_write`."""
        check_id(chunk_id)
        with self._lock:
            if self._closed or self._queued_writes >= self.max_queued_writes:
                return False
            self._queued_writes += 1
        self._enqueue(self._writes_q, Op.WRITE, write=WriteJob(job_id, chunk_id, wb, time.perf_counter()))
        return True

    def submit_read(
        self, job_id: int, chunk_id: str, header: ChunkHeader | None, positions: Sequence[int],
        keys: Sequence[bytes],
    ) -> None:
        """See :meth:`~vllm_kvtier.tiers.base.ChunkStore.submit_read`."""
        check_id(chunk_id)
        job = ReadJob(job_id, chunk_id, header, list(positions), list(keys),
                    time.monotonic() + self.read_deadline_s, time.perf_counter())
        if self._closed:
            self._emit_read(job, FailureReason.CLOSED)
            return
        if not job.positions or len(job.keys) != len(job.positions):
            self._emit_read(job, FailureReason.BAD_REQUEST)
            return
        if header is not None:
            why = self._check_request(job, header)
            if why is not None:
                self._log_read(job, why)
                self._emit_read(job, why.reason)
                return
        with self._lock:
            self._pending.add(job)
        if header is None:
            self._enqueue(self._reads_q, Op.PROBE, read=job)
        else:
            self._start_parts(job, header)

    def submit_delete(self, chunk_id: str) -> None:
        """See :meth:`~vllm_kvtier.tiers.base.ChunkStore.submit_delete`."""
        check_id(chunk_id)
        if not self._closed:
            self._enqueue(self._writes_q, Op.DELETE, chunk_id=chunk_id)

    def poll(self) -> list[IOResult]:
        """Completed jobs since the last poll, and reads past their deadline (failed,
        ``deadline``; a late answer to them is dropped and its buffer freed)."""
        now = time.monotonic()
        with self._lock:
            expired = [j for j in self._pending if j.deadline <= now]
        for job in expired:
            if self._claim(job):
                logger.warning("kvtier %s: read of %s failed (deadline): no answer within %.1f s",
                               self.medium.name, job.chunk_id, self.read_deadline_s)
                self._emit_read(job, FailureReason.DEADLINE)
        return drain(self._results.done)

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until some job completed (True) or not.

        For idle engine steps only. While a request waits for its load, an in-process
        engine spins through empty steps that hold the GIL. Waiting here hands it to the I/O
        threads. Measured on NVMe, a 2 MiB read went from ~100 ms to ~3 ms."""
        done = self._results.has_done.wait(timeout_s)
        self._results.has_done.clear()
        return done

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued I/O (up to ``timeout_s``), stop the threads, close the medium
        (only once no thread is still inside it). Idempotent."""
        if self.stop_accepting():
            self.shut_down(timeout_s)

    def stop_accepting(self) -> bool:
        """The first step of :meth:`close`: refuse new work from now on; False if already
        closed. A store whose close must go on in the background (Mooncake: leaving a pool
        can outlast the caller's patience) calls it, then :meth:`shut_down` on a thread."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def shut_down(self, timeout_s: float) -> None:
        """The rest of :meth:`close`: finish queued I/O, stop the threads, close the medium."""
        for _, q in self._workers:
            self._enqueue(q, Op.STOP)
        deadline = time.monotonic() + timeout_s
        for t, _ in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t, _ in self._workers):
            self.medium.close()
        else:
            logger.warning("kvtier %s: I/O still running after %.1f s at close", self.medium.name, timeout_s)

    # ---- I/O threads ----------------------------------------------------------------------

    def _run(self, q: queue.PriorityQueue[QueueItem], max_batch: int) -> None:
        """One I/O thread: items of ``q``, up to ``max_batch`` of one kind at once."""
        cpus.enter_background()
        while True:
            item = q.get()
            if item.op is Op.STOP:
                return
            batch = [item]
            while len(batch) < max_batch and item.op in (Op.PART, Op.WRITE):
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    break
                if nxt.op is not item.op:
                    q.put(nxt)
                    break
                batch.append(nxt)
            try:
                if item.op is Op.WRITE:
                    self._write([i.write for i in batch if i.write is not None])
                elif item.op is Op.DELETE:
                    self._delete(item.chunk_id)
                elif item.op is Op.PROBE:
                    if item.read is not None:
                        self._probe(item.read)
                else:
                    self._read_parts([(i.read, i.part) for i in batch if i.read is not None and i.part is not None])
            except Exception:  # a bug in the kernel itself: log it, keep the thread
                logger.exception("kvtier %s: unexpected error in an I/O thread", self.medium.name)
