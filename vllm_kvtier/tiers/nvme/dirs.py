"""The NVMe tier's directories: created private, checked before use, locked per rank.

It also reports what other namespaces left under ``nvme.path``, and collects it on request.

Who calls it: :class:`~vllm_kvtier.tiers.nvme.store.NVMeStore` at construction (the worker of
each rank: :func:`open_rank_dir`). The scheduler's start-up scan calls :func:`lock_holder`:
is a rank directory held by another engine? Rank 0's worker calls it at start
(:func:`foreign_namespaces`, :func:`collect_namespace`). Everything here blocks briefly: a
few syscalls per directory, and the foreign report walks those directories once. Nothing
runs in the serving path.

Trust rules: stored KV can be inverted back into the prompt, and a planted chunk is
served. So every directory this tier creates is 0700 and every file 0600. This is set
explicitly (``chmod``/``fchmod``), whatever the umask. Before use:

* The **base path** (``nvme.path``) is resolved once (``realpath``). Symlinks in it are
  accepted (an operator's ``/mnt/nvme -> /data/nvme``), and the resolved path is logged. It
  must be a directory owned by this user or by root. It must not be writable by group or
  others, unless it has the sticky bit (``/tmp``-like: nobody else can rename what we
  create in it). Directories above it are not checked. Like ``ssh``'s StrictModes, it is
  the operator's machine.
* The **namespace** and **rank directories** below it are ours. Each must be a real
  directory (a symlink is refused), owned by this user, not writable by group or others.
  One that is not is refused (:class:`UnsafeDirectory`): the tier is off, serving goes on.
  One of ours that is only readable by others (0755, as older versions made them) is
  tightened to 0700.

Rank directories (:func:`rank_dir_name`): ``r<rank>`` for an engine without data parallelism
(and data-parallel engine 0), ``dp<engine>-r<rank>`` for data-parallel engine ``engine`` >= 1.
Each engine on a host has its own directories, lock, scan and capacity. So two
data-parallel engines sharing one ``nvme.path`` never index, bound or lock each other's
files.

Lock: :data:`LOCK_NAME` in each rank directory, ``flock(LOCK_EX | LOCK_NB)``, held until
the store closes. A second engine on the same directory gets :class:`DirectoryLocked` and
runs without its NVMe tier. It never scans, cleans or writes the first one's directory.
The lock file is never deleted by its owner: deleting a lock file races with another
process that opened it. It is a few bytes, counted in the tier's capacity. flock works
across processes on one host and, on Linux, on NFS (as a POSIX lock). A collector
(:func:`collect_namespace`) holds the locks of a namespace while it deletes its files. It
says so in the lock note. An engine starting on that namespace then waits for it (up to
:data:`_COLLECT_WAIT_S`). It then creates the directory again, rather than running without
its NVMe tier.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LOCK_NAME", "DirectoryLocked", "ForeignNamespace", "RankDirLock", "UnsafeDirectory", "collect_namespace",
    "foreign_namespaces", "lock_holder", "open_rank_dir", "open_replica_dir", "rank_dir_name", "unsafe_reason",
]

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
DIR_MODE = 0o700
FILE_MODE = 0o600
#: A namespace directory's name (:func:`vllm_kvtier.keys.namespace`: 16 hex digits).
NAMESPACE_NAME = re.compile(r"^[0-9a-f]{16}$")
#: A rank directory's name (:func:`rank_dir_name`).
RANK_NAME = re.compile(r"^(dp\d{1,6}-)?r\d{1,6}$")
#: How long :func:`open_rank_dir` retries a held lock: another engine's scheduler or
#: collector may probe it for microseconds (a shared probe), which is not an owner.
_LOCK_RETRY_S = 0.2
#: How long it waits while :func:`collect_namespace` holds the lock (its note says so): a
#: collection deletes every file of the namespace, seconds for a large one (about 20 us an
#: unlink: 250,000 chunks of a 1 TB namespace take 5 s), and an engine that gave up would
#: run without its NVMe tier for its whole life.
_COLLECT_WAIT_S = 120.0
#: Attempts at a rank directory that a collector deletes meanwhile (each one: create it again).
_LOCK_ATTEMPTS = 5
#: The first word of the lock note a collector writes.
_COLLECTING = "collecting"


def rank_dir_name(rank: int, engine: int = 0) -> str:
    """The directory of ``rank`` (within its engine) of data-parallel engine ``engine``:
    ``r<rank>``, or ``dp<engine>-r<rank>`` for ``engine`` >= 1 (engine 0 keeps the name an
    engine without data parallelism uses, so its files stay readable)."""
    return f"r{rank}" if engine == 0 else f"dp{engine}-r{rank}"


class UnsafeDirectory(OSError):
    """A directory of the tier that another user could write: refused (the tier is off)."""


class DirectoryLocked(OSError):
    """A rank directory held by another live engine: this engine runs without the tier."""


def _mkdir_private(path: Path) -> bool:
    """Create ``path`` as a 0700 directory; False if it exists already."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return False
    os.chmod(path, DIR_MODE)  # the umask may have taken bits off (never added); be explicit
    return True


def _check_base(base: Path) -> None:
    st = os.stat(base)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(errno.ENOTDIR, "nvme.path is not a directory", str(base))
    if st.st_uid not in (os.geteuid(), 0):
        raise UnsafeDirectory(errno.EPERM, f"nvme.path is owned by uid {st.st_uid}, not by this user "
                                           f"({os.geteuid()}) or root", str(base))
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(errno.EPERM, f"nvme.path is writable by group or others (mode "
                                           f"{stat.S_IMODE(st.st_mode):o}) without the sticky bit", str(base))


def _check_ours(path: Path, *, tighten: bool = True) -> None:
    """A namespace or rank directory: a real directory of this user, not writable by others
    (``tighten``: one only readable by others is made 0700)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectory(errno.ELOOP, "is a symlink (refused below nvme.path)", str(path))
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(errno.ENOTDIR, "is not a directory", str(path))
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(errno.EPERM, f"is owned by uid {st.st_uid}, not by this user ({os.geteuid()})",
                              str(path))
    if st.st_mode & 0o022:
        raise UnsafeDirectory(errno.EPERM, f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})",
                              str(path))
    if tighten and stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)  # ours, readable by others (an earlier version): tighten


def _make_base(base: Path) -> Path:
    """The resolved base path, creating its missing components 0700."""
    missing: list[Path] = []
    p = Path(os.path.abspath(base))
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        _mkdir_private(d)
    real = Path(os.path.realpath(base))
    _check_base(real)
    return real


class RankDirLock:
    """The exclusive flock on one rank directory, held until :meth:`release`."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._fd: int | None = fd

    def release(self) -> None:
        """Drop the lock (the file stays; see the module doc). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _open_lock_file(directory: Path) -> int:
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC,
                 FILE_MODE)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeDirectory(errno.EINVAL, "lock file is not a regular file", str(directory / LOCK_NAME))
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _holder_text(directory: Path) -> str:
    try:
        with open(directory / LOCK_NAME, encoding="ascii", errors="replace") as f:
            return f.read(200).strip() or "unknown"
    except OSError:
        return "unknown"


def open_rank_dir(root: str | Path, namespace: str, rank: int, engine: int = 0) -> tuple[Path, RankDirLock]:
    """Create (0700) or check ``<root>/<namespace>/<rank_dir_name(rank, engine)>`` and take
    its lock.

    Raises :class:`UnsafeDirectory` (naming the path and the reason: see the module doc),
    :class:`DirectoryLocked` (another engine holds it: its pid and host in the message), or
    another OSError (the directory cannot be created). Nothing in the directory is touched
    before the lock is held."""
    base = _make_base(Path(root))
    ns_dir = base / namespace
    rank_dir = ns_dir / rank_dir_name(rank, engine)
    start = time.monotonic()
    for attempt in range(_LOCK_ATTEMPTS):
        try:
            for d in (ns_dir, rank_dir):
                if not _mkdir_private(d):
                    _check_ours(d)
            fd = _open_lock_file(rank_dir)
        except FileNotFoundError:  # removed by a collector between two steps: again
            if attempt + 1 == _LOCK_ATTEMPTS:
                raise
            continue
        try:
            _lock_or_wait(fd, rank_dir, start)
            # a collector may have deleted the directory while this waited: the lock is
            # ours only if the file locked is still the one at the path
            st, now = os.fstat(fd), os.stat(rank_dir / LOCK_NAME, follow_symlinks=False)
            if (st.st_ino, st.st_dev) == (now.st_ino, now.st_dev):
                break
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    else:
        raise DirectoryLocked(errno.EBUSY, "its lock file was replaced at every attempt", str(rank_dir))
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()} since {int(time.time())}\n".encode(), 0)
    except OSError as e:  # the lock holds without its note (a full disk)
        logger.warning("kvtier nvme: cannot write the lock note in %s: %s", rank_dir, e)
    if base != Path(os.path.abspath(root)):
        logger.info("kvtier nvme: nvme.path %s resolves to %s", root, base)
    return rank_dir, RankDirLock(rank_dir, fd)


def _lock_or_wait(fd: int, rank_dir: Path, start: float) -> None:
    """Take ``fd``'s exclusive lock: retried for :data:`_LOCK_RETRY_S` (a probe), and for
    up to :data:`_COLLECT_WAIT_S` while a collector holds it; else :class:`DirectoryLocked`."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = _holder_text(rank_dir)
            waited = time.monotonic() - start
            if waited < _LOCK_RETRY_S or (holder.startswith(_COLLECTING) and waited < _COLLECT_WAIT_S):
                time.sleep(0.02)
                continue
            raise DirectoryLocked(errno.EBUSY, f"held by another engine ({holder}); two engines "
                                               "must not share one NVMe directory", str(rank_dir)) from None


def open_replica_dir(root: str | Path, namespace: str, rank: int, engine: int = 0) -> Path:
    """Create (0700) or check ``<root>/<namespace>/<rank_dir_name(rank, engine)>`` for a
    worker that only READS it.

    That worker is a TP rank of an MLA model. Its latent cache is identical on every rank of
    its TP group, and is written once, by the group's first rank. ``rank`` here is that
    writer's store rank. Same checks as :func:`open_rank_dir`, but its directories are never
    tightened here: the writer does that. No lock is taken: the writer holds it, and that
    lock refuses a second engine on the directory. Raises :class:`UnsafeDirectory` or
    another OSError."""
    base = _make_base(Path(root))
    ns_dir = base / namespace
    rank_dir = ns_dir / rank_dir_name(rank, engine)
    for d in (ns_dir, rank_dir):
        if not _mkdir_private(d):
            _check_ours(d, tighten=False)
    return rank_dir


def unsafe_reason(root: str | Path, namespace: str, rank: int, engine: int = 0) -> str | None:
    """Why :func:`open_rank_dir` would refuse this rank directory, checked without changing
    anything (the scheduler's start-up scan: it does not index what the worker will
    refuse); None when it would not, or when the directories do not exist yet."""
    try:
        base = Path(os.path.realpath(root))
        if not base.exists():
            return None
        _check_base(base)
        for d in (base / namespace, base / namespace / rank_dir_name(rank, engine)):
            if not os.path.lexists(d):
                return None
            _check_ours(d, tighten=False)
    except UnsafeDirectory as e:
        return str(e)
    except OSError:
        return None  # the worker will say what is wrong
    return None


def uncreatable_reason(root: str | Path, namespace: str, rank: int, engine: int = 0) -> str | None:
    """Why :func:`open_rank_dir` could not create this rank directory or its lock file.

    It is checked without changing anything. It is the scheduler's start-up check, so that
    it plans no write the worker cannot make. The deepest existing part of the path must be
    a directory this process may write into. None when it is."""
    want = Path(os.path.abspath(root)) / namespace / rank_dir_name(rank, engine)
    p = want
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    try:
        st = os.stat(p)
    except OSError as e:
        return f"cannot create {want}: {p}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"cannot create {want}: {p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return f"cannot create {want}: {p} is not writable by this user"
    return None


def lock_holder(directory: Path) -> str | None:
    """Who holds ``directory``'s lock now (the note its owner wrote), or None when nobody
    does (or there is no lock file). A shared probe that does not block, and creates
    nothing."""
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder_text(directory)
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# ---- other namespaces under nvme.path --------------------------------------------------

def _ours(name: str) -> bool:
    """A file name this tier writes in a rank directory."""
    return name.endswith(".kvt") or name.startswith(".tmp-") or name == LOCK_NAME


@dataclass(frozen=True)
class ForeignNamespace:
    """A namespace directory under ``nvme.path`` other than this engine's."""

    path: Path
    #: bytes of this tier's files in it
    nbytes: int
    files: int
    #: seconds since its newest file was modified (None: no file)
    newest_age_s: float | None
    #: why it cannot be collected ("" if it can): a live engine holds it, or it holds
    #: entries this tier never writes
    keep_reason: str


def _rank_dirs(ns_dir: Path) -> tuple[list[Path], str]:
    st = os.lstat(ns_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return [], "not a directory of this user"
    ranks: list[str] = []
    other: list[str] = []
    for e in os.scandir(ns_dir):
        (ranks if RANK_NAME.match(e.name) and e.is_dir(follow_symlinks=False) else other).append(e.name)
    why = f"holds entries this tier never writes ({', '.join(sorted(other)[:3])})" if other else ""
    return [ns_dir / r for r in sorted(ranks)], why


def foreign_namespaces(root: str | Path, own: set[str]) -> list[ForeignNamespace]:
    """Namespace directories under ``root`` (names of 16 hex digits) other than ``own``,
    with what they hold. Reads only (stat and a shared lock probe per rank directory)."""
    out: list[ForeignNamespace] = []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return out
    now = time.time()
    for e in entries:
        if not NAMESPACE_NAME.match(e.name) or e.name in own or not e.is_dir(follow_symlinks=False):
            continue
        ns_dir = Path(e.path)
        try:
            ranks, keep = _rank_dirs(ns_dir)
            nbytes = files = 0
            newest: float | None = None
            for rd in ranks:
                if not keep and (holder := lock_holder(rd)) is not None:
                    keep = f"held by a live engine ({holder})"
                for f in os.scandir(rd):
                    if not f.is_file(follow_symlinks=False):
                        continue
                    if not _ours(f.name):
                        keep = keep or f"holds files this tier never writes ({f.name})"
                        continue
                    st = f.stat(follow_symlinks=False)
                    nbytes += st.st_size
                    files += 1
                    newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
        except OSError as err:
            logger.warning("kvtier nvme: cannot inspect %s: %s", ns_dir, err)
            continue
        out.append(ForeignNamespace(ns_dir, nbytes, files, None if newest is None else max(0.0, now - newest), keep))
    return out


def collect_namespace(ns: ForeignNamespace) -> int:
    """Delete a foreign namespace directory's files, then its directories; the bytes freed.

    It deletes only what :func:`foreign_namespaces` found collectable. It does so only if
    every rank directory's lock can be taken now: an engine that started meanwhile keeps
    its directory. Only this tier's file names are deleted. A directory that still holds
    anything else is left in place."""
    if ns.keep_reason:
        return 0
    ranks, keep = _rank_dirs(ns.path)
    if keep:
        return 0
    locks: list[int] = []
    freed = 0
    try:
        for rd in ranks:
            try:
                fd = os.open(rd / LOCK_NAME, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # written before locks existed, or never used
            locks.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("kvtier nvme: %s: an engine started on it meanwhile; kept", ns.path)
                return 0
            # an engine starting on it now waits for this, rather than running without NVMe
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{_COLLECTING} by pid {os.getpid()} host {socket.gethostname()}\n".encode(), 0)
        for rd in ranks:
            for f in os.scandir(rd):
                if _ours(f.name) and f.name != LOCK_NAME and f.is_file(follow_symlinks=False):
                    size = f.stat(follow_symlinks=False).st_size
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f.path)
                        freed += size
        for rd in ranks:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(rd / LOCK_NAME)
            with contextlib.suppress(OSError):
                os.rmdir(rd)
        with contextlib.suppress(OSError):
            os.rmdir(ns.path)
    finally:
        for fd in locks:
            os.close(fd)
    return freed
