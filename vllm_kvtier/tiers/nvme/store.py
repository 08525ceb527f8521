"""The NVMe tier's data path: chunk files in a directory, written and read by I/O threads.

Who calls it: the worker half (one store per TP rank), from the worker's main thread.
``submit_*`` return at once; completions come back through :meth:`NVMeStore.poll`. This is
the :class:`~vllm_kvtier.tiers.base.ChunkStore` contract. It is implemented once by
:class:`~vllm_kvtier.tiers.kernel.StoreKernel` (queues, deadlines, headers, verification).
This module is only the medium's byte primitives (:class:`NVMeMedium`) and the start-up
scan. The scheduler half only reads file headers at start-up (:func:`scan_dir`) to rebuild
its index.

Directory layout: ``<path>/<namespace>/r<rank>/<chunk_id>.kvt``. The ``namespace`` digests
everything that changes the bytes (model, dtype, geometry, TP size, format). So two
engines sharing a disk never read each other's KV. Directories are 0700 and files 0600.
They are checked and locked before use (one engine per rank directory): see
:mod:`~vllm_kvtier.tiers.nvme.dirs`. An MLA model's TP ranks share one directory, their TP
group's first rank's. That rank writes and locks it. The others read it through a
``replica`` store (no lock, no writes).

Crash safety: a chunk is written to ``.tmp-*`` in the same directory, fdatasync'ed, then
renamed into place. A file with the final name is always complete: its data was durable
before the rename existed. The directory is not fsync'ed after the rename. After a power
loss a rename may be lost, which is only a missing cache entry. Its ``.tmp-*`` file is
deleted at the next start. Skipping the fsync saves a journal commit per chunk (+15-20%
write throughput in bench/nvme_throughput.py). We chose rename over a preallocated slab
with a journal. Each chunk is large (many blocks, MiBs), so the per-file metadata cost is
small. Rename gives atomicity from the filesystem with no recovery code of our own. Every
block's CRC32 is in the header and is verified on every read; a mismatch is a miss. Only
regular files are opened. A FIFO or device named ``*.kvt`` is skipped, never waited on
(O_NONBLOCK and O_NOFOLLOW, then fstat). Every size in a header is bounded before it sizes
a read. A file with holes where its chunk should be (sparse) is ``truncated`` without
reading them.

I/O: O_DIRECT with page-aligned buffers when the filesystem accepts it. It is probed once
at start; the reason is logged when it does not. So a large cache does not push the rest
of the machine out of the page cache. Otherwise it uses buffered I/O followed by
``posix_fadvise(DONTNEED)``. The bytes themselves move through a swappable engine
(``nvme.io_engine``, :mod:`~vllm_kvtier.tiers.nvme.file_io`). It is ``pwrite``/``preadv``,
or NIXL's POSIX or GDS backend. Names, syncs, headers and checksums are this module's
whatever the engine. So every engine reads what any other wrote. Reads are served before
writes (the kernel's priority queue): a load is on a request's critical path, a store is
not. Queued writes are bounded. When the disk cannot keep up, new writes are refused
(counted), never queued without limit. A read not answered within ``read_deadline_s`` (a
hung disk or network filesystem) is a miss.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_kvtier.chunkformat import (
    ALIGN,
    FIXED_BYTES,
    MAX_CHUNK_BLOCKS,
    ChunkFormatError,
    ChunkHeader,
    align_up,
    bounded_header_bytes,
    decode_header,
)
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.base import ScanResult
from vllm_kvtier.tiers.buffers import shared_pool
from vllm_kvtier.tiers.kernel import KernelSettings, KernelStore, ReadShape, StoreKernel
from vllm_kvtier.tiers.nvme.dirs import (
    FILE_MODE,
    LOCK_NAME,
    RankDirLock,
    open_rank_dir,
    open_replica_dir,
    rank_dir_name,
)
from vllm_kvtier.tiers.nvme.file_io import FileIO, make_file_io

if TYPE_CHECKING:
    from vllm_kvtier.config.lower import NVMeTierConfig
    from vllm_kvtier.tiers.registry import StoreContext

__all__ = ["NVMeMedium", "NVMeStore", "classify", "other_bytes", "probe_direct_io", "rank_dir", "read_header",
           "scan_dir"]

logger = logging.getLogger(__name__)

SUFFIX = ".kvt"
#: A read of one chunk not done by then (a hung disk, a stalled network filesystem) is a
#: miss; generous, since a healthy NVMe read takes milliseconds.
DEFAULT_READ_DEADLINE_S = 30.0


def rank_dir(root: str | Path, namespace: str, rank: int, engine: int = 0) -> Path:
    """Rank ``rank``'s directory of data-parallel engine ``engine`` (see
    :func:`~vllm_kvtier.tiers.nvme.dirs.rank_dir_name`)."""
    return Path(root) / namespace / rank_dir_name(rank, engine)


class NotRegularFile(OSError):
    """A path where a chunk file should be that is not a regular file (FIFO, device, link)."""


def classify(e: BaseException) -> FailureReason:
    """The NVMe medium's classifier: the reason of a failed file operation, by type and errno."""
    if isinstance(e, ChunkFormatError):
        return e.reason
    if isinstance(e, NotRegularFile):
        return FailureReason.NOT_REGULAR
    if isinstance(e, FileNotFoundError):
        return FailureReason.MISSING
    if isinstance(e, OSError):
        return {
            errno.ENOSPC: FailureReason.DISK_FULL, errno.EDQUOT: FailureReason.DISK_FULL,
            errno.EACCES: FailureReason.PERMISSION, errno.EPERM: FailureReason.PERMISSION,
            errno.EROFS: FailureReason.READ_ONLY, errno.EIO: FailureReason.IO_ERROR,
            errno.ELOOP: FailureReason.NOT_REGULAR,
        }.get(e.errno or 0, FailureReason.OS_ERROR)
    return FailureReason.ERROR


def _open_regular(path: Path, flags: int) -> int:
    """Open ``path`` read-only, refusing anything but a regular file WITHOUT waiting on it:
    lstat first (O_DIRECT refuses a FIFO with EINVAL), then O_NONBLOCK (opening a FIFO that
    replaced it meanwhile never blocks), O_NOFOLLOW (no symlink), and fstat."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_no_hole(fd: int, start: int, end: int) -> None:
    """A hole in ``[start, end)`` (a sparse file) is ``truncated``: found with SEEK_HOLE,
    without reading the hole (a file system without SEEK_HOLE reports no hole)."""
    seek_hole = getattr(os, "SEEK_HOLE", None)
    if seek_hole is None or start >= end:
        return
    try:
        hole = os.lseek(fd, start, seek_hole)
    except OSError:
        return
    if hole < end:
        raise ChunkFormatError(f"truncated: a hole at byte {hole} (sparse file)", FailureReason.TRUNCATED)


def read_header(path: Path, namespace: str, *, max_blocks: int = MAX_CHUNK_BLOCKS,
                block_bytes: int | None = None, rank: int | None = None) -> ChunkHeader:
    """The verified header of one chunk file.

    Every size in it is bounded (``max_blocks``; ``block_bytes`` when given) before it
    sizes a read. A non-regular file is refused without waiting on it. A file shorter than
    its chunk, or with holes, is ``truncated``. With ``rank``, a header of another rank is
    ``key_mismatch``."""
    fd = _open_regular(path, 0)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, ALIGN, 0)
        if len(head) < FIXED_BYTES:
            raise ChunkFormatError("truncated header", FailureReason.TRUNCATED)
        need = bounded_header_bytes(head, max_blocks=max_blocks, block_bytes=block_bytes)
        if need > size:
            raise ChunkFormatError(f"truncated header: {size} of {need} bytes", FailureReason.TRUNCATED)
        if need > len(head):
            head += os.pread(fd, need - len(head), len(head))
        h = decode_header(head, namespace, rank=rank)
        if size < h.total_bytes:
            raise ChunkFormatError(f"truncated: {size} of {h.total_bytes} bytes", FailureReason.TRUNCATED)
        _check_no_hole(fd, 0, h.total_bytes)
        return h
    finally:
        os.close(fd)


#: :func:`scan_dir`'s problem for chunk files that could not be read (kept, not deleted).
UNREADABLE_KEPT = "unreadable_kept"


def scan_dir(directory: Path, namespace: str, *, cleanup: bool = False, max_blocks: int = MAX_CHUNK_BLOCKS,
             block_bytes: int | None = None, rank: int | None = None,
             refuses: Callable[[str, ChunkHeader], FailureReason | None] | None = None,
             kept: set[str] | None = None) -> tuple[dict[str, ChunkHeader], dict[str, int]]:
    """Read every chunk header in ``directory``.

    ``rank``: the directory's rank (a header of another is ``key_mismatch``); ``refuses``:
    why a header must not be indexed (the store's :meth:`~vllm_kvtier.tiers.kernel.StoreKernel.refuses`:
    not signed with an accepted key, a MAC that does not verify), or None.

    Returns ({chunk_id: header}, {problem: count}). With ``cleanup`` (the worker that owns
    the directory), leftover ``.tmp-*`` files of an interrupted write and files whose
    bytes fail to verify (bad magic, CRC, sizes, truncated: a ChunkFormatError) are
    deleted; the scheduler scans read-only. A file that could not be read (an OSError:
    EMFILE, EIO, EACCES...) may be good: it is skipped, never deleted, and counted as
    :data:`UNREADABLE_KEPT`. Entries that are not regular files are skipped
    (``not_regular``) and never opened, nor deleted. The ids of both go to ``kept`` when
    given: a chunk there is not known absent (a caller must not reclaim it as partial).
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
            if cleanup and e.is_file(follow_symlinks=False):
                _unlink_quietly(Path(e.path))
            continue
        if not e.name.endswith(SUFFIX):
            continue
        try:
            if not e.is_file(follow_symlinks=False):  # lstat: a FIFO is never opened
                raise NotRegularFile(errno.EINVAL, "not a regular file", e.path)
            fid = e.name[: -len(SUFFIX)]
            h = read_header(Path(e.path), namespace, max_blocks=max_blocks, block_bytes=block_bytes, rank=rank)
            why = refuses(fid, h) if refuses is not None else None
            if why is not None:  # what a read would refuse is never indexed (nor offered again)
                raise ChunkFormatError(f"not trusted: {why}", why)
            found[fid] = h
        except (OSError, ChunkFormatError) as err:
            reason: str = classify(err)
            damaged = isinstance(err, ChunkFormatError)
            if not damaged and not isinstance(err, NotRegularFile):
                reason = UNREADABLE_KEPT  # not read, so not known damaged: kept
            if not damaged and not isinstance(err, FileNotFoundError) and kept is not None:
                kept.add(e.name[: -len(SUFFIX)])  # present, maybe good (EMFILE, EIO...)
            problems[reason] = problems.get(reason, 0) + 1
            logger.warning("kvtier nvme: ignoring %s (%s): %s", e.path, reason, err)
            if damaged and cleanup:
                _unlink_quietly(Path(e.path))
    return found, problems


def other_bytes(directory: Path) -> int:
    """Bytes on disk in ``directory`` that are not chunk files nor leftovers of a write.

    Examples: the lock file, anything else someone put there. Each is rounded up to a 4 KiB
    block. The capacity bound must leave room for them, since this tier neither indexes nor
    deletes them. The lock file counts whether it exists yet or not (the store creates it)."""
    total = ALIGN  # the lock file
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return total
    for e in entries:
        if e.name.endswith(SUFFIX) or e.name.startswith(".tmp-") or e.name == LOCK_NAME:
            continue
        with contextlib.suppress(OSError):
            total += align_up(e.stat(follow_symlinks=False).st_size)
    return total


def _unlink_quietly(p: Path) -> None:
    with contextlib.suppress(OSError):
        p.unlink()


def probe_direct_io(directory: Path) -> tuple[bool, str]:
    """Whether O_DIRECT works here, and why not if it does not."""
    if not hasattr(os, "O_DIRECT"):
        return False, "O_DIRECT is not available on this platform"
    p = directory / f".tmp-probe-{uuid.uuid4().hex[:8]}"
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, FILE_MODE)
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


class NVMeMedium:
    """Chunk files in one directory: the byte primitives of the NVMe store (see the module
    doc). The bytes move through the ``nvme.io_engine`` (``io``); everything else (names,
    syncs, O_DIRECT, the regular-file and hole checks) is here, whatever the engine."""

    name = "nvme"
    #: one stride-aligned range per read (one I/O; O_DIRECT needs aligned offsets and lengths)
    read_shape: ReadShape = "span"

    def __init__(self, directory: Path, *, direct: bool, io: FileIO, lock: RankDirLock | None = None) -> None:
        """``lock``: the directory's lock, released by :meth:`close` (after the last I/O)."""
        self.dir = directory
        self.direct = direct
        self.io = io
        self._lock = lock

    def path(self, chunk_id: str) -> Path:
        return self.dir / f"{chunk_id}{SUFFIX}"

    def put(self, chunk_id: str, view: memoryview, deadline: float) -> None:
        """tmp file + write + fdatasync + rename: a file with the final name is complete."""
        tmp = self.dir / f".tmp-{chunk_id}-{uuid.uuid4().hex[:8]}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        try:
            fd = os.open(tmp, flags, FILE_MODE)
            try:
                os.fchmod(fd, FILE_MODE)  # whatever the umask (one syscall per chunk)
                self.io.write(fd, view, 0)
                os.fdatasync(fd)
                if not self.direct:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.rename(tmp, self.path(chunk_id))
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def read_into(self, chunk_id: str, offset: int, dst: memoryview, deadline: float) -> None:
        fd = _open_regular(self.path(chunk_id), os.O_DIRECT if self.direct else 0)
        try:
            end = offset + dst.nbytes
            size = os.fstat(fd).st_size
            if size < end:
                raise ChunkFormatError(f"truncated: {size} of {end} bytes", FailureReason.TRUNCATED)
            _check_no_hole(fd, offset, end)
            self.io.read_into(fd, dst, offset)
            if not self.direct:
                os.posix_fadvise(fd, offset, dst.nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def delete(self, chunk_id: str) -> None:
        _unlink_quietly(self.path(chunk_id))

    def classify(self, exc: BaseException) -> FailureReason:
        return classify(exc)

    def close(self) -> None:
        self.io.close()
        if self._lock is not None:
            self._lock.release()


class NVMeStore(KernelStore[NVMeMedium]):
    """The NVMe tier's :class:`~vllm_kvtier.tiers.base.ChunkStore` for one (namespace, rank),
    also :class:`~vllm_kvtier.tiers.base.Scannable`: the kernel over chunk files."""

    def __init__(self, section: NVMeTierConfig, ctx: StoreContext, *,
                 read_deadline_s: float = DEFAULT_READ_DEADLINE_S) -> None:
        """Blocks briefly: creates the rank directory (0700) or checks it, and takes its lock.

        Lock errors come from :mod:`~vllm_kvtier.tiers.nvme.dirs`: an OSError,
        ``UnsafeDirectory`` or ``DirectoryLocked``, naming the path and the reason. It then
        probes O_DIRECT, builds the I/O engine and starts the threads. ``section.io_engine``
        is a name of :data:`~vllm_kvtier.tiers.nvme.file_io.FILE_IO_ENGINES`. If it cannot
        run here, a ConfigError names ``nvme.io_engine``. ``section`` is ``cfg.nvme``. Its
        ``path``, ``direct_io``, ``io_threads``, ``max_queued_writes``, ``io_engine`` and
        ``chunk_blocks`` are used. ``chunk_blocks`` bounds a stored block count.
        ``ctx.buffers``: the worker's pool (None: the process default).

        ``ctx.replica``: this store only reads ``ctx.rank``'s directory, which another
        worker owns. That is an MLA model's TP rank reading its group's one copy, see
        :func:`~vllm_kvtier.tiers.nvme.dirs.open_replica_dir`. No lock is taken. Nothing is
        written there by this store's owner (its driver never submits writes or deletes).
        Reads are buffered unless ``direct_io`` is "on". No O_DIRECT probe file is written
        in a directory another process cleans. ``ctx.engine``: the data-parallel engine (its
        own directories, see :func:`rank_dir`). Chunk headers carry the rank alone."""
        medium = _open_medium(section, ctx)
        settings = KernelSettings(ctx.namespace, ctx.rank, ctx.block_bytes, section.chunk_blocks,
                                  read_deadline_s=read_deadline_s,
                                  io_threads=section.io_threads, max_queued_writes=section.max_queued_writes)
        kernel = StoreKernel(medium, settings, buffers=ctx.buffers or shared_pool(), auth=ctx.auth)
        super().__init__(medium, kernel)
        self.io_engine = section.io_engine
        self.replica = ctx.replica

    @classmethod
    def from_config(cls, section: NVMeTierConfig, ctx: StoreContext) -> NVMeStore:
        """The registry's constructor (:mod:`~vllm_kvtier.tiers.registry`)."""
        return cls(section, ctx)

    @property
    def dir(self) -> Path:
        """This store's rank directory."""
        return self.medium.dir

    @property
    def direct(self) -> bool:
        """Whether its I/O is O_DIRECT."""
        return self.medium.direct

    def path(self, chunk_id: str) -> Path:
        """Where the chunk's file is (for tools and fault drills)."""
        return self.medium.path(chunk_id)

    def scan(self, *, cleanup: bool = False) -> ScanResult:
        """Every verified chunk file of this store's directory (see :func:`scan_dir`)."""
        found, problems = scan_dir(self.dir, self.namespace, cleanup=cleanup, max_blocks=self.max_chunk_blocks,
                                   block_bytes=self.block_bytes, rank=self.rank, refuses=self.refuses)
        return ScanResult(found, problems)


def _open_medium(section: NVMeTierConfig, ctx: StoreContext) -> NVMeMedium:
    """The rank directory, created 0700 or checked (owner, mode, no symlink), then locked,
    O_DIRECT probed and the I/O engine built: :class:`NVMeStore`'s medium. Nothing in the
    directory is touched (not even the O_DIRECT probe) before the lock is held. On failure
    what was taken is given back."""
    io_engine, direct_io = section.io_engine, section.direct_io
    io = make_file_io(io_engine)
    lock: RankDirLock | None = None
    try:
        if ctx.replica:
            directory = open_replica_dir(section.path, ctx.namespace, ctx.rank, ctx.engine)
        else:
            directory, lock = open_rank_dir(section.path, ctx.namespace, ctx.rank, ctx.engine)
    except BaseException:
        io.close()
        raise
    try:
        if direct_io == "off":
            direct, why = False, "disabled by nvme.direct_io"
        elif ctx.replica and direct_io == "auto":
            direct, why = False, "a replica reader of another rank's directory"
        else:
            direct, why = probe_direct_io(directory)
            if not direct and direct_io == "on":
                raise OSError(f"nvme.direct_io is 'on' but O_DIRECT fails in {directory}: {why}")
    except BaseException:
        if lock is not None:
            lock.release()
        io.close()
        raise
    if direct:
        logger.info("kvtier nvme: %s, O_DIRECT, io_engine %s", directory, io_engine)
    elif ctx.replica:
        logger.info("kvtier nvme: %s, read-only replica, buffered reads (%s), io_engine %s", directory, why,
                    io_engine)
    else:
        logger.warning("kvtier nvme: %s, buffered I/O (O_DIRECT unavailable: %s), io_engine %s",
                       directory, why, io_engine)
    return NVMeMedium(directory, direct=direct, io=io, lock=lock)
