"""The Mooncake tier's data path: chunk objects in a Mooncake Store pool (a ``mooncake_master``
plus clients that pool their DRAM), written and read by I/O threads.

Who calls it: the worker half (one store per TP rank), from the worker's main thread;
``submit_*`` return at once, completions come back through :meth:`MooncakeStore.poll`,
exactly like :class:`~vllm_kvtier.tiers.nvme.NVMeStore` and
:class:`~vllm_kvtier.tiers.s3.S3Store`. The constructor (connects to the master) and
:meth:`MooncakeStore.close` block their caller.

Objects: key ``kvtier/<namespace>/r<rank>/<chunk_id>``; the value is a chunk in the format
of :mod:`~vllm_kvtier.tiers.chunkfile` (a header with every block's key and CRC32, then the
blocks at a fixed stride). Every read checks the header (against the caller's copy, or
decodes and verifies it when the caller has none) and the CRC32 of every requested block;
a value that does not verify is a failed read (``checksum``, ``format``...), never data.
Nothing read from the pool is ever unpickled: other clients of the pool can write any
bytes under our keys.

Transfers: one page-aligned arena of ``transfer_buffer_bytes``, registered with the
client once (RDMA needs registered memory; registering per transfer would pin pages on
every call). Writes copy the caller's chunk into it (one memory copy, cheap next to the
network) and reads land in it; an I/O thread takes every job queued at that moment (up to
``max_batch``) and moves them with one ``batch_put_from`` / ``batch_get_into`` call. A read
result's blocks are views into the arena: copy them out, then ``release()`` the result.

Leases, replicas and eviction are Mooncake's: the master evicts objects when its pool is
full, and a read of an evicted chunk fails with ``missing`` (a miss). Deletes use
``force``: a plain remove is refused while an object holds a read lease (10 s by default
after each read), and a reader racing a forced delete gets bytes that fail their CRC32,
which is a miss, never wrong KV.

Failures: every failure is an ``IOResult(ok=False, reason=...)``; no exception leaves an
I/O thread. A read's deadline counts from its submission and :meth:`MooncakeStore.poll`
reports a read past it as failed (``deadline``) even while the client call is still
blocked (with the master gone, each call takes seconds to fail). A circuit breaker
(:mod:`~vllm_kvtier.tiers.resilience`) makes requests fail at once (``breaker_open``) after
``breaker_failures`` consecutive unhealthy batches.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_kvtier.config.stores import SAFE_ID, MooncakeConfig
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.base import IOResult, drain
from vllm_kvtier.tiers.buffers import WriteBuffer
from vllm_kvtier.tiers.chunkfile import (
    ChunkFormatError,
    ChunkHeader,
    align_up,
    block_crc,
    decode_header,
    encode_header,
    keys_match,
    make_header,
)
from vllm_kvtier.tiers.resilience import CircuitBreaker, RemoteStats

__all__ = ["INSTALL_HINT", "MooncakeConfig", "MooncakeStats", "MooncakeStore", "code_reason", "object_key"]

logger = logging.getLogger(__name__)

MiB = 1 << 20
INSTALL_HINT = (
    "the Mooncake tier needs the mooncake-transfer-engine package and libibverbs: "
    "pip install mooncake-transfer-engine (GPU hosts) or mooncake-transfer-engine-non-cuda (CPU-only), "
    "and apt-get install libibverbs1 (tools/setup-remote.sh does both for tests)"
)


#: Mooncake's ErrorCode values (mooncake-store/include/types.h) -> our failure labels.
_CODE_REASONS: dict[int, FailureReason] = {
    -10: FailureReason.TRUNCATED,  # BUFFER_OVERFLOW
    -101: FailureReason.MISSING,  # SEGMENT_NOT_FOUND: the client that held the replica left the pool
    -200: FailureReason.POOL_FULL,  # NO_AVAILABLE_HANDLE: no space in any segment
    -400: FailureReason.BAD_REQUEST,  # INVALID_KEY
    -600: FailureReason.BAD_REQUEST,  # INVALID_PARAMS (e.g. a buffer smaller than the object)
    -703: FailureReason.NOT_READY,  # REPLICA_IS_NOT_READY: another client is still writing it
    -704: FailureReason.MISSING,  # OBJECT_NOT_FOUND (never stored, evicted or removed)
    -705: FailureReason.EXISTS,  # OBJECT_ALREADY_EXISTS
    -706: FailureReason.LEASE,  # OBJECT_HAS_LEASE
    -707: FailureReason.LEASE_EXPIRED,  # LEASE_EXPIRED before the transfer finished
    -710: FailureReason.MISSING,  # REPLICA_NOT_FOUND
    -712: FailureReason.MISSING,  # REPLICA_IS_GONE
    -714: FailureReason.NOT_READY,  # OBJECT_REPLICA_BUSY
    -800: FailureReason.TRANSFER,  # TRANSFER_FAIL
    -801: FailureReason.CHECKSUM,  # CHECKSUM_MISMATCH
    -900: FailureReason.UNAVAILABLE,  # RPC_FAIL: the master does not answer
    -901: FailureReason.UNAVAILABLE,  # RPC_TIMEOUT
    -1010: FailureReason.UNAVAILABLE,  # UNAVAILABLE_IN_CURRENT_STATUS
}
#: Reasons that say the pool is unhealthy (they count toward the circuit breaker); others
#: (missing, pool_full, checksum...) are answers about one object from a healthy pool.
_UNHEALTHY = frozenset({FailureReason.UNAVAILABLE, FailureReason.TRANSFER, FailureReason.ERROR})


def code_reason(rc: int) -> FailureReason:
    """The Mooncake medium's classifier: the reason of a negative Mooncake return code."""
    return _CODE_REASONS.get(rc, FailureReason.ERROR)


def object_key(namespace: str, rank: int, chunk_id: str) -> str:
    return f"kvtier/{namespace}/r{rank}/{chunk_id}"


# ---- configuration ---------------------------------------------------------------------------


# ---- the registered arena ----------------------------------------------------------------------


class ArenaSlice:
    """A page-aligned range of a store's arena (the ``buffer`` of a read result);
    :meth:`close` gives it back. Keep no view of it after closing."""

    def __init__(self, arena: _Arena, offset: int, nbytes: int) -> None:
        self._arena: _Arena | None = arena
        self.offset = offset
        self.nbytes = nbytes
        self.addr = arena.addr + offset
        self.view = arena.view[offset : offset + nbytes]

    def close(self) -> None:
        arena, self._arena = self._arena, None
        if arena is None:
            return
        self.view.release()
        arena.give(self.offset, self.nbytes)


class _Arena:
    """One anonymous mapping, handed out first-fit in page-aligned slices (thread-safe)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = align_up(nbytes)
        self._map = mmap.mmap(-1, self.nbytes)
        anchor = ctypes.c_char.from_buffer(self._map)
        self.addr = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the map lives; the export must not
        self.view = memoryview(self._map)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, length), sorted
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> ArenaSlice | None:
        need = align_up(max(nbytes, 1))
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, length - need)
                    return ArenaSlice(self, off, need)
        return None

    def give(self, offset: int, nbytes: int) -> None:
        with self._lock:
            free = self._free
            i = 0
            while i < len(free) and free[i][0] < offset:
                i += 1
            free.insert(i, (offset, nbytes))
            if i + 1 < len(free) and offset + nbytes == free[i + 1][0]:  # merge with the next
                free[i] = (offset, nbytes + free.pop(i + 1)[1])
            if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # and with the previous
                prev = free.pop(i - 1)
                free[i - 1] = (prev[0], prev[1] + free[i - 1][1])

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a caller still holds a block view: the GC unmaps it later
            self._map.close()


# ---- jobs and stats ------------------------------------------------------------------------------


@dataclass(eq=False)
class _Read:
    job_id: int
    chunk_id: str
    key: str
    #: None: a chunk this process has not indexed; its header is read and verified first.
    header: ChunkHeader | None
    positions: list[int]
    deadline: float
    t0: float
    keys: list[bytes] | None = None
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class _Write:
    job_id: int
    chunk_id: str
    key: str
    wb: WriteBuffer
    t0: float


@dataclass(eq=False)
class _Delete:
    chunk_id: str
    key: str


#: The Mooncake store's figures (the shape every remote store reports; ``retries`` is 0).
MooncakeStats = RemoteStats


# ---- the store --------------------------------------------------------------------------------


class MooncakeStore:
    """Chunk objects in a Mooncake Store pool for one (namespace, rank). See the module doc.

    Raises ImportError (with an install hint) when the mooncake package or its system
    libraries are missing, and ConnectionError when the master cannot be reached or the
    client cannot join the pool."""

    def __init__(self, config: MooncakeConfig, namespace: str, rank: int, block_bytes: int) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:  # also a missing libibverbs.so.1 (an ImportError of the extension)
            raise ImportError(f"{INSTALL_HINT} ({e})") from e
        self.config = config
        self.namespace = namespace
        self.rank = rank
        self.block_bytes = block_bytes
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        host, port = config.master_host_port
        _probe(host, port, config.connect_timeout_s)
        self.local_hostname = config.local_hostname or _route_address(host)
        client = MooncakeDistributedStore()
        rc = client.setup(
            self.local_hostname, config.metadata_server, config.global_segment_bytes,
            config.local_buffer_bytes, config.protocol, config.device_name, config.master,
        )
        if rc != 0:
            raise ConnectionError(f"mooncake: joining the pool of master {config.master} failed (rc {rc})")
        self._arena = _Arena(config.transfer_buffer_bytes)
        rc = client.register_buffer(self._arena.addr, self._arena.nbytes)
        if rc != 0:
            client.close()
            self._arena.close()
            raise ConnectionError(f"mooncake: registering the {self._arena.nbytes} B transfer buffer failed (rc {rc})")
        self._client = client
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = config.replicas
        self.max_queued_writes = config.max_queued_writes
        self._lock = threading.Lock()
        self._done: queue.SimpleQueue[IOResult] = queue.SimpleQueue()
        self._has_done = threading.Event()
        self._pending: set[_Read] = set()
        self._queued_writes = 0
        self._closed = False
        self._requests: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._reads: queue.SimpleQueue[_Read | None] = queue.SimpleQueue()
        self._writes: queue.SimpleQueue[_Write | _Delete | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, args=(self._reads, self._read_batch),
                             name=f"kvtier-mooncake-read-{i}", daemon=True)
            for i in range(config.io_threads)
        ] + [
            threading.Thread(target=self._run, args=(self._writes, self._write_batch),
                             name=f"kvtier-mooncake-write-{i}", daemon=True)
            for i in range(config.io_threads)
        ]
        for t in self._threads:
            t.start()
        self._closer: threading.Thread | None = None
        logger.info("kvtier mooncake: joined master %s as %s over %s (segment %d B)", config.master,
                    self.local_hostname, config.protocol, config.global_segment_bytes)

    def __repr__(self) -> str:
        return (f"MooncakeStore(master={self.config.master!r}, protocol={self.config.protocol!r}, "
                f"namespace={self.namespace!r}, rank={self.rank})")

    def key(self, chunk_id: str) -> str:
        return object_key(self.namespace, self.rank, chunk_id)

    # ---- submission (caller's thread; never blocks) ------------------------------------------

    def submit_write(self, job_id: int, chunk_id: str, wb: WriteBuffer) -> bool:
        """Queue a chunk put. False (and nothing queued) if too many writes wait or the store
        is closed; the caller still owns ``wb`` then. Otherwise the store closes ``wb``'s
        buffer once it is copied out."""
        _check_id(chunk_id)
        with self._lock:
            if self._closed or self._queued_writes >= self.max_queued_writes:
                return False
            self._queued_writes += 1
        self._writes.put(_Write(job_id, chunk_id, self.key(chunk_id), wb, time.perf_counter()))
        return True

    def submit_read(self, job_id: int, chunk_id: str, header: ChunkHeader | None, positions: Sequence[int],
                    keys: Sequence[bytes] | None = None) -> None:
        """Queue a load of the blocks at ``positions`` (any order; the result's ``blocks``
        follow it). The result arrives by poll within ``deadline_s`` of this call.
        ``header`` None: a chunk another instance wrote; its header is read and verified
        with it and comes back in the result's ``header`` for the caller to keep."""
        _check_id(chunk_id)
        bad = not positions or (header is not None and not all(0 <= p < header.nblocks for p in positions))
        if self._closed or bad:
            self._emit(IOResult(job_id, "read", chunk_id, False, reason=FailureReason.CLOSED if self._closed else FailureReason.BAD_REQUEST))
            return
        if header is not None and not keys_match(header, positions, keys):
            self._emit(IOResult(job_id, "read", chunk_id, False, reason=FailureReason.KEY_MISMATCH))
            return
        job = _Read(job_id, chunk_id, self.key(chunk_id), header, list(positions),
                    time.monotonic() + self.config.deadline_s, time.perf_counter(),
                    keys=None if keys is None else list(keys))
        with self._lock:
            self._pending.add(job)
        self._reads.put(job)

    def submit_delete(self, chunk_id: str) -> None:
        _check_id(chunk_id)
        if not self._closed:
            self._writes.put(_Delete(chunk_id, self.key(chunk_id)))

    def poll(self) -> list[IOResult]:
        """Completed jobs since the last poll, and reads past their deadline (failed,
        reason ``deadline``; a late answer to them is dropped)."""
        now = time.monotonic()
        with self._lock:
            expired = [j for j in self._pending if j.deadline <= now]
        for job in expired:
            if self._claim(job):
                self._emit(IOResult(job.job_id, "read", job.chunk_id, False, reason=FailureReason.DEADLINE,
                                    seconds=time.perf_counter() - job.t0))
        return drain(self._done)

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until some job has completed (True) or not; for idle
        engine steps only (hands the GIL to the I/O threads, as NVMeStore.wait)."""
        done = self._has_done.wait(timeout_s)
        self._has_done.clear()
        return done

    # ---- blocking helpers (start-up, tools, the scheduler's lookups) -----------------------------

    def exists(self, chunk_ids: list[str]) -> list[bool]:
        """Whether each chunk is in the pool now (one batch call; blocks). An error reads
        as False: a chunk that cannot be confirmed is a miss."""
        if not chunk_ids or self._closed:
            return [False] * len(chunk_ids)
        self._count("batch_is_exist")
        try:
            rcs = self._client.batch_is_exist([self.key(c) for c in chunk_ids])
        except Exception as e:
            logger.warning("kvtier mooncake: exists failed: %s", e)
            return [False] * len(chunk_ids)
        return [rc == 1 for rc in rcs]

    def stats(self) -> MooncakeStats:
        with self._lock:
            return MooncakeStats(dict(self._requests), 0, dict(self._failures), self.breaker.snapshot())

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued I/O, leave the pool and free the arena, waiting up to ``timeout_s``;
        what is not done by then finishes on a background (non-daemon) thread, so the
        process still exits cleanly. Leaving takes about 2 s on a healthy pool and longer
        when the master is gone (the client's own RPC timeouts). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in range(self.config.io_threads):
            self._reads.put(None)
            self._writes.put(None)
        self._closer = threading.Thread(target=self._teardown, name="kvtier-mooncake-close")
        self._closer.start()
        self._closer.join(timeout_s)
        if self._closer.is_alive():
            logger.warning("kvtier mooncake: still leaving the pool after %.1f s; finishing in the background",
                           timeout_s)

    def _teardown(self) -> None:
        for t in self._threads:
            t.join()
        try:
            self._client.unregister_buffer(self._arena.addr)
            self._client.close()
        except Exception as e:
            logger.warning("kvtier mooncake: closing the client failed: %s", e)
        self._arena.close()

    # ---- I/O threads ---------------------------------------------------------------------------

    def _run(self, q: queue.SimpleQueue[Any], handle: Callable[[list[Any]], None]) -> None:
        while True:
            first = q.get()
            if first is None:
                return
            batch, stop = [first], False
            while len(batch) < self.config.max_batch:
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            try:
                handle(batch)
            except Exception:  # a bug in our own plumbing: log it, keep the thread
                logger.exception("kvtier mooncake: unexpected error in an I/O thread")
            if stop:
                return

    def _read_batch(self, jobs: list[_Read]) -> None:
        live = [j for j in jobs if not j.done]
        if not live:
            return
        if not self.breaker.allow():
            for j in live:
                self._fail_read(j, FailureReason.BREAKER_OPEN)
            return
        unhealthy = False
        plan: list[tuple[_Read, ArenaSlice]] = []
        for j in live:
            size = j.header.total_bytes if j.header is not None else self._call("get_size", j.key)
            if size < 0:
                reason = code_reason(size)
                unhealthy |= reason in _UNHEALTHY
                self._fail_read(j, reason)
                continue
            buf = self._arena.take(size)
            if buf is None:
                self._fail_read(j, FailureReason.NO_BUFFER)
                continue
            plan.append((j, buf))
        if plan:
            rcs = self._batch("batch_get_into", [j.key for j, _ in plan], [b.addr for _, b in plan],
                              [self._size(j, b) for j, b in plan])
            for (j, buf), rc in zip(plan, rcs, strict=True):
                why, header = self._check_read(j, buf, rc)
                unhealthy |= why in _UNHEALTHY
                if why is not None:
                    buf.close()
                    self._fail_read(j, why)
                else:
                    self._finish_read(j, buf, header, rc)
        self._record(unhealthy)

    @staticmethod
    def _size(job: _Read, buf: ArenaSlice) -> int:
        return job.header.total_bytes if job.header is not None else buf.nbytes

    def _check_read(self, job: _Read, buf: ArenaSlice, rc: int) -> tuple[FailureReason | None, ChunkHeader | None]:
        """("", header) when the bytes in ``buf`` are the chunk and every wanted block
        verifies; (reason, None) otherwise."""
        if rc < 0:
            return code_reason(rc), None
        try:
            with buf.view[:rc] as got:
                if job.header is None:
                    h = decode_header(got, self.namespace)
                    if h.block_bytes != self.block_bytes:
                        raise ChunkFormatError(f"format: blocks of {h.block_bytes} B, expected {self.block_bytes}", FailureReason.FORMAT)
                    if not all(0 <= p < h.nblocks for p in job.positions):
                        return FailureReason.BAD_REQUEST, None
                    if not keys_match(h, job.positions, job.keys):
                        return FailureReason.KEY_MISMATCH, None
                else:
                    h = job.header
                    expected = bytearray(h.header_bytes)
                    encode_header(h, memoryview(expected))
                    with got[: h.header_bytes] as head:
                        if head != expected:
                            raise ChunkFormatError("header checksum mismatch: the object is not the indexed chunk", FailureReason.CHECKSUM)
                if rc < h.total_bytes:
                    raise ChunkFormatError(f"truncated: {rc} of {h.total_bytes} bytes", FailureReason.TRUNCATED)
                for p in job.positions:
                    off = h.block_offset(p)
                    with got[off : off + h.block_bytes] as b:
                        if block_crc(b) != h.crcs[p]:
                            raise ChunkFormatError(f"block {p} checksum mismatch", FailureReason.CHECKSUM)
        except ChunkFormatError as e:
            logger.warning("kvtier mooncake: read of %s failed: %s", job.key, e)
            return e.reason, None
        return None, h

    def _finish_read(self, job: _Read, buf: ArenaSlice, header: ChunkHeader | None, nbytes: int) -> None:
        if not self._claim(job):  # expired meanwhile: already reported
            buf.close()
            return
        assert header is not None
        blocks = [buf.view[header.block_offset(p) : header.block_offset(p) + header.block_bytes]
                  for p in job.positions]
        self._emit(IOResult(job.job_id, "read", job.chunk_id, True, nbytes=nbytes,
                            seconds=time.perf_counter() - job.t0, header=header, blocks=blocks, buffer=buf))

    def _fail_read(self, job: _Read, reason: FailureReason) -> None:
        if self._claim(job):
            self._emit(IOResult(job.job_id, "read", job.chunk_id, False, reason=reason,
                                seconds=time.perf_counter() - job.t0))

    def _claim(self, job: _Read) -> bool:
        """Mark ``job`` reported; False if it already was (by poll's deadline or a thread)."""
        with job.lock:
            if job.done:
                return False
            job.done = True
        with self._lock:
            self._pending.discard(job)
        return True

    def _write_batch(self, items: list[_Write | _Delete]) -> None:
        writes = [w for w in items if isinstance(w, _Write)]
        deletes = [d for d in items if isinstance(d, _Delete)]
        if writes:
            self._put_batch(writes)
        if deletes:
            self._delete_batch(deletes)

    def _put_batch(self, writes: list[_Write]) -> None:
        plan: list[tuple[_Write, ChunkHeader, ArenaSlice]] = []
        for w in writes:
            try:
                crcs = [block_crc(w.wb.block(i)) for i in range(len(w.wb.keys))]
                h = make_header(self.namespace, w.wb.keys, crcs, self.block_bytes)
                encode_header(h, w.wb.buf.view)
                buf = self._arena.take(h.total_bytes)
                if buf is None:
                    self._write_result(w, False, FailureReason.NO_BUFFER)
                    continue
                buf.view[: h.total_bytes] = w.wb.buf.view[: h.total_bytes]
                plan.append((w, h, buf))
            except Exception as e:  # a bad key or namespace: the caller's bug, but never a dead thread
                logger.warning("kvtier mooncake: write of %s failed: %s", w.key, e)
                self._write_result(w, False, FailureReason.BAD_REQUEST)
            finally:
                w.wb.buf.close()
                with self._lock:
                    self._queued_writes -= 1
        if not plan:
            return
        if not self.breaker.allow():
            for w, _, buf in plan:
                buf.close()
                self._write_result(w, False, FailureReason.BREAKER_OPEN)
            return
        rcs = self._batch("batch_put_from", [w.key for w, _, _ in plan], [b.addr for _, _, b in plan],
                          [h.total_bytes for _, h, _ in plan], self._replicate)
        unhealthy = False
        for (w, h, buf), rc in zip(plan, rcs, strict=True):
            buf.close()
            reason = None if rc in (0, -705) else code_reason(rc)  # -705: already stored (same chunk id)
            unhealthy |= reason in _UNHEALTHY
            self._write_result(w, not reason, reason, h)
        self._record(unhealthy)

    def _write_result(self, w: _Write, ok: bool, reason: FailureReason | None, h: ChunkHeader | None = None) -> None:
        if not ok:
            logger.warning("kvtier mooncake: write of %s failed (%s)", w.key, reason)
        self._emit(IOResult(w.job_id, "write", w.chunk_id, ok, reason=reason, header=h if ok else None,
                            nbytes=h.total_bytes if ok and h is not None else 0,
                            seconds=time.perf_counter() - w.t0))

    def _delete_batch(self, deletes: list[_Delete]) -> None:
        rcs = self._batch("batch_remove", [d.key for d in deletes], force=True)
        for d, rc in zip(deletes, rcs, strict=True):
            reason = None if rc in (0, -704) else code_reason(rc)  # already gone is deleted
            if reason:
                logger.warning("kvtier mooncake: delete of %s failed (%s)", d.key, reason)
            self._emit(IOResult(-1, "delete", d.chunk_id, not reason, reason=reason))

    # ---- client calls --------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> int:
        """One client call returning a Mooncake code or size; an exception becomes -1."""
        self._count(method)
        try:
            return int(getattr(self._client, method)(*args))
        except Exception as e:
            logger.warning("kvtier mooncake: %s raised %s", method, e)
            return -1

    def _batch(self, method: str, keys: list[str], *args: Any, **kw: Any) -> list[int]:
        """One batch call; per-key codes or sizes (an exception fails every key with -1)."""
        self._count(method)
        try:
            rcs = [int(rc) for rc in getattr(self._client, method)(keys, *args, **kw)]
        except Exception as e:
            logger.warning("kvtier mooncake: %s of %d keys raised %s", method, len(keys), e)
            return [-1] * len(keys)
        if len(rcs) != len(keys):
            logger.warning("kvtier mooncake: %s returned %d codes for %d keys", method, len(rcs), len(keys))
            return [-1] * len(keys)
        return rcs

    def _count(self, method: str) -> None:
        with self._lock:
            self._requests[method] = self._requests.get(method, 0) + 1

    def _record(self, unhealthy: bool) -> None:
        if unhealthy:
            self.breaker.record_failure()
        else:
            self.breaker.record_success()

    def _emit(self, res: IOResult) -> None:
        if not res.ok:
            with self._lock:
                self._failures[str(res.reason)] = self._failures.get(str(res.reason), 0) + 1
        self._done.put(res)
        self._has_done.set()


def _check_id(chunk_id: str) -> None:
    if not SAFE_ID.match(chunk_id):
        raise ValueError(f"chunk id {chunk_id!r}: 1-128 of A-Z a-z 0-9 _ . -")


def _probe(host: str, port: int, timeout_s: float) -> None:
    """Fail fast when the master does not accept connections (setup would retry for 90 s)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConnectionError(f"mooncake master {host}:{port} is not reachable: {e}") from e


def _route_address(host: str) -> str:
    """The local address of the interface that routes to ``host`` (a UDP connect sends
    nothing; it only asks the kernel for the route)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
