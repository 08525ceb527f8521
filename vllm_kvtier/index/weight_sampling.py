"""The ``sampled`` weights fingerprint of one file: its size, its safetensors header and
windows spread over its data (see :mod:`vllm_kvtier.index.identity`).

The header's 8-byte length prefix is untrusted: a length beyond :data:`MAX_HEADER_BYTES`
or the file makes it "not a safetensors" before anything is allocated."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

#: A safetensors header longer than this (or than its file) is not believed.
MAX_HEADER_BYTES = 100 << 20
#: Bytes per sampled window.
WINDOW_BYTES = 4096
#: Windows spread over each file's data section (its first and last bytes included).
FILE_WINDOWS = 16
#: At most this many per-tensor windows per file (a forged header may list millions).
MAX_TENSOR_WINDOWS = 4096


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


def sample_file(path: Path, h: Any) -> int:
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
