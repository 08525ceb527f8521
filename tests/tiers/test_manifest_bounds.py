"""Manifests (S3's index cache) are stored bytes too: every size in one is bounded before it
sizes memory. Forged entry counts, payload lengths, header lengths and a zip bomb end as a
ChunkFormatError with a named reason, and cost a bounded amount of memory (asserted)."""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from collections.abc import Callable

import pytest

from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.chunkfile import ChunkFormatError, make_header
from vllm_kvtier.tiers.manifest import MAGIC, VERSION, decode_manifest, encode_manifest

NS = "manifest00000000"
SMALL = 2 << 20  # one step of inflated payload plus an entry


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def manifest(count: int, payload: bytes) -> bytes:
    out = struct.pack("<8sI16sIQ", MAGIC, VERSION, NS.encode(), count, len(payload)) + payload
    return out + struct.pack("<I", zlib.crc32(out))


def bounded(fn: Callable[[], object]) -> ChunkFormatError:
    tracemalloc.start()
    try:
        with pytest.raises(ChunkFormatError) as e:
            fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= SMALL, peak
    return e.value


def test_round_trip_with_bounds() -> None:
    entries = [(f"obj-{i}", make_header(NS, [key(i)], [i], 3000)) for i in range(10)]
    assert decode_manifest(encode_manifest(NS, entries), NS, max_blocks=1, block_bytes=3000) == dict(entries)


def test_huge_entry_count_is_refused_before_decoding() -> None:
    err = bounded(lambda: decode_manifest(manifest(0xFFFFFFFF, zlib.compress(b"")), NS))
    assert err.reason is FailureReason.TOO_LARGE


def test_zip_bomb_payload_inflates_step_by_step() -> None:
    # 1 GiB of zeros claimed by a few MiB object: entry ids of length 0 stop it at the first entry.
    bomb = zlib.compress(bytes(64 << 20), 9)
    err = bounded(lambda: decode_manifest(manifest(1000, bomb), NS))
    assert err.reason is FailureReason.FORMAT


def test_forged_header_length_in_an_entry() -> None:
    body = struct.pack("<H", 3) + b"abc" + struct.pack("<I", 0xFFFFFFF0) + bytes(100)
    err = bounded(lambda: decode_manifest(manifest(1, zlib.compress(body)), NS))
    assert err.reason is FailureReason.TOO_LARGE


def test_entry_header_with_too_many_blocks() -> None:
    h = make_header(NS, [key(i) for i in range(300)], [0] * 300, 3000)
    err = bounded(lambda: decode_manifest(encode_manifest(NS, [("big", h)]), NS, max_blocks=16))
    assert err.reason is FailureReason.TOO_LARGE


def test_payload_shorter_than_its_count() -> None:
    h = make_header(NS, [key(0)], [0], 3000)
    data = encode_manifest(NS, [("one", h)])
    _, version, ns, _, plen = struct.unpack_from("<8sI16sIQ", data)
    forged = manifest(5, data[40 : 40 + plen])
    err = bounded(lambda: decode_manifest(forged, NS))
    assert err.reason is FailureReason.TRUNCATED
