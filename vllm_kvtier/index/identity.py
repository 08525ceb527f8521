"""Model identity: a fingerprint of what the engine computes with, for the namespace.

The namespace digest (:func:`vllm_kvtier.index.keys.namespace`) must change whenever the
bytes of a KV block would: new weights under the same path, another quantization, other
``hf_overrides``/rope settings, another model dtype, a ``namespace_salt``. This module
holds the pure-Python parts (no vLLM): the weights sampler, the :class:`ModelIdentity`
record and its digest, and the LoRA-adapter keys. The vLLM-reading glue is
``connector/wiring.py``.

The weights fingerprint, per weight file (``*.safetensors``, ``*.bin``, ``*.pt``,
``*.pth``, ``*.gguf``; sorted relative names), hashes its name and size, its safetensors
header (its 8-byte length prefix is untrusted: a length beyond :data:`MAX_HEADER_BYTES` or
the file makes it "not a safetensors" before anything is allocated), the first
:data:`WINDOW_BYTES` of every tensor the header lists (at most
:data:`MAX_TENSOR_WINDOWS` per file, evenly spread) and :data:`FILE_WINDOWS` windows
spread over the data section, its start and end included. A fine-tune of the same
architecture has the same headers and sizes; its tensors' bytes differ, and every tensor
is sampled. Files are only read: nothing is unpickled or parsed but the safetensors JSON
header.

Cost: one random 4 KiB read per tensor plus 16 per file. A 70B checkpoint (30 shards,
~720 tensors) is ~1,200 reads: well under a second on NVMe (measured in
``docs/configuration.md``). Results are memoised per process by (path, size, mtime_ns) of
every file, so the scheduler and the workers of one process compute it once.

Who calls it: connector wiring at start-up (any role); :class:`AdapterFingerprints` from
vLLM's scheduler thread, once per new adapter (then a few ``stat`` calls per request).
Failures raise ``OSError``; callers turn them into a logged fallback, never a crash.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, overload

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


@dataclass(frozen=True)
class WeightsFingerprint:
    """What :func:`fingerprint_weights` found: the digest and what computing it cost."""

    digest: str
    files: int
    total_bytes: int
    reads: int
    seconds: float


def safetensors_header(f: Any, size: int) -> bytes | None:
    """The JSON header of the safetensors file open as ``f`` (``size`` bytes), or None if
    it is not one: the length prefix is checked against the file and :data:`MAX_HEADER_BYTES`
    before anything is read."""
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
    """Start offsets (within the data section) of the tensors ``header`` lists, sorted, the
    ones outside ``data_bytes`` dropped; [] if the header is not valid JSON of that shape."""
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


def _signature(files: list[tuple[str, Path]]) -> tuple[tuple[str, int, int], ...]:
    out = []
    for rel, full in files:
        st = full.stat()
        out.append((rel, st.st_size, st.st_mtime_ns))
    return tuple(out)


_memo: dict[tuple[str, tuple[tuple[str, int, int], ...]], WeightsFingerprint] = {}
_memo_lock = threading.Lock()
_MEMO_MAX = 256


def fingerprint_weights(path: str | Path) -> WeightsFingerprint:
    """The fingerprint of the model directory (or single weights file, e.g. a GGUF) at
    ``path``: its weight files sampled as the module says and its config files whole.
    Memoised per process by (path, size and mtime_ns of each file). OSError when ``path``
    is neither a directory nor a file, holds no weight file, or cannot be read."""
    root = Path(path)
    if not (root.is_dir() or root.is_file()):
        raise FileNotFoundError(f"{root}: not a local model directory or file")
    files = list(_model_files(root))
    if not any(rel.endswith(WEIGHT_SUFFIXES) for rel, _ in files):
        raise FileNotFoundError(f"{root}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    key = (str(root.resolve()), _signature(files))
    with _memo_lock:
        if key in _memo:
            return _memo[key]
    t0 = time.perf_counter()
    h = hashlib.blake2b(digest_size=32, person=b"kvtier-weights")
    reads = total = 0
    for rel, full in files:
        h.update(b"\0file\0" + rel.encode())
        if rel.endswith(WEIGHT_SUFFIXES):
            reads += _fingerprint_file(full, h)
        else:
            data = _config_bytes(full)
            h.update(struct.pack("<Q", len(data)) + data)
            reads += 1
        total += full.stat().st_size
    fp = WeightsFingerprint(h.hexdigest(), len(files), total, reads, time.perf_counter() - t0)
    with _memo_lock:
        if len(_memo) >= _MEMO_MAX:
            _memo.pop(next(iter(_memo)))
        _memo[key] = fp
    return fp


def canonical(value: Any) -> str:
    """A stable text form of a config value (dicts sorted; other objects by ``str``; a
    value JSON cannot walk, e.g. one that contains itself, by its ``repr``)."""
    try:
        return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    except (ValueError, TypeError, RecursionError):
        return "repr:" + repr(value)


@dataclass(frozen=True)
class ModelIdentity:
    """Everything about the model that changes the bytes of a KV block, besides its
    geometry (which :class:`~vllm_kvtier.index.keys.NamespaceFields` holds).

    ``weights`` is the weights fingerprint of a local model, or ``""`` where none could be
    taken (a hub id): then ``model`` (id@revision) stands for the weights. A fingerprinted
    model is named by its content only, so copies of one checkpoint under different paths
    share KV."""

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
    """The key a block of a LoRA request is stored under: its block hash bound to the
    adapter's content fingerprint, the same length as the hash (vLLM hashes the adapter's
    name, not its weights)."""
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
    """Content fingerprints of LoRA adapter directories, cached by (path, size and mtime_ns
    of each file): a rewritten adapter gets a new fingerprint, an unchanged one costs a
    few ``stat`` calls. Scheduler thread only."""

    def __init__(self, max_entries: int = 256) -> None:
        self._max = max_entries
        self._cache: dict[tuple[str, tuple[tuple[str, int, int], ...]], bytes] = {}

    def get(self, path: str) -> bytes:
        """The fingerprint of the adapter at ``path``; OSError when it cannot be taken."""
        files = list(_model_files(Path(path)))
        key = (path, _signature(files))
        fp = self._cache.get(key)
        if fp is None:
            fp = bytes.fromhex(fingerprint_weights(path).digest)
            if len(self._cache) >= self._max:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = fp
        return fp


def describe_line(fields: Mapping[str, object]) -> str:
    """``k=v`` pairs for one log line, in order."""
    return " ".join(f"{k}={v}" for k, v in fields.items())
