"""The NVMe tier's data path: chunk files in a directory, written and read by I/O threads.

Who calls it: the worker half (one store per TP rank), from the worker's main thread;
``submit_*`` return at once, completions come back through :meth:`NVMeStore.poll`. The
scheduler half only reads file headers at start-up (:func:`scan_dir`) to rebuild its index.

Directory layout: ``<path>/<namespace>/r<rank>/<file_id>.kvt`` where ``namespace`` digests
everything that changes the bytes (model, dtype, geometry, TP size, format), so two
engines sharing a disk never read each other's KV.

Crash safety: a chunk is written to ``.tmp-*`` in the same directory, fdatasync'ed, then
renamed into place: a file with the final name is always complete, because its data was
durable before the rename existed. The directory is not fsync'ed after the rename: after a
power loss a rename may be lost, which is only a missing cache entry (its ``.tmp-*`` file
is deleted at the next start), and skipping it saves a journal commit per chunk (+15-20%
write throughput in bench/nvme_throughput.py). We chose rename over a preallocated slab with a journal because each chunk is
large (many blocks, MiBs), so the per-file metadata cost is small, and rename gives
atomicity from the filesystem with no recovery code of our own. Every block's CRC32 is in
the header and is verified on every read; a mismatch is a miss.

I/O: O_DIRECT with page-aligned buffers when the filesystem accepts it (probed once at
start; the reason is logged when it does not), so a large cache does not push the rest of
the machine out of the page cache; otherwise buffered I/O followed by
``posix_fadvise(DONTNEED)``. The bytes themselves move through a swappable engine
(``nvme.io_engine``, :mod:`~vllm_kvtier.tiers.file_io`: ``pwrite``/``preadv``, or NIXL's
POSIX or GDS backend); names, syncs, headers and checksums are this module's whatever the
engine, so every engine reads what any other wrote. Reads are served before writes (a priority queue): a load is
on a request's critical path, a store is not. Queued writes are bounded; when the disk
cannot keep up, new writes are refused (counted), never queued without limit.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import mmap
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from vllm_kvtier.tiers.chunkfile import (
    ALIGN,
    ChunkFormatError,
    ChunkHeader,
    align_up,
    block_crc,
    decode_header,
    encode_header,
    header_bytes_for,
    make_header,
)
from vllm_kvtier.tiers.file_io import FileIO, make_file_io

logger = logging.getLogger(__name__)

SUFFIX = ".kvt"

IOKind = Literal["read", "write", "delete"]


def rank_dir(root: str | Path, namespace: str, rank: int) -> Path:
    return Path(root) / namespace / f"r{rank}"


def error_reason(e: BaseException) -> str:
    """A short, stable label for a failure (used in counters and logs)."""
    if isinstance(e, ChunkFormatError):
        return e.reason
    if isinstance(e, FileNotFoundError):
        return "missing"
    if isinstance(e, OSError):
        return {
            errno.ENOSPC: "disk_full", errno.EDQUOT: "disk_full", errno.EACCES: "permission",
            errno.EPERM: "permission", errno.EROFS: "read_only", errno.EIO: "io_error",
        }.get(e.errno or 0, "os_error")
    return "error"


def read_header(path: Path, namespace: str) -> ChunkHeader:
    with open(path, "rb", buffering=0) as f:
        head = f.read(ALIGN)
        if len(head) < 64:
            raise ChunkFormatError("truncated header")
        # The fixed part says how long the whole header is. It is not verified yet, so
        # bound it by the file's size: a garbage count must not size a huge read.
        nblocks = int.from_bytes(head[28:32], "little")
        need = header_bytes_for(nblocks)
        size = os.fstat(f.fileno()).st_size
        if need > size:
            raise ChunkFormatError(f"truncated header: {size} of {need} bytes")
        if need > len(head):
            head += f.read(need - len(head))
        h = decode_header(head, namespace)
    if size < h.total_bytes:
        raise ChunkFormatError(f"truncated: {size} of {h.total_bytes} bytes")
    return h


def scan_dir(directory: Path, namespace: str, *, cleanup: bool = False) -> tuple[dict[str, ChunkHeader], dict[str, int]]:
    """Read every chunk header in ``directory``.

    Returns ({file_id: header}, {problem: count}). With ``cleanup`` (the worker that owns
    the directory), leftover ``.tmp-*`` files of an interrupted write and files that fail
    to verify are deleted; the scheduler scans read-only.
    """
    found: dict[str, ChunkHeader] = {}
    problems: dict[str, int] = {}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return found, problems
    for e in entries:
        if e.name.startswith(".tmp-"):
            problems["partial_write"] = problems.get("partial_write", 0) + 1
            if cleanup:
                _unlink_quietly(Path(e.path))
            continue
        if not e.name.endswith(SUFFIX):
            continue
        try:
            found[e.name[: -len(SUFFIX)]] = read_header(Path(e.path), namespace)
        except (OSError, ChunkFormatError) as err:
            reason = error_reason(err)
            problems[reason] = problems.get(reason, 0) + 1
            logger.warning("kvtier nvme: ignoring %s: %s", e.path, err)
            if cleanup:
                _unlink_quietly(Path(e.path))
    return found, problems


def _unlink_quietly(p: Path) -> None:
    with contextlib.suppress(OSError):
        p.unlink()


def drain(q: queue.SimpleQueue[IOResult]) -> list[IOResult]:
    """Everything queued right now, without waiting (completion queues of the stores)."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def probe_direct_io(directory: Path) -> tuple[bool, str]:
    """Whether O_DIRECT works here, and why not if it does not."""
    if not hasattr(os, "O_DIRECT"):
        return False, "O_DIRECT is not available on this platform"
    p = directory / f".tmp-probe-{uuid.uuid4().hex[:8]}"
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return True, "ok"
    except OSError as e:
        return False, f"{e.strerror} (errno {e.errno})"
    finally:
        buf.close()
        _unlink_quietly(p)


class AlignedBuffer:
    """Page-aligned host memory for O_DIRECT (anonymous mmap), viewed as bytes.

    With a ``pool``, :meth:`close` hands the memory back to it for reuse instead of
    unmapping it (unless a slice of it is still alive somewhere).
    """

    def __init__(self, nbytes: int, pool: BufferPool | None = None) -> None:
        self.nbytes = align_up(max(nbytes, 1))
        self._map = mmap.mmap(-1, self.nbytes)
        self.view = memoryview(self._map)
        self._pool = pool
        #: False once the buffer came back from a pool: its bytes are a previous user's.
        self.fresh = True
        self._in_pool = False

    def close(self) -> None:
        if self._in_pool:  # closed twice: it is already idle in the pool
            return
        try:
            self.view.release()
        except BufferError:  # a caller exported the view itself; the GC frees the map later
            return
        pool, self._pool = self._pool, None
        if pool is not None and not self._map.closed and not self._exported():
            self.view = memoryview(self._map)
            if pool.give(self):
                return
            self.view.release()
        with contextlib.suppress(BufferError):  # a caller still holds a slice; the GC frees the map later
            self._map.close()

    def _exported(self) -> bool:
        """Whether a slice of the memory is still alive somewhere (then it must not be reused).
        A resize to the same size is a no-op mremap that mmap refuses while it has exports."""
        try:
            self._map.resize(self.nbytes)
            return False
        except BufferError:
            return True
        except (OSError, SystemError, TypeError, ValueError):  # no mremap here: never reuse
            return True


class BufferPool:
    """Idle :class:`AlignedBuffer` s kept for reuse, at most ``max_idle_bytes`` of them.

    Why: fresh anonymous memory is zeroed page by page by the kernel on first touch. On a
    2-vCPU VM that was ~1.7 GB/s (against ~16 GB/s to rewrite memory already mapped), so a
    new 32 MiB buffer per chunk cost more than reading the chunk from the disk (a read
    into a fresh buffer ran at half the speed of one into a reused buffer). Write buffers
    (filled by the caller) and read buffers (filled by the I/O threads) both come from here;
    a buffer is reused for any request of at least half its size.
    """

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._free: list[AlignedBuffer] = []
        self._idle = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> AlignedBuffer:
        need = align_up(max(nbytes, 1))
        with self._lock:
            fits = [b for b in self._free if need <= b.nbytes <= 2 * need]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self._free.remove(buf)
                self._idle -= buf.nbytes
                buf._pool, buf._in_pool = self, False
                return buf
        return AlignedBuffer(need, pool=self)

    def give(self, buf: AlignedBuffer) -> bool:
        with self._lock:
            if self._idle + buf.nbytes > self.max_idle_bytes:
                return False
            buf.fresh, buf._in_pool = False, True
            self._free.append(buf)
            self._idle += buf.nbytes
            return True

    def clear(self) -> None:
        with self._lock:
            free, self._free, self._idle = self._free, [], 0
        for b in free:
            b._in_pool = False
            b.close()


#: Shared by every store in the process (one per worker): bounded, so it holds at most
#: a few chunks' worth of idle memory.
BUFFERS = BufferPool(256 << 20)


@dataclass
class WriteBuffer:
    """A chunk being assembled by the caller: fill ``block(i)`` for every key, then submit."""

    keys: list[bytes]
    block_bytes: int
    buf: AlignedBuffer = field(init=False)
    header_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.header_bytes = header_bytes_for(len(self.keys))
        stride = align_up(self.block_bytes)
        self.buf = BUFFERS.take(self.header_bytes + len(self.keys) * stride)
        if not self.buf.fresh and stride != self.block_bytes:
            for i in range(len(self.keys)):  # the padding is written too: no stale bytes on disk
                off = self.header_bytes + i * stride
                self.buf.view[off + self.block_bytes : off + stride] = bytes(stride - self.block_bytes)

    def block(self, i: int) -> memoryview:
        off = self.header_bytes + i * align_up(self.block_bytes)
        return self.buf.view[off : off + self.block_bytes]


class Releasable(Protocol):
    """Memory behind a read result: an :class:`AlignedBuffer`, or a slice of a store's own
    registered arena (:mod:`~vllm_kvtier.tiers.mooncake`). ``close`` gives it back."""

    def close(self) -> None: ...


@dataclass
class IOResult:
    job_id: int
    kind: IOKind
    file_id: str
    ok: bool
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    header: ChunkHeader | None = None
    #: reads: the verified bytes of each requested position (same order), else None.
    blocks: list[memoryview] | None = None
    #: reads: the buffer behind ``blocks``; :meth:`release` returns it to the pool for
    #: reuse, so copy the blocks out before releasing and keep no view of them after.
    buffer: Releasable | None = None

    def release(self) -> None:
        if self.blocks is not None:
            for b in self.blocks:
                b.release()
            self.blocks = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


_PRIORITY = {"read": 0, "write": 1, "delete": 2}


class NVMeStore:
    def __init__(
        self, root: str | Path, namespace: str, rank: int, block_bytes: int, *,
        direct_io: Literal["auto", "on", "off"] = "auto", io_threads: int = 2, max_queued_writes: int = 64,
        io_engine: str = "posix",
    ) -> None:
        """Blocks briefly: creates the directory, probes O_DIRECT, builds the I/O engine
        (``io_engine``: a name of :data:`~vllm_kvtier.tiers.file_io.FILE_IO_ENGINES`;
        ConfigError naming ``nvme.io_engine`` if it cannot run here), starts the threads."""
        self._io: FileIO = make_file_io(io_engine)
        self.io_engine = io_engine
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.dir = rank_dir(root, namespace, rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        if direct_io == "off":
            self.direct, why = False, "disabled by nvme.direct_io"
        else:
            self.direct, why = probe_direct_io(self.dir)
            if not self.direct and direct_io == "on":
                raise OSError(f"nvme.direct_io is 'on' but O_DIRECT fails in {self.dir}: {why}")
        if self.direct:
            logger.info("kvtier nvme: %s, O_DIRECT, io_engine %s", self.dir, io_engine)
        else:
            logger.warning("kvtier nvme: %s, buffered I/O (O_DIRECT unavailable: %s), io_engine %s",
                           self.dir, why, io_engine)
        self.max_queued_writes = max_queued_writes
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._done: queue.SimpleQueue[IOResult] = queue.SimpleQueue()
        self._has_done = threading.Event()
        self._seq = itertools.count()
        self._queued_writes = 0
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"kvtier-nvme-{i}", daemon=True) for i in range(io_threads)
        ]
        for t in self._threads:
            t.start()

    # ---- submission (caller's thread; never blocks) -----------------------------

    def path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}{SUFFIX}"

    def submit_write(self, job_id: int, file_id: str, wb: WriteBuffer) -> bool:
        """Queue a chunk write. False (and nothing queued) if too many writes wait."""
        with self._lock:
            if self._closed or self._queued_writes >= self.max_queued_writes:
                return False
            self._queued_writes += 1
        self._queue.put((_PRIORITY["write"], next(self._seq), ("write", job_id, file_id, wb)))
        return True

    def submit_read(self, job_id: int, file_id: str, header: ChunkHeader, positions: list[int]) -> None:
        self._queue.put((_PRIORITY["read"], next(self._seq), ("read", job_id, file_id, (header, positions))))

    def submit_delete(self, file_id: str) -> None:
        self._queue.put((_PRIORITY["delete"], next(self._seq), ("delete", -1, file_id, None)))

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until some I/O has completed (True) or not.

        For idle engine steps only: while a request waits for its NVMe load, an in-process
        engine spins through empty steps that hold the GIL; waiting here hands it to the
        I/O threads (measured: a 2 MiB read went from ~100 ms to ~3 ms)."""
        done = self._has_done.wait(timeout_s)
        self._has_done.clear()
        return done

    def poll(self) -> list[IOResult]:
        return drain(self._done)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued I/O (up to ``timeout_s``) and stop the threads."""
        with self._lock:
            self._closed = True
        for _ in self._threads:
            self._queue.put((9, next(self._seq), None))
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if not any(t.is_alive() for t in self._threads):  # else a thread may still be in a transfer
            self._io.close()

    # ---- I/O threads ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            _, _, item = self._queue.get()
            if item is None:
                return
            kind, job_id, file_id, arg = item
            t0 = time.perf_counter()
            try:
                if kind == "write":
                    res = self._write(job_id, file_id, arg)
                elif kind == "read":
                    res = self._read(job_id, file_id, *arg)
                else:
                    _unlink_quietly(self.path(file_id))
                    res = IOResult(job_id, "delete", file_id, True)
            except Exception as e:  # every failure becomes a result, never a dead thread
                if not isinstance(e, (OSError, ChunkFormatError)):
                    logger.exception("kvtier nvme: unexpected %s error on %s", kind, file_id)
                res = IOResult(job_id, kind, file_id, False, reason=error_reason(e))
                logger.warning("kvtier nvme: %s of %s failed: %s", kind, file_id, e)
            finally:
                if kind == "write":
                    with self._lock:
                        self._queued_writes -= 1
            res.seconds = time.perf_counter() - t0
            self._done.put(res)
            self._has_done.set()

    def _write(self, job_id: int, file_id: str, wb: WriteBuffer) -> IOResult:
        crcs = [block_crc(wb.block(i)) for i in range(len(wb.keys))]
        h = make_header(self.namespace, wb.keys, crcs, self.block_bytes)
        encode_header(h, wb.buf.view)
        final = self.path(file_id)
        tmp = self.dir / f".tmp-{file_id}-{uuid.uuid4().hex[:8]}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        try:
            fd = os.open(tmp, flags, 0o644)
            try:
                with wb.buf.view[: h.total_bytes] as view:
                    self._io.write(fd, view, 0)
                os.fdatasync(fd)
                if not self.direct:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        finally:
            wb.buf.close()
        return IOResult(job_id, "write", file_id, True, nbytes=h.total_bytes, header=h)

    def _read(self, job_id: int, file_id: str, header: ChunkHeader, positions: list[int]) -> IOResult:
        lo, hi = min(positions), max(positions)
        start = header.block_offset(lo)  # aligned: header and stride are multiples of ALIGN
        length = header.block_offset(hi) + header.stride - start
        buf = BUFFERS.take(length)
        try:
            fd = os.open(self.path(file_id), os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
            try:
                with buf.view[:length] as dst:
                    self._io.read_into(fd, dst, start)
                if not self.direct:
                    os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            blocks: list[memoryview] = []
            for p in positions:
                off = header.block_offset(p) - start
                b = buf.view[off : off + header.block_bytes]
                if block_crc(b) != header.crcs[p]:
                    b.release()
                    for x in blocks:
                        x.release()
                    raise ChunkFormatError(f"block {p} checksum mismatch")
                blocks.append(b)
        except BaseException:
            buf.close()
            raise
        return IOResult(job_id, "read", file_id, True, nbytes=length, blocks=blocks, buffer=buf)


def file_id_for(keys: Iterable[bytes]) -> str:
    """Chunk file name: the first key (a chained hash naming the whole prefix) plus a
    random suffix, so a re-written chunk never collides with a file being deleted."""
    first = next(iter(keys))
    return f"{first.hex()[:32]}-{uuid.uuid4().hex[:8]}"
