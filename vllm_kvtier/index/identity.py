"""Model identity: a fingerprint of what the engine computes with, for the namespace.

The namespace digest (:func:`vllm_kvtier.keys.namespace`) must change whenever the
bytes of a KV block would. Causes: new weights under the same path, another quantization,
other ``hf_overrides``/rope settings, another model dtype, a ``namespace_salt``. This
module holds the pure-Python parts (no vLLM). They are the weights sampler, the
:class:`ModelIdentity` record and its digest, and the LoRA-adapter keys. The vLLM-reading
glue is ``connector/wiring.py``.

The weights fingerprint ``full`` is the default. It hashes every byte of every weight file
with SHA-256. Weight files are ``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth`` and
``*.gguf``, by sorted relative names. The digest is over each file's relative name, size
and content hash. So copies of one checkpoint on different hosts agree (own files, own
inodes and times). Any changed byte changes it. Hashing costs one read of the weights
(figures in ``docs/security.md``). So a file's content hash is kept in a small local cache
(:class:`DigestCache`). Its key is what says the file is unchanged on this host: its
resolved path, size, ``mtime_ns``, ``ctime_ns``, inode and device. ``ctime`` cannot be set
back by a user: restoring ``mtime`` after an edit still changes it. So a cached start
re-reads nothing and a changed file is hashed again. Nothing local enters the digest
itself. Each file's hash is saved as soon as it is read: a start killed mid-hash resumes
where it stopped. While one process hashes, the others of the host wait on the cache's
lock. Then they read its result (the scheduler and every worker compute the namespace).

Checksums a model ships are not used. A safetensors ``__metadata__`` carries none as a
rule. An index maps tensors to files without digests. A hub blob's name (the SHA-256 of
what was downloaded) says nothing of an edit made since.

``sampled`` (``weights_fingerprint: sampled``) is a cheaper fingerprint, for checkpoints
too large to hash at start. Per file it reads these parts. First, its name and size.
Second, its safetensors header. The header's 8-byte length prefix is untrusted. A length
beyond :data:`MAX_HEADER_BYTES` or the file makes it "not a safetensors" before anything is
allocated. Third, the first :data:`WINDOW_BYTES` of every tensor the header lists. At most
:data:`MAX_TENSOR_WINDOWS` are read per file, evenly spread. Fourth, :data:`FILE_WINDOWS`
windows spread over the data section. It sees a fine-tune (every tensor's first bytes
differ). It misses an edit between its windows (a 2 MiB edit inside a 4 GiB shard). Files
are only read: nothing is unpickled or parsed but the safetensors JSON header. Results are
memoised per process by (path, size, times, inode of every file). So the scheduler and the
workers of one process compute it once.

Who calls it: connector wiring at start-up (any role). :class:`AdapterFingerprints` is
called from vLLM's scheduler thread, once per new adapter (then a few ``stat`` calls per
request). Failures raise ``OSError``; callers turn them into a logged fallback, never a
crash.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, overload

#: Suffixes of the files holding weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Small files next to the weights that change what is computed (hashed whole).
CONFIG_FILES = ("config.json", "quantize_config.json", "quant_config.json", "hf_quant_config.json",
                "quantization_config.json", "adapter_config.json")
#: A config file beyond this is not one: hashed by its size and sampled windows only.
MAX_CONFIG_BYTES = 4 << 20
#: A safetensors header longer than this (or than its file) is not believed.
MAX_HEADER_BYTES = 100 << 20
#: Subdirectory levels of a model directory that are searched for weight files.
MAX_DEPTH = 1
#: Bytes per sampled window.
WINDOW_BYTES = 4096
#: Windows spread over each file's data section (its first and last bytes included).
FILE_WINDOWS = 16
#: At most this many per-tensor windows per file (a forged header may list millions).
MAX_TENSOR_WINDOWS = 4096


#: "full": every byte hashed (cached per host); "sampled": windows only (see the module).
FingerprintMode = Literal["full", "sampled"]
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


@dataclass(frozen=True)
class WeightsFingerprint:
    """What :func:`fingerprint_weights` found: the digest and what computing it cost.

    ``reads``: read calls made. ``bytes_hashed``: bytes of weight files read and hashed
    this time. It is 0 when every file's hash came from the cache. ``cached_files``: weight
    files whose content hash came from the cache."""

    digest: str
    files: int
    total_bytes: int
    reads: int
    seconds: float
    mode: str = "full"
    bytes_hashed: int = 0
    cached_files: int = 0


def safetensors_header(f: Any, size: int) -> bytes | None:
    """The JSON header of the safetensors file open as ``f`` (``size`` bytes).

    None if it is not one. The length prefix is checked against the file and
    :data:`MAX_HEADER_BYTES` before anything is read."""
    if size < 8:
        return None
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) != 8:
        return None
    (length,) = struct.unpack("<Q", prefix)
    if length == 0 or length > MAX_HEADER_BYTES or length > size - 8:
        return None
    header = f.read(length)
    if len(header) != length or header[:1] != b"{":
        return None
    return bytes(header)


def tensor_offsets(header: bytes, data_bytes: int) -> list[int]:
    """Start offsets (within the data section) of the tensors ``header`` lists, sorted.

    The ones outside ``data_bytes`` are dropped. [] if the header is not valid JSON of that
    shape."""
    try:
        meta = json.loads(header)
    except (ValueError, RecursionError):
        return []
    if not isinstance(meta, dict):
        return []
    starts = set()
    for name, info in meta.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        span = info.get("data_offsets")
        if (isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)
                and 0 <= span[0] < span[1] <= data_bytes):
            starts.add(span[0])
    return sorted(starts)


def spread(n: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(n)``, first and last included."""
    if n <= count:
        return list(range(n))
    if count == 1:
        return [0]
    return sorted({round(i * (n - 1) / (count - 1)) for i in range(count)})


def _window_offsets(data_start: int, size: int, tensors: list[int]) -> list[int]:
    data = size - data_start
    if data <= FILE_WINDOWS * WINDOW_BYTES:  # small: all of it
        return list(range(data_start, size, WINDOW_BYTES))
    span = data - WINDOW_BYTES
    spread_over = [data_start + round(i * span / (FILE_WINDOWS - 1)) for i in range(FILE_WINDOWS)]
    per_tensor = [data_start + tensors[i] for i in spread(len(tensors), MAX_TENSOR_WINDOWS)]
    return sorted(set(spread_over) | set(per_tensor))


def _fingerprint_file(path: Path, h: Any) -> int:
    """Hash ``path``'s size, safetensors header and sampled windows into ``h``; the number
    of reads."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        h.update(struct.pack("<Q", size))
        header = safetensors_header(f, size)
        reads = 1
        if header is not None:
            h.update(b"safetensors" + struct.pack("<Q", len(header)))
            h.update(header)
            data_start = 8 + len(header)
            tensors = tensor_offsets(header, size - data_start)
        else:
            h.update(b"raw")
            data_start, tensors = 0, []
        for off in _window_offsets(data_start, size, tensors):
            f.seek(off)
            h.update(struct.pack("<Q", off))
            h.update(f.read(WINDOW_BYTES))
            reads += 1
    return reads


def _config_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    return data if len(data) <= MAX_CONFIG_BYTES else b"too-big:" + hashlib.sha256(data).digest()


def _model_files(root: Path) -> Iterator[tuple[str, Path]]:
    if root.is_file():
        yield root.name, root
        return
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        depth = len(Path(dirpath).relative_to(root).parts)
        # vLLM loads from the top level; one level below is read too (stricter, cheap),
        # deeper trees (training checkpoints kept beside the model) are not walked.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if depth < MAX_DEPTH else []
        for name in filenames:
            full = Path(dirpath) / name
            # regular files only (symlinks followed: a hub snapshot links to its blobs); a
            # FIFO or device named like a weight file would block or never end
            if (name.endswith(WEIGHT_SUFFIXES) or name in CONFIG_FILES) and full.is_file():
                found.append((full.relative_to(root).as_posix(), full))
    yield from sorted(found)


#: What says a file is unchanged on this host: size, mtime_ns, ctime_ns, inode, device.
FileState = tuple[int, int, int, int, int]


def _state(st: os.stat_result) -> FileState:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _signature(files: list[tuple[str, Path]]) -> tuple[tuple[str, FileState], ...]:
    return tuple((rel, _state(full.stat())) for rel, full in files)


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


def _content_hashes(weights: list[Path], cache_dir: Path | None) -> tuple[list[str], int, int, int]:
    """The content hash of each file of ``weights``.

    A hash comes from the cache where the file's state is the cached one. Else the file is
    read. Returns (hashes, bytes hashed, read calls, files from the cache). Each file's
    hash is saved as soon as it is known. A start may be killed mid-hash (a ready timeout
    on a large model). It then leaves the finished files cached, and the next start hashes
    only the rest. The first error of a file is raised once every other file is done."""
    with DigestCache(cache_dir) if cache_dir is not None else contextlib.nullcontext() as cache:
        keys = [str(p.resolve()) for p in weights]
        states = [_state(os.stat(k)) for k in keys]
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
                if cache is not None and _state(os.stat(keys[i])) == states[i] and n == states[i][0]:
                    cache.put(keys[i], states[i], digest)
                    cache.save()  # one small atomic write per file: progress survives a kill
        if error is not None:
            raise error
    return [d for d in hashes if d is not None], n_bytes, reads, len(weights) - len(todo)


_memo: dict[tuple[str, str, tuple[tuple[str, FileState], ...]], WeightsFingerprint] = {}
_memo_lock = threading.Lock()
_MEMO_MAX = 256


def fingerprint_weights(path: str | Path, *, mode: FingerprintMode = "full",
                        cache_dir: Path | None = None) -> WeightsFingerprint:
    """The fingerprint of the model directory (or single weights file, e.g. a GGUF) at
    ``path``.

    Its weight files are hashed whole (``full``) or sampled (``sampled``), as the module
    says. Its config files are hashed whole. ``cache_dir``: where this host's content
    hashes are kept (``full`` only). None means no cache; every call without a memo hit
    reads every byte. Memoised per process by (path, state of each file). OSError when
    ``path`` is neither a directory nor a file, holds no weight file, or cannot be read."""
    root = Path(path)
    if not (root.is_dir() or root.is_file()):
        raise FileNotFoundError(f"{root}: not a local model directory or file")
    files = list(_model_files(root))
    if not any(rel.endswith(WEIGHT_SUFFIXES) for rel, _ in files):
        raise FileNotFoundError(f"{root}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    key = (str(root.resolve()), mode, _signature(files))
    with _memo_lock:
        if key in _memo:
            return _memo[key]
    t0 = time.perf_counter()
    full_mode = mode == "full"
    # each mode its own digest: a full and a sampled fingerprint never agree
    h = hashlib.blake2b(digest_size=32, person=b"kvtier-weights-f" if full_mode else b"kvtier-weights")
    content: dict[str, str] = {}
    hashed = cached = 0
    reads = total = 0
    if full_mode:
        weights = [(rel, full) for rel, full in files if rel.endswith(WEIGHT_SUFFIXES)]
        digests, hashed, reads, cached = _content_hashes([full for _, full in weights], cache_dir)
        content = {rel: d for (rel, _), d in zip(weights, digests, strict=True)}
    for rel, full in files:
        h.update(b"\0file\0" + rel.encode())
        if rel in content:
            h.update(struct.pack("<Q", full.stat().st_size) + bytes.fromhex(content[rel]))
        elif rel.endswith(WEIGHT_SUFFIXES):
            reads += _fingerprint_file(full, h)
        else:
            data = _config_bytes(full)
            h.update(struct.pack("<Q", len(data)) + data)
            reads += 1
        total += full.stat().st_size
    fp = WeightsFingerprint(h.hexdigest(), len(files), total, reads, time.perf_counter() - t0,
                            mode=mode, bytes_hashed=hashed, cached_files=cached)
    with _memo_lock:
        if len(_memo) >= _MEMO_MAX:
            _memo.pop(next(iter(_memo)))
        _memo[key] = fp
    return fp


def canonical(value: Any) -> str:
    """A stable text form of a config value.

    Dicts are sorted. Other objects go by ``str``. A value JSON cannot walk (e.g. one that
    contains itself) goes by its ``repr``."""
    try:
        return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    except (ValueError, TypeError, RecursionError):
        return "repr:" + repr(value)


@dataclass(frozen=True)
class ModelIdentity:
    """Everything about the model that changes the bytes of a KV block, besides its
    geometry (which :class:`~vllm_kvtier.keys.NamespaceFields` holds).

    ``weights`` is the weights fingerprint of a local model. It is ``""`` where none could
    be taken (a hub id). Then ``model`` (id@revision) stands for the weights. A
    fingerprinted model is named by its content only. So copies of one checkpoint under
    different paths share KV."""

    model: str
    weights: str
    model_dtype: str
    kv_cache_dtype: str
    quantization: str
    quant_config: str
    hf_overrides: str
    rope: str
    #: digest of the resolved HF config (after hf_overrides; paths and versions left out)
    hf_config: str
    load_format: str
    salt: str = ""

    def digest(self) -> str:
        """A stable digest of every field (hex, 32 characters)."""
        blob = canonical(asdict(self)).encode()
        return hashlib.blake2b(blob, digest_size=16, person=b"kvtier-model-id").hexdigest()

    def describe(self) -> dict[str, str]:
        """The fields for a log line: the salt only as "set"/"unset"."""
        out = asdict(self)
        out["model"] = self.model or "(named by its weights)"
        out["salt"] = "set" if self.salt else "unset"
        return out


def adapter_key(adapter: bytes, block_hash: bytes) -> bytes:
    """The key a block of a LoRA request is stored under.

    It is its block hash bound to the adapter's content fingerprint, the same length as the
    hash. vLLM hashes the adapter's name, not its weights."""
    size = min(max(len(block_hash), 16), 64)
    return hashlib.blake2b(adapter + block_hash, digest_size=size, person=b"kvtier-lora").digest()


class AdapterKeys(Sequence[bytes]):
    """A live view of ``request.block_hashes`` through :func:`adapter_key` (the list grows
    as vLLM computes the request; derived keys are cached by position)."""

    def __init__(self, request: Any, adapter: bytes) -> None:
        self._request = request
        self._adapter = adapter
        self._derived: dict[bytes, bytes] = {}

    def _key(self, h: bytes) -> bytes:
        k = self._derived.get(h)
        if k is None:
            k = self._derived[h] = adapter_key(self._adapter, h)
        return k

    def __len__(self) -> int:
        return len(self._request.block_hashes)

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> list[bytes]: ...
    def __getitem__(self, i: int | slice) -> bytes | list[bytes]:
        base = self._request.block_hashes
        if isinstance(i, slice):
            return [self._key(h) for h in base[i]]
        return self._key(base[i])


class AdapterFingerprints:
    """Content fingerprints of LoRA adapter directories (``sampled``).

    They are cached by (path, state of each file). A rewritten adapter gets a new
    fingerprint. An unchanged one costs a few ``stat`` calls. Scheduler thread only."""

    def __init__(self, max_entries: int = 256) -> None:
        self._max = max_entries
        self._cache: dict[tuple[str, tuple[tuple[str, FileState], ...]], bytes] = {}

    def get(self, path: str) -> bytes:
        """The fingerprint of the adapter at ``path``; OSError when it cannot be taken."""
        files = list(_model_files(Path(path)))
        key = (path, _signature(files))
        fp = self._cache.get(key)
        if fp is None:
            # sampled, not hashed whole: this runs on vLLM's scheduler thread, at a new
            # adapter's first request (a whole 100 MB adapter would hold up every request)
            fp = bytes.fromhex(fingerprint_weights(path, mode="sampled").digest)
            if len(self._cache) >= self._max:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = fp
        return fp


def describe_line(fields: Mapping[str, object]) -> str:
    """``k=v`` pairs for one log line, in order."""
    return " ".join(f"{k}={v}" for k, v in fields.items())
