"""ONE store kernel: the :class:`~vllm_kvtier.tiers.base.ChunkStore` contract implemented
once, over a medium that only moves bytes (:class:`Medium`).

What the kernel owns, for every medium:

* the bounded write queue with back-pressure (``submit_write`` False when
  ``max_queued_writes`` wait; the caller keeps its buffer);
* a write buffer's deferred ``fill`` (the caller's copy into it) run on the I/O thread
  before the header is stamped; a fill that finds its source changed ends the write
  ``superseded``, with nothing written;
* reads served before writes (one priority queue; or, with ``write_threads``, writes on
  threads of their own so a long upload never holds a read back);
* read deadlines: :meth:`StoreKernel.poll` fails a read not answered within
  ``read_deadline_s`` of its submission (``deadline``), whatever the medium, and the late
  answer is dropped and its buffer freed; exactly one result per job (the thread's or the
  deadline's: whoever claims the job first);
* the completion queue, the wait event and per-operation stats;
* header stamping on write (every block's CRC32, keys, namespace, the store's rank:
  ``encode_header``); with a key (``auth``, :mod:`~vllm_kvtier.tiers.auth`), the
  authenticated format: every block's tag (bound to the namespace, rank and block key) and
  the header's MAC, bound to the chunk id;
* the ONE verified read path: every size read from stored bytes is bounded by what this
  engine could have written (``max_chunk_blocks`` blocks of ``block_bytes``:
  :func:`~vllm_kvtier.chunkformat.bounded_header_bytes`, :func:`max_chunk_bytes`)
  BEFORE memory is sized from it (``too_large``/``format``); the key at each read position
  must be the key asked for (``key_mismatch``); a stored header read along must be the
  caller's (``checksum``); the CRC32 of every block is checked before a result is made.
  With a key, every header (the caller's, or one read) must carry a valid MAC under one of
  this store's accepted keys for this chunk id, and every wanted block its tag, before a
  result is made (``auth_failed``: signed with an accepted key id but not verifying;
  ``unauthenticated``: unsigned, signed with a key not accepted, or signed while this store
  holds no key). Unsigned chunks are served only by a store without a key; signed ones
  only by a store that accepts their key. With or without a key, a header must be of this
  store's rank (``key_mismatch``): every TP/PP rank stores its shard of a chunk under the
  same id, and only the medium's path (not signed) tells them apart.

What a medium implements (:class:`Medium`): ``put`` (atomic), ``read_into`` (exactly the
bytes asked for, or raise), ``delete``, ``classify`` (its exceptions to
:class:`~vllm_kvtier.errors.FailureReason`, by type and code, never by message text), and
``read_shape``: how a read of some positions becomes byte ranges. Optional abilities:
:class:`SizedMedium` (``size_of``: the medium reads whole objects and can tell their size
first), :class:`AllocatingMedium` (``take_buffer``: reads land in the medium's own
registered memory), :class:`BatchingMedium` (``put_batch``/``read_batch``: the kernel hands
it every queued operation of one kind at once, up to ``max_batch``). Non-regular files,
holes and leftovers are the medium's to refuse in its primitives (NVMe: ``not_regular``,
``truncated``).

How the media map onto it:

* **memory** (:mod:`~vllm_kvtier.tiers.memory`): a dict of bytearrays; ``read_shape``
  "span"; the reference implementation.
* **NVMe** (:mod:`~vllm_kvtier.tiers.nvme.store`): one file per chunk; ``put`` = tmp file +
  fdatasync + rename; ``read_into`` = open (O_NONBLOCK, refuses non-regular files; O_DIRECT
  when probed), a hole check (SEEK_HOLE), then the ``nvme.io_engine``'s read;
  ``read_shape`` "span" (one aligned range from the first to the last wanted block: one
  I/O; O_DIRECT needs page-aligned offsets, lengths and buffers, which the kernel keeps).
  Start-up scan (:class:`~vllm_kvtier.tiers.base.Scannable`) is the store's, not the kernel's.
* **S3** (to port): ``put`` = PUT or multipart (retries, breaker and the write deadline
  inside the medium); ``read_into`` = one ranged GET through ``s3.io_engine`` with retries
  bounded by the deadline it is given; ``read_shape`` "runs" (one ranged GET per contiguous
  run of wanted blocks, each queued as its own task, so the runs of one read go in
  parallel on the read threads; ``write_threads`` = io_threads keeps uploads off them).
  A read with no header (another writer's chunk) probes the first 4 KiB through
  ``read_into`` (the kernel bounds the announced header before fetching the rest). A read
  of every block is one plain GET of the whole object (:class:`WholeObjectMedium`).
  ``Scannable`` (listing + manifests, with :func:`~vllm_kvtier.tiers.s3.manifest.decode_manifest`'s
  bounds) and ``ReportsRemoteStats`` stay on the S3 store.
* **Mooncake** (:mod:`~vllm_kvtier.tiers.mooncake.store`): ``SizedMedium.size_of`` = ``get_size``
  from the master (the kernel bounds it by :func:`max_chunk_bytes` before it takes memory);
  ``AllocatingMedium.take_buffer`` = a slice of the registered arena (None: ``no_buffer``);
  ``BatchingMedium.read_batch`` = ``batch_get_into`` of whole objects, ``put_batch`` = copy
  into the arena + ``batch_put_from``; ``read_shape`` "whole". A read with no header is
  then one ``size_of`` and the whole object as the read's one range (batched with the
  other reads), its header decoded, bounded and checked when it lands. ``Probeable.exists``,
  ``ReportsRemoteStats``, the breaker and a close that goes on in the background stay on
  the Mooncake store.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from vllm_kvtier import cpus
from vllm_kvtier.chunkformat import (
    ALIGN,
    ChunkFormatError,
    ChunkHeader,
    align_up,
    block_crc,
    bounded_header_bytes,
    decode_header,
    encode_header,
    header_bytes_for,
    make_header,
    max_chunk_bytes,
)
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.keys import SAFE_ID
from vllm_kvtier.tiers.auth import ChunkAuth, refusal
from vllm_kvtier.tiers.base import IOResult, drain
from vllm_kvtier.tiers.buffers import BufferPool, Releasable, WriteBuffer, out_of_memory

__all__ = [
    "AllocatingMedium", "BatchingMedium", "KernelStats", "Medium", "ReadShape", "SizedMedium", "StoreKernel",
    "ExplainingMedium", "WholeObjectMedium",
]

logger = logging.getLogger(__name__)

ReadShape = Literal["span", "runs", "whole"]


# ---- what a medium implements -------------------------------------------------------------


class Medium(Protocol):
    """The byte primitives of one medium for one (namespace, rank).

    Who calls it: the kernel's I/O threads, several at once, each call on its own chunk
    range and buffer; a call blocks its thread until done or failed (``deadline`` is a
    ``time.monotonic()`` time: a medium that can bound its requests by it should).
    Failures RAISE; the kernel turns them into results with :meth:`classify` (and
    :class:`~vllm_kvtier.chunkformat.ChunkFormatError`'s own ``reason``)."""

    #: label in logs ("memory", "nvme", "s3", "mooncake")
    name: str
    #: how the kernel turns the wanted positions into ranges: "span" (one range from the
    #: first to the last wanted block, stride-aligned), "runs" (one range per contiguous
    #: run, fetched in parallel), "whole" (the whole object)
    read_shape: ReadShape

    def put(self, chunk_id: str, view: memoryview, deadline: float) -> None:
        """Store all of ``view`` as ``chunk_id``, atomically (a reader never sees part of
        it); an existing chunk of that id is replaced (or kept, where ids name content)."""
        ...

    def read_into(self, chunk_id: str, offset: int, dst: memoryview, deadline: float) -> None:
        """Fill all of ``dst`` from byte ``offset`` of the chunk, or raise (a chunk that
        ends first: ChunkFormatError ``truncated``; none: ``missing``)."""
        ...

    def delete(self, chunk_id: str) -> None:
        """Remove the chunk; absent is fine."""
        ...

    def classify(self, exc: BaseException) -> FailureReason:
        """The reason of a failure this medium raised (by type and code)."""
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
    Range). The kernel calls it, instead of ``read_into``, for a read of every block of a
    chunk: ``dst`` is then ``header.total_bytes`` long and the object must be exactly that."""

    def read_whole_into(self, chunk_id: str, dst: memoryview, deadline: float) -> None: ...


@runtime_checkable
class ExplainingMedium(Protocol):
    """A medium whose reads may come back short without saying so (S3 through NIXL's OBJ
    engine). After a range ``[0, end)`` of a chunk failed its checksum, the kernel asks
    why: an exception to report instead (``truncated``, from the object's real size), or
    None (the checksum failure stands). Costs the medium a request only on a failure."""

    def explain_damage(self, chunk_id: str, end: int, deadline: float) -> BaseException | None: ...


# ---- jobs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """One range of a read: chunk bytes ``[offset, offset + length)`` into the job's
    buffer at ``buf_off``; the positions whose blocks lie in it."""

    offset: int
    length: int
    buf_off: int
    positions: tuple[int, ...]
    #: the whole object (a :class:`WholeObjectMedium` reads it with ``read_whole_into``)
    whole: bool = False


@dataclass(eq=False)
class _Read:
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
class _Write:
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


_READ, _WRITE, _DELETE, _STOP = 0, 1, 2, 9


class _Failed(Exception):
    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---- the kernel ---------------------------------------------------------------------------


class StoreKernel:
    """A :class:`~vllm_kvtier.tiers.base.ChunkStore` over ``medium`` (see the module doc).

    ``max_chunk_blocks``: the most blocks this engine puts in a chunk (the config's
    ``chunk_blocks``): the bound of every block count read back. ``buffers``: where read
    buffers come from (injected: one pool per worker process). ``read_deadline_s``: see
    :meth:`submit_read`. ``write_deadline_s``: handed to the medium's ``put``.
    ``io_threads`` threads serve reads first, then writes and deletes; with
    ``write_threads`` > 0, writes and deletes get threads of their own instead.
    ``auth``: the keys this store signs and verifies with (None: unauthenticated chunks);
    :attr:`authenticated` tells a caller which header room its write buffers need.
    ``rank``: the store rank whose chunks the medium holds (the ``r<rank>`` of its path):
    stamped into every header written, and required of every header read.
    """

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
        self._pending: set[_Read] = set()
        self._queued_writes = 0
        self._closed = False
        self._seq = itertools.count()
        self._ops: dict[str, int] = {}
        self._failures: dict[FailureReason, int] = {}
        self._reads_q: queue.PriorityQueue[tuple[int, int, Any]] = queue.PriorityQueue()
        self._writes_q = self._reads_q if write_threads <= 0 else queue.PriorityQueue()
        queues = [self._reads_q] * io_threads + [self._writes_q] * max(0, write_threads)
        self._workers = [
            (threading.Thread(target=self._run, args=(q,), name=f"kvtier-{medium.name}-{i}", daemon=True), q)
            for i, q in enumerate(queues)
        ]
        for t, _ in self._workers:
            t.start()

    # ---- submission (the caller's thread; never blocks) -----------------------------------

    def submit_write(self, job_id: int, chunk_id: str, wb: WriteBuffer) -> bool:
        """See :meth:`~vllm_kvtier.tiers.base.ChunkStore.submit_write`."""
        _check_id(chunk_id)
        with self._lock:
            if self._closed or self._queued_writes >= self.max_queued_writes:
                return False
            self._queued_writes += 1
        self._writes_q.put((_WRITE, next(self._seq), _Write(job_id, chunk_id, wb, time.perf_counter())))
        return True

    def submit_read(
        self, job_id: int, chunk_id: str, header: ChunkHeader | None, positions: Sequence[int],
        keys: Sequence[bytes],
    ) -> None:
        """See :meth:`~vllm_kvtier.tiers.base.ChunkStore.submit_read`."""
        _check_id(chunk_id)
        job = _Read(job_id, chunk_id, header, list(positions), list(keys),
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
            self._reads_q.put((_READ, next(self._seq), ("probe", job)))
        else:
            self._start_parts(job, header)

    def submit_delete(self, chunk_id: str) -> None:
        """See :meth:`~vllm_kvtier.tiers.base.ChunkStore.submit_delete`."""
        _check_id(chunk_id)
        if not self._closed:
            self._writes_q.put((_DELETE, next(self._seq), chunk_id))

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
        return drain(self._done)

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until some job completed (True) or not. For idle engine
        steps only: while a request waits for its load, an in-process engine spins through
        empty steps that hold the GIL; waiting here hands it to the I/O threads (measured
        on NVMe: a 2 MiB read went from ~100 ms to ~3 ms)."""
        done = self._has_done.wait(timeout_s)
        self._has_done.clear()
        return done

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued I/O (up to ``timeout_s``), stop the threads, close the medium
        (only once no thread is still inside it). Idempotent."""
        if self._stop_accepting():
            self._shut_down(timeout_s)

    def _stop_accepting(self) -> bool:
        """The first step of :meth:`close`: refuse new work from now on; False if already
        closed. A store whose close must go on in the background (Mooncake: leaving a pool
        can outlast the caller's patience) calls it, then :meth:`_shut_down` on a thread."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _shut_down(self, timeout_s: float) -> None:
        """The rest of :meth:`close`: finish queued I/O, stop the threads, close the medium."""
        for _, q in self._workers:
            q.put((_STOP, next(self._seq), None))
        deadline = time.monotonic() + timeout_s
        for t, _ in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t, _ in self._workers):
            self.medium.close()
        else:
            logger.warning("kvtier %s: I/O still running after %.1f s at close", self.medium.name, timeout_s)

    def on_written(self, chunk_id: str, header: ChunkHeader) -> None:
        """Called on an I/O thread for every write that succeeded, just before its result
        is queued: a store that keeps an index of its own (S3's manifest) overrides it. It
        must not raise or block for long. The kernel's does nothing."""

    def op_stats(self) -> KernelStats:
        """Operations and failures so far (any thread)."""
        with self._lock:
            return KernelStats(dict(self._ops), dict(self._failures))

    # ---- planning a read --------------------------------------------------------------------

    def _check_request(self, job: _Read, h: ChunkHeader) -> _Failed | None:
        """Why the wanted positions cannot be served from a chunk with header ``h``."""
        why = self._check_trust(job.chunk_id, h)
        if why is not None:
            return why
        if h.block_bytes != self.block_bytes:
            return _Failed(FailureReason.FORMAT, f"blocks of {h.block_bytes} B, expected {self.block_bytes}")
        if not all(0 <= p < h.nblocks for p in job.positions):
            return _Failed(FailureReason.BAD_REQUEST, f"positions {job.positions} of a {h.nblocks}-block chunk")
        for p, k in zip(job.positions, job.keys, strict=True):
            if h.keys[p] != k:
                return _Failed(FailureReason.KEY_MISMATCH, f"position {p} holds key {h.keys[p].hex()[:16]}, "
                                                           f"not {k.hex()[:16]}")
        return None

    def _check_trust(self, chunk_id: str, h: ChunkHeader) -> _Failed | None:
        """Why header ``h`` of ``chunk_id`` is not to be trusted by this store (None: it is):
        its MAC and key (:func:`~vllm_kvtier.tiers.auth.refusal`), then its rank (after the
        MAC: a signed header's rank is the signer's)."""
        why = refusal(self.auth, chunk_id, h)
        if why is not None:
            return _Failed(*why)
        if h.rank != self.rank:
            return _Failed(FailureReason.KEY_MISMATCH, f"a chunk of rank {h.rank}, this store is rank {self.rank}")
        return None

    def refuses(self, chunk_id: str, h: ChunkHeader) -> FailureReason | None:
        """Why a scan must not index header ``h`` of ``chunk_id`` (None: it may): what a read
        would refuse before any byte moves (MAC and accepted key, rank). Any thread."""
        why = self._check_trust(chunk_id, h)
        return None if why is None else why.reason

    def _plan(self, h: ChunkHeader, positions: list[int]) -> list[_Part]:
        shape = self.medium.read_shape
        if shape == "whole":
            return [_Part(0, h.total_bytes, 0, tuple(sorted(set(positions))))]
        if shape == "runs" and isinstance(self.medium, WholeObjectMedium) and len(set(positions)) == h.nblocks:
            return [_Part(0, h.total_bytes, 0, tuple(range(h.nblocks)), whole=True)]
        runs = [(min(positions), max(positions))] if shape == "span" else _runs(positions)
        parts, buf_off = [], 0
        for lo, hi in runs:
            # A range from block 0 takes the header along (it is compared with the caller's).
            start = 0 if lo == 0 else h.block_offset(lo)
            end = h.block_offset(hi) + (h.stride if shape == "span" else h.block_bytes)
            parts.append(_Part(start, end - start, buf_off, tuple(p for p in sorted(set(positions)) if lo <= p <= hi)))
            buf_off += align_up(end - start)  # each range page-aligned in the buffer (O_DIRECT)
        return parts

    def _start_parts(self, job: _Read, h: ChunkHeader, buffer: Releasable | None = None) -> None:
        """Allocate the read's buffer and queue its ranges (any thread)."""
        parts = self._plan(h, job.positions)
        for part in parts:
            for p in part.positions:
                job.offsets[p] = part.buf_off + h.block_offset(p) - part.offset
        if buffer is None:
            total = parts[-1].buf_off + parts[-1].length
            buffer = self._take(total)
            if buffer is None:
                self._fail(job, _Failed(FailureReason.NO_BUFFER, f"no transfer memory for {total} B"))
                return
        with job.lock:
            job.header, job.buffer, job.remaining = h, buffer, len(parts)
        for part in parts:
            self._reads_q.put((_READ, next(self._seq), ("part", job, part)))

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

    # ---- I/O threads ----------------------------------------------------------------------

    def _run(self, q: queue.PriorityQueue[tuple[int, int, Any]]) -> None:
        cpus.enter_background()
        while True:
            prio, seq, item = q.get()
            if item is None:
                return
            batch = [item]
            kind = _kind(prio, item)
            while self._batch > 1 and len(batch) < self._batch and kind in ("part", "write"):
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    break
                if nxt[2] is None or _kind(nxt[0], nxt[2]) != kind:
                    q.put(nxt)
                    break
                batch.append(nxt[2])
            try:
                if prio == _WRITE:
                    self._write(batch)
                elif prio == _DELETE:
                    self._delete(item)
                elif kind == "probe":
                    self._probe(item[1])
                else:
                    self._read_parts([(j, p) for _, j, p in batch])
            except Exception:  # a bug in the kernel itself: log it, keep the thread
                logger.exception("kvtier %s: unexpected error in an I/O thread", self.medium.name)

    def _count(self, op: str) -> None:
        with self._lock:
            self._ops[op] = self._ops.get(op, 0) + 1

    def _reason(self, e: BaseException) -> FailureReason:
        if isinstance(e, (ChunkFormatError, _Failed)):
            return e.reason
        try:
            return self.medium.classify(e)
        except Exception:
            return FailureReason.ERROR

    # writes

    def _write(self, writes: list[_Write]) -> None:
        ready: list[_Write] = []
        for w in writes:
            fill, w.wb.fill = w.wb.fill, None
            try:
                if fill is not None and not fill(w.wb):  # its source changed: nothing to write
                    self._end_write(w, FailureReason.SUPERSEDED, None)
                    continue
            except Exception as e:
                logger.exception("kvtier %s: filling the write of %s failed", self.medium.name, w.chunk_id)
                self._end_write(w, FailureReason.ERROR, e)
                continue
            try:
                w.header = self._stamp(w.chunk_id, w.wb)
                ready.append(w)
            except (ValueError, _Failed) as e:
                self._end_write(w, FailureReason.BAD_REQUEST if not isinstance(e, _Failed) else e.reason, e)
        if not ready:
            return
        deadline = time.monotonic() + self.write_deadline_s
        views = [w.wb.buf.view[: w.header.total_bytes] for w in ready if w.header is not None]
        errors: list[BaseException | None]
        try:
            self._count("put")
            if isinstance(self.medium, BatchingMedium):
                errors = _per_item(self.medium.put_batch(
                    [(w.chunk_id, v) for w, v in zip(ready, views, strict=True)], deadline), len(ready))
            else:
                self.medium.put(ready[0].chunk_id, views[0], deadline)
                errors = [None]
        except Exception as e:  # the medium raised instead of answering per item: all failed
            errors = [e] * len(ready)
        finally:
            for v in views:
                v.release()
        # every write ends here, whatever the medium did: its queue slot and buffer come back
        for w, err in zip(ready, errors, strict=True):
            self._end_write(w, None if err is None else self._reason(err), err)

    def _stamp(self, chunk_id: str, wb: WriteBuffer) -> ChunkHeader:
        """Every block's CRC32 (and, with a key, its tag and the header's MAC) and the
        header, written into the buffer's header room."""
        n = len(wb.keys)
        if wb.block_bytes != self.block_bytes or not 1 <= n <= self.max_chunk_blocks:
            raise _Failed(FailureReason.BAD_REQUEST, f"a chunk of {n} blocks of {wb.block_bytes} B; this store "
                                                     f"writes 1..{self.max_chunk_blocks} of {self.block_bytes} B")
        if wb.header_bytes != header_bytes_for(n, self.authenticated):
            raise _Failed(FailureReason.BAD_REQUEST, f"a write buffer with {wb.header_bytes} B of header room; "
                                                     f"this store (authenticated={self.authenticated}) needs "
                                                     f"{header_bytes_for(n, self.authenticated)}")
        crcs = [block_crc(wb.block(i)) for i in range(n)]
        if self.auth is None:
            h = make_header(self.namespace, wb.keys, crcs, self.block_bytes, rank=self.rank)
        else:
            tags = []
            for i, k in enumerate(wb.keys):
                with wb.block(i) as b:
                    tags.append(self.auth.block_tag(self.namespace, self.rank, k, b))
            h = make_header(self.namespace, wb.keys, crcs, self.block_bytes, tags=tags, key_id=self.auth.key_id,
                            rank=self.rank)
            h = dataclasses.replace(h, mac=self.auth.header_mac(chunk_id, h))
        encode_header(h, wb.buf.view)
        return h

    def _end_write(self, w: _Write, reason: FailureReason | None, err: BaseException | None) -> None:
        w.wb.close()
        with self._lock:
            self._queued_writes -= 1
        if reason is not None and reason != FailureReason.SUPERSEDED:  # superseded: nothing was wrong
            logger.warning("kvtier %s: write of %s failed (%s): %s", self.medium.name, w.chunk_id, reason, err)
        h = w.header if reason is None else None
        if h is not None:
            self.on_written(w.chunk_id, h)
        self._emit(IOResult(w.job_id, "write", w.chunk_id, reason is None, reason, nbytes=h.total_bytes if h else 0,
                            seconds=time.perf_counter() - w.t0, header=h))

    def _delete(self, chunk_id: str) -> None:
        t0 = time.perf_counter()
        reason = None
        try:
            self._count("delete")
            self.medium.delete(chunk_id)
        except Exception as e:
            reason = self._reason(e)
            logger.warning("kvtier %s: delete of %s failed (%s): %s", self.medium.name, chunk_id, reason, e)
        self._emit(IOResult(-1, "delete", chunk_id, reason is None, reason, seconds=time.perf_counter() - t0))

    # reads

    def _probe(self, job: _Read) -> None:
        """A read with no header: fetch and verify the header first, every size in it
        bounded before it sizes anything."""
        if job.done:
            return
        buffer: Releasable | None = None
        try:
            if isinstance(self.medium, SizedMedium):
                self._count("size_of")
                size = self.medium.size_of(job.chunk_id, job.deadline)
                if size > self._max_bytes:
                    raise _Failed(FailureReason.TOO_LARGE, f"an object of {size} B; this store writes at most "
                                                           f"{self._max_bytes} B")
                if size < header_bytes_for(1):
                    raise _Failed(FailureReason.TRUNCATED, f"an object of {size} B")
                buffer = self._take(size)
                if buffer is None:
                    raise _Failed(FailureReason.NO_BUFFER, f"no transfer memory for {size} B")
                # The whole object is the read's one range, batched with other reads; its
                # header is decoded and checked first when it lands (_verify).
                with job.lock:
                    job.buffer, job.remaining = buffer, 1
                whole = _Part(0, size, 0, tuple(sorted(set(job.positions))))
                self._reads_q.put((_READ, next(self._seq), ("part", job, whole)))
                return
            h = self._read_header(job)
            why = self._check_request(job, h)
            if why is not None:
                raise why
        except Exception as e:
            if buffer is not None:
                buffer.close()
            self._fail(job, e)
            return
        self._start_parts(job, h, buffer)

    def _read_header(self, job: _Read) -> ChunkHeader:
        """The first page, then (for a header longer than a page, its length bounded first)
        the whole header; in aligned buffers, as O_DIRECT needs."""
        need = ALIGN
        while True:
            buf = self._take(need)
            if buf is None:
                raise _Failed(FailureReason.NO_BUFFER, f"no transfer memory for {need} B")
            try:
                self._count("read")
                with buf.view[:need] as head:
                    self.medium.read_into(job.chunk_id, 0, head, job.deadline)
                    try:
                        with head[:64] as fixed:
                            full = bounded_header_bytes(fixed, max_blocks=self.max_chunk_blocks,
                                                        block_bytes=self.block_bytes)
                        if full <= need:
                            with head[:full] as exact:
                                return decode_header(exact, self.namespace)
                    except ChunkFormatError as e:  # a short read the medium did not notice?
                        why = self._explain(job, _Part(0, need, 0, ()), _Failed(FailureReason.CHECKSUM, str(e)))
                        if why is None or isinstance(why, _Failed):
                            raise
                        raise why from e
                need = full
            finally:
                buf.close()

    def _decode(self, data: memoryview) -> ChunkHeader:
        with data[:64] as fixed:
            need = bounded_header_bytes(fixed, max_blocks=self.max_chunk_blocks, block_bytes=self.block_bytes)
        if need > len(data):
            raise _Failed(FailureReason.TRUNCATED, f"{len(data)} bytes, the header alone needs {need}")
        with data[:need] as head:
            return decode_header(head, self.namespace)

    def _read_parts(self, items: list[tuple[_Read, _Part]]) -> None:
        live = [(j, p) for j, p in items if not j.done]
        for j, p in items:
            if j.done:
                self._part_done(j, p, None)
        if not live:
            return
        deadline = min(j.deadline for j, _ in live)
        views = []
        for j, p in live:
            assert j.buffer is not None
            views.append(j.buffer.view[p.buf_off : p.buf_off + p.length])
        errors: list[BaseException | None]
        try:
            try:
                self._count("read")
                if isinstance(self.medium, BatchingMedium):
                    errors = _per_item(self.medium.read_batch(
                        [(j.chunk_id, p.offset, v) for (j, p), v in zip(live, views, strict=True)], deadline),
                        len(live))
                else:
                    (j, p), v = live[0], views[0]
                    if p.whole and isinstance(self.medium, WholeObjectMedium):
                        self.medium.read_whole_into(j.chunk_id, v, j.deadline)
                    else:
                        self.medium.read_into(j.chunk_id, p.offset, v, j.deadline)
                    errors = [None]
            except Exception as e:  # the medium raised instead of answering per item: all failed
                errors = [e] * len(live)
            errors = [self._verify(j, p, v) if err is None else err
                      for (j, p), v, err in zip(live, views, errors, strict=True)]
        finally:
            for v in views:  # released before a failed job's buffer can go back to the pool
                v.release()
        errors = [self._explain(j, p, err) for (j, p), err in zip(live, errors, strict=True)]
        for (j, p), err in zip(live, errors, strict=True):
            self._part_done(j, p, err)

    def _verify(self, job: _Read, part: _Part, view: memoryview) -> BaseException | None:
        """The CRC32 of every wanted block in the range, and the stored header against the
        caller's when the range holds it."""
        h = job.header
        if h is None:  # a whole object probed by size (SizedMedium): its header first
            try:
                h = self._decode(view)
                if len(view) < h.total_bytes:
                    raise _Failed(FailureReason.TRUNCATED, f"{len(view)} of {h.total_bytes} bytes")
                why = self._check_request(job, h)
                if why is not None:
                    raise why
            except (ChunkFormatError, _Failed) as e:
                return e
            job.header, job.offsets = h, {p: h.block_offset(p) for p in job.positions}
        elif part.offset == 0:
            expected = bytearray(h.header_bytes)
            encode_header(h, memoryview(expected))
            with view[: h.header_bytes] as head:
                if head != expected:  # with a key, what was verified is not what is stored: forged
                    return _Failed(FailureReason.CHECKSUM if self.auth is None else FailureReason.AUTH_FAILED,
                                   "the stored header is not the indexed chunk's")
        for p in part.positions:
            off = h.block_offset(p) - part.offset
            with view[off : off + h.block_bytes] as b:
                if block_crc(b) != h.crcs[p]:
                    return _Failed(FailureReason.CHECKSUM, f"block {p} checksum mismatch")
                # The header (and so the tag) was verified by _check_request before this.
                if self.auth is not None and not self.auth.verify_block(h.namespace, self.rank, h.keys[p], b,
                                                                        h.tags[p], h.key_id):
                    return _Failed(FailureReason.AUTH_FAILED, f"block {p}: its tag does not verify")
        return None

    def _explain(self, job: _Read, part: _Part, err: BaseException | None) -> BaseException | None:
        """What an :class:`ExplainingMedium` says about a checksum failure of ``part``."""
        if (not isinstance(self.medium, ExplainingMedium) or not isinstance(err, _Failed)
                or err.reason is not FailureReason.CHECKSUM or job.done):
            return err
        try:
            why = self.medium.explain_damage(job.chunk_id, part.offset + part.length, job.deadline)
        except Exception as e:  # the explanation failed: the checksum failure stands
            logger.debug("kvtier %s: no explanation for %s: %s", self.medium.name, job.chunk_id, e)
            return err
        return err if why is None else why

    def _part_done(self, job: _Read, part: _Part, err: BaseException | None) -> None:
        reason = None if err is None else self._reason(err)
        with job.lock:
            job.remaining -= 1
            if err is None:
                job.nbytes += part.length
            elif job.reason is None:
                job.reason = reason
            last = job.remaining == 0
        if err is not None and self._claim(job):
            self._log_read(job, err)
            self._emit_read(job, reason)
        if not last:
            return
        if job.reason is None and self._claim(job):
            self._emit_ok(job)
        elif job.buffer is not None:  # failed or expired: no result holds the buffer
            job.buffer.close()
            job.buffer = None

    def _fail(self, job: _Read, err: BaseException) -> None:
        """Report a read failed before any range of it was queued."""
        if self._claim(job):
            self._log_read(job, err)
            self._emit_read(job, self._reason(err))

    def _claim(self, job: _Read) -> bool:
        """Mark ``job`` reported; False if it already was (by poll's deadline or a thread)."""
        with job.lock:
            if job.done:
                return False
            job.done = True
        with self._lock:
            self._pending.discard(job)
        return True

    def _log_read(self, job: _Read, err: BaseException) -> None:
        logger.warning("kvtier %s: read of %s failed (%s): %s", self.medium.name, job.chunk_id, self._reason(err), err)

    # results

    def _emit_ok(self, job: _Read) -> None:
        h, buf = job.header, job.buffer
        assert h is not None and buf is not None
        blocks = [buf.view[job.offsets[p] : job.offsets[p] + h.block_bytes] for p in job.positions]
        self._emit(IOResult(job.job_id, "read", job.chunk_id, True, None, nbytes=job.nbytes,
                            seconds=time.perf_counter() - job.t0, header=h, blocks=blocks, buffer=buf))

    def _emit_read(self, job: _Read, reason: FailureReason | None) -> None:
        self._emit(IOResult(job.job_id, "read", job.chunk_id, False, reason, seconds=time.perf_counter() - job.t0))

    def _emit(self, res: IOResult) -> None:
        if res.reason is not None:
            with self._lock:
                self._failures[res.reason] = self._failures.get(res.reason, 0) + 1
        self._done.put(res)
        self._has_done.set()


def _per_item(errors: Any, n: int) -> list[BaseException | None]:
    """A batching medium's answer, checked: one entry per item (else it raises, and the
    caller fails every item)."""
    if not isinstance(errors, list) or len(errors) != n:
        raise RuntimeError(f"the medium answered {type(errors).__name__} "
                           f"{len(errors) if isinstance(errors, list) else ''} for a batch of {n}")
    return errors


def _kind(prio: int, item: Any) -> str:
    if prio == _WRITE:
        return "write"
    if prio == _DELETE:
        return "delete"
    return str(item[0])


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct positions as inclusive (first, last) runs: [1,2,3,7] -> [(1,3),(7,7)]."""
    runs: list[tuple[int, int]] = []
    for p in sorted(set(positions)):
        if runs and p == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], p)
        else:
            runs.append((p, p))
    return runs


def _check_id(chunk_id: str) -> None:
    if not SAFE_ID.match(chunk_id):
        raise ValueError(f"chunk id {chunk_id!r}: 1-128 of A-Z a-z 0-9 _ . -")

