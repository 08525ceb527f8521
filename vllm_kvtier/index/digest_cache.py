"""The ``full`` weights fingerprint's content hashes: each weight file's SHA-256, kept
per host in a small cache (:class:`DigestCache`) so an unchanged file is read once."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from vllm_kvtier.index.model_files import FileState, file_state

#: Bytes per read while hashing a whole file.
HASH_CHUNK_BYTES = 1 << 20
#: Files hashed at once (hashlib releases the GIL: threads use several cores).
HASH_THREADS = 4
#: The digest cache's file in its directory, and its bounds: a bigger file, or more
#: entries, is not read (the cache is rebuilt); entries beyond the bound are dropped oldest first.
CACHE_FILE = "weights-digests.json"
MAX_CACHE_BYTES = 4 << 20
MAX_CACHE_ENTRIES = 4096

logger = logging.getLogger("vllm_kvtier")


def hash_file(path: Path) -> tuple[str, int, int]:
    """SHA-256 of ``path``'s whole content: (hex, bytes read, read calls)."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buf)
    n_bytes = reads = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            reads += 1
            if not n:
                break
            h.update(view[:n])
            n_bytes += n
    return h.hexdigest(), n_bytes, reads


class DigestCache:
    """This host's content hashes of weight files, in ``directory/``:data:`CACHE_FILE`.

    The file is data another process wrote. It is read only if it is a regular file of at
    most :data:`MAX_CACHE_BYTES` (not through a symlink). Each entry is type-checked and
    dropped if malformed. An entry is used only when the file's current state is the one it
    was hashed in. The state is the resolved path, size, mtime_ns, ctime_ns, inode and
    device. Whoever can write this directory can make this host use a wrong hash. It is the
    user's own cache directory (0700, the file 0600). One owned by another user or writable
    by others is not used. So it is no wider than the weights and the code it runs.
    Unusable (no such directory and none can be made, read-only, no ``flock``): every call
    is a miss and nothing is saved. :func:`fingerprint_weights` holds an exclusive
    ``flock`` on it while it hashes. So one process of a host hashes and the others wait
    for its result."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.entries: dict[str, tuple[FileState, str]] = {}
        self._lock_fd: int | None = None

    def __enter__(self) -> DigestCache:
        fd = None
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.stat(self.directory)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise PermissionError("not owned by this user, or writable by others")
            fd = os.open(self.directory / (CACHE_FILE + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by close
        except OSError as e:
            if fd is not None:
                os.close(fd)
            logger.info("kvtier: no weights digest cache in %s (%s): the weights are hashed at every start",
                        self.directory, e)
            return self
        self._lock_fd = fd
        self.entries = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _read(self) -> dict[str, tuple[FileState, str]]:
        try:
            fd = os.open(self.directory / CACHE_FILE, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return {}
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CACHE_BYTES:
                return {}
            raw = f.read(MAX_CACHE_BYTES + 1)
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            return {}
        items = doc.get("files") if isinstance(doc, dict) and doc.get("version") == 1 else None
        if not isinstance(items, list):
            return {}
        out: dict[str, tuple[FileState, str]] = {}
        for item in items[:MAX_CACHE_ENTRIES]:
            if (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                    and isinstance(item[1], list) and len(item[1]) == 5
                    and all(type(v) is int and v >= 0 for v in item[1])
                    and isinstance(item[2], str) and len(item[2]) == 64
                    and all(c in "0123456789abcdef" for c in item[2])):
                out[item[0]] = (tuple(item[1]), item[2])  # type: ignore[assignment]
        return out

    def get(self, path: str, state: FileState) -> str | None:
        hit = self.entries.get(path)
        return hit[1] if hit is not None and hit[0] == state else None

    def put(self, path: str, state: FileState, digest: str) -> None:
        self.entries.pop(path, None)  # newest last: the bound drops the oldest
        self.entries[path] = (state, digest)

    def save(self) -> None:
        """Write the entries back (atomically: a new file renamed over the old)."""
        if self._lock_fd is None:
            return
        items = [[p, list(st), d] for p, (st, d) in list(self.entries.items())[-MAX_CACHE_ENTRIES:]]
        blob = json.dumps({"version": 1, "files": items})
        while len(blob) > MAX_CACHE_BYTES:  # long paths: drop the oldest until it reads back
            items = items[len(items) // 4 + 1:]
            blob = json.dumps({"version": 1, "files": items})
        tmp = self.directory / f".{CACHE_FILE}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(blob)
            os.replace(tmp, self.directory / CACHE_FILE)
        except OSError as e:
            logger.info("kvtier: weights digest cache not saved in %s: %s", self.directory, e)
            with contextlib.suppress(OSError):
                tmp.unlink()


def content_hashes(weights: list[Path], cache_dir: Path | None) -> tuple[list[str], int, int, int]:
    """The content hash of each file of ``weights``.

    A hash comes from the cache where the file's state is the cached one. Else the file is
    read. Returns (hashes, bytes hashed, read calls, files from the cache). Each file's
    hash is saved as soon as it is known. A start may be killed mid-hash (a ready timeout
    on a large model). It then leaves the finished files cached, and the next start hashes
    only the rest. The first error of a file is raised once every other file is done."""
    with DigestCache(cache_dir) if cache_dir is not None else contextlib.nullcontext() as cache:
        keys = [str(p.resolve()) for p in weights]
        states = [file_state(os.stat(k)) for k in keys]
        hashes: list[str | None] = [cache.get(k, st) if cache is not None else None
                                    for k, st in zip(keys, states, strict=True)]
        todo = [i for i, d in enumerate(hashes) if d is None]
        n_bytes = reads = 0
        error: BaseException | None = None
        with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(todo)))) as pool:
            futures = {pool.submit(hash_file, Path(keys[i])): i for i in todo}
            for fut in as_completed(futures):
                i = futures[fut]
                try:
                    digest, n, r = fut.result()
                except Exception as e:  # raised below, once the other files are done
                    error = error or e
                    continue
                hashes[i] = digest
                n_bytes += n
                reads += r
                # a file written while it was read: its hash is used once, never cached
                if cache is not None and file_state(os.stat(keys[i])) == states[i] and n == states[i][0]:
                    cache.put(keys[i], states[i], digest)
                    cache.save()  # one small atomic write per file: progress survives a kill
        if error is not None:
            raise error
    return [d for d in hashes if d is not None], n_bytes, reads, len(weights) - len(todo)
