"""The on-disk (and on-wire) format of a chunk: a few consecutive KV blocks, self-describing.

Layout, every part a multiple of ``ALIGN`` bytes so a chunk can be written and read with
O_DIRECT in one I/O::

    header  (header_bytes)     fixed fields, then one entry per block, then a CRC32 of it all
    block 0 (stride bytes)     raw bytes of block 0, zero padded to the stride
    block 1 ...

Header fields (little endian): magic ``b"KVTCHNK1"``, format version, namespace (16 ASCII
bytes), number of blocks, block bytes, stride, header bytes; per block: key length, key
(up to 64 bytes), CRC32 of the block's bytes. Nothing here is ever unpickled: a chunk is
data, and a block is trusted only after its CRC32 matches.
"""

from __future__ import annotations

import struct
import uuid
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_kvtier.errors import FailureReason

MAGIC = b"KVTCHNK1"
VERSION = 1
ALIGN = 4096
MAX_KEY = 64
#: The most blocks a chunk may have (the config's bound on ``chunk_blocks``).
MAX_CHUNK_BLOCKS = 256

_FIXED = struct.Struct("<8sI16sIQQQ")  # magic, version, namespace, nblocks, block_bytes, stride, header_bytes
_ENTRY = struct.Struct(f"<B{MAX_KEY}sI")  # key length, key, crc32
_CRC = struct.Struct("<I")


class ChunkFormatError(ValueError):
    """A chunk header or block that does not verify. Treated as a miss by callers.

    ``reason`` is set where it is raised (default ``format``), so no caller reads the
    message text to classify it."""

    def __init__(self, message: str, reason: FailureReason = FailureReason.FORMAT) -> None:
        super().__init__(message)
        #: A short, stable label for counters and logs.
        self.reason = reason


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ChunkHeader:
    namespace: str
    keys: tuple[bytes, ...]
    crcs: tuple[int, ...]
    block_bytes: int
    stride: int
    header_bytes: int

    @property
    def nblocks(self) -> int:
        return len(self.keys)

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.nblocks * self.stride

    def block_offset(self, i: int) -> int:
        return self.header_bytes + i * self.stride


def header_bytes_for(nblocks: int) -> int:
    return align_up(_FIXED.size + nblocks * _ENTRY.size + _CRC.size)


#: Bytes of a header's fixed part: enough to learn (and bound) its full length.
FIXED_BYTES = _FIXED.size


def chunk_id_for(keys: Iterable[bytes]) -> str:
    """A new chunk's id: the first key (a chained hash naming the whole prefix) plus a
    random suffix, so a re-written chunk never collides with one being deleted."""
    first = next(iter(keys))
    return f"{first.hex()[:32]}-{uuid.uuid4().hex[:8]}"


def max_chunk_bytes(max_blocks: int, block_bytes: int) -> int:
    """The largest chunk an engine writing at most ``max_blocks`` blocks of ``block_bytes``
    can have written: the bound of every size read back from stored bytes."""
    return header_bytes_for(max_blocks) + max_blocks * align_up(block_bytes)


def bounded_header_bytes(head: bytes | bytearray | memoryview, *, max_blocks: int, block_bytes: int | None) -> int:
    """The full header length announced by the fixed part ``head`` of a header that is NOT
    verified yet, after checking every size in it against what this engine could have
    written, so that no garbage count sizes an allocation or a read. ``block_bytes`` None:
    any block size (a reader that does not know it, e.g. the scheduler's scan).

    Raises ChunkFormatError: ``truncated`` (shorter than the fixed part), ``format`` (not
    a chunk, or blocks of another size, or sizes that do not agree), ``too_large`` (more
    blocks than ``max_blocks``)."""
    if len(head) < _FIXED.size:
        raise ChunkFormatError("truncated header", FailureReason.TRUNCATED)
    magic, version, _, nblocks, bb, stride, hbytes = _FIXED.unpack_from(head, 0)
    if magic != MAGIC or version != VERSION:
        raise ChunkFormatError("bad magic or format version", FailureReason.FORMAT)
    if nblocks > max_blocks:
        raise ChunkFormatError(f"too large: {nblocks} blocks, at most {max_blocks}", FailureReason.TOO_LARGE)
    if block_bytes is not None and bb != block_bytes:
        raise ChunkFormatError(f"format: blocks of {bb} B, expected {block_bytes}", FailureReason.FORMAT)
    if nblocks < 1 or stride != align_up(bb) or hbytes != header_bytes_for(nblocks):
        raise ChunkFormatError("inconsistent header sizes", FailureReason.FORMAT)
    return int(hbytes)


def keys_match(h: ChunkHeader, positions: Iterable[int], keys: Iterable[bytes] | None) -> bool:
    """Whether the chunk holds ``keys`` at ``positions`` (True when no keys are expected)."""
    if keys is None:
        return True
    pos, ks = list(positions), list(keys)
    return len(pos) == len(ks) and all(0 <= p < h.nblocks and h.keys[p] == k for p, k in zip(pos, ks, strict=True))


def make_header(namespace: str, keys: list[bytes], crcs: list[int], block_bytes: int) -> ChunkHeader:
    for k in keys:
        if len(k) > MAX_KEY:
            raise ValueError(f"block key longer than {MAX_KEY} bytes")
    return ChunkHeader(namespace, tuple(keys), tuple(crcs), block_bytes, align_up(block_bytes),
                       header_bytes_for(len(keys)))


def encode_header(h: ChunkHeader, out: memoryview) -> None:
    """Write ``h`` into ``out[:h.header_bytes]`` (zero padded)."""
    ns = h.namespace.encode("ascii")
    if len(ns) > 16:
        raise ValueError("namespace longer than 16 characters")
    buf = bytearray(h.header_bytes)
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, ns, h.nblocks, h.block_bytes, h.stride, h.header_bytes)
    off = _FIXED.size
    for k, c in zip(h.keys, h.crcs, strict=True):
        _ENTRY.pack_into(buf, off, len(k), k, c)
        off += _ENTRY.size
    _CRC.pack_into(buf, off, zlib.crc32(memoryview(buf)[:off]))
    out[: h.header_bytes] = buf


def decode_header(data: bytes | memoryview, namespace: str) -> ChunkHeader:
    """Parse and verify a header. Raises ChunkFormatError on any mismatch."""
    if len(data) < _FIXED.size:
        raise ChunkFormatError("truncated header", FailureReason.TRUNCATED)
    magic, version, ns, nblocks, block_bytes, stride, header_bytes = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise ChunkFormatError("bad magic", FailureReason.FORMAT)
    if version != VERSION:
        raise ChunkFormatError(f"format version {version}, expected {VERSION}", FailureReason.FORMAT)
    if ns.rstrip(b"\0").decode("ascii", "replace") != namespace:
        raise ChunkFormatError("namespace mismatch", FailureReason.NAMESPACE)
    if header_bytes != header_bytes_for(nblocks) or stride != align_up(block_bytes) or len(data) < header_bytes:
        raise ChunkFormatError("inconsistent header sizes", FailureReason.FORMAT)
    off = _FIXED.size
    keys, crcs = [], []
    for _ in range(nblocks):
        klen, key, crc = _ENTRY.unpack_from(data, off)
        if klen > MAX_KEY:
            raise ChunkFormatError("bad key length", FailureReason.FORMAT)
        keys.append(bytes(key[:klen]))
        crcs.append(crc)
        off += _ENTRY.size
    (crc,) = _CRC.unpack_from(data, off)
    if crc != zlib.crc32(memoryview(data)[:off]):
        raise ChunkFormatError("header checksum mismatch", FailureReason.CHECKSUM)
    return ChunkHeader(namespace, tuple(keys), tuple(crcs), block_bytes, stride, header_bytes)


try:  # ISA-L's CRC-32: the same function as zlib's (same values), ~12x faster (50 vs 4 GB/s)
    from isal.isal_zlib import crc32 as _crc32

    CRC_IMPL = "isal"
except ImportError:  # optional: pip install 'vllm-kvtier[fast-crc]'
    _crc32 = zlib.crc32
    CRC_IMPL = "zlib"


def block_crc(data: memoryview | bytes) -> int:
    """CRC-32 (zlib's) of one block. Every block is checksummed on every store and load,
    so at GB/s transfer rates zlib's speed was a visible share of a load (bench/s3_throughput.py)."""
    return _crc32(data)
