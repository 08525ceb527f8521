"""LoRA adapters in the block keys: a LoRA request's blocks are stored under keys bound to
its adapter's content, since vLLM's block hashes name only the adapter."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, overload

from vllm_kvtier.index.identity import fingerprint_weights
from vllm_kvtier.index.model_files import FileState, model_files, signature


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
        files = list(model_files(Path(path)))
        key = (path, signature(files))
        fp = self._cache.get(key)
        if fp is None:
            # sampled, not hashed whole: this runs on vLLM's scheduler thread, at a new
            # adapter's first request (a whole 100 MB adapter would hold up every request)
            fp = bytes.fromhex(fingerprint_weights(path, mode="sampled").digest)
            if len(self._cache) >= self._max:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = fp
        return fp
