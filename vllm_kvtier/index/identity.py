"""Model identity: a fingerprint of what the engine computes with, for the namespace.

The namespace digest (:func:`vllm_kvtier.keys.namespace`) must change whenever the
bytes of a KV block would. Causes: new weights under the same path, another quantization,
other ``hf_overrides``/rope settings, another model dtype, a ``namespace_salt``. This
module holds :func:`fingerprint_weights` and the :class:`ModelIdentity` record and its
digest (no vLLM). Its parts: the files covered (:mod:`.model_files`), the sampled
fingerprint of one file (:mod:`.weight_sampling`), the content hashes and their cache
(:mod:`.digest_cache`). LoRA-adapter keys are in :mod:`.adapters`. The vLLM-reading glue
is ``connector/wiring.py``.

The weights fingerprint ``full`` is the default. It hashes every byte of every weight file
with SHA-256. Weight files are ``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth`` and
``*.gguf``, by sorted relative names. The digest is over each file's relative name, size
and content hash. So copies of one checkpoint on different hosts agree (own files, own
inodes and times). Any changed byte changes it. Hashing costs one read of the weights
(figures in ``docs/security.md``). So a file's content hash is kept in a small local cache
(:class:`~vllm_kvtier.index.digest_cache.DigestCache`). Its key is what says the file is unchanged on this host: its
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

Who calls it: connector wiring at start-up (any role).
:class:`~vllm_kvtier.index.adapters.AdapterFingerprints` is called from vLLM's scheduler
thread, once per new adapter (then a few ``stat`` calls per request). Failures raise
``OSError``; callers turn them into a logged fallback, never a crash.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from vllm_kvtier.index.digest_cache import content_hashes
from vllm_kvtier.index.model_files import WEIGHT_SUFFIXES, FileState, config_bytes, model_files, signature
from vllm_kvtier.index.weight_sampling import sample_file

#: "full": every byte hashed (cached per host); "sampled": windows only (see the module).
FingerprintMode = Literal["full", "sampled"]


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
    files = list(model_files(root))
    if not any(rel.endswith(WEIGHT_SUFFIXES) for rel, _ in files):
        raise FileNotFoundError(f"{root}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    key = (str(root.resolve()), mode, signature(files))
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
        digests, hashed, reads, cached = content_hashes([full for _, full in weights], cache_dir)
        content = {rel: d for (rel, _), d in zip(weights, digests, strict=True)}
    for rel, full in files:
        h.update(b"\0file\0" + rel.encode())
        if rel in content:
            h.update(struct.pack("<Q", full.stat().st_size) + bytes.fromhex(content[rel]))
        elif rel.endswith(WEIGHT_SUFFIXES):
            reads += sample_file(full, h)
        else:
            data = config_bytes(full)
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


def describe_line(fields: Mapping[str, object]) -> str:
    """``k=v`` pairs for one log line, in order."""
    return " ".join(f"{k}={v}" for k, v in fields.items())
