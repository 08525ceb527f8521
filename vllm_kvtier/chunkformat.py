"""The on-disk (and on-wire) format of a chunk: a few consecutive KV blocks, self-describing.

Every part is a multiple of ``ALIGN`` bytes. So a chunk can be written and read with
O_DIRECT in one I/O. Layout::

    header  (header_bytes)     fixed fields, then one entry per block, then a CRC32 of it all
    block 0 (stride bytes)     raw bytes of block 0, zero padded to the stride
    block 1 ...

Header fields (little endian): magic ``b"KVTCHNK1"``, format version, namespace (16 ASCII
bytes), number of blocks, block bytes, stride, header bytes. Then the **store rank** (u32).
It is the TP/PP rank whose shard the blocks are; the medium's path also names it
(``r<rank>``). Per block: key length, key (up to 64 bytes), CRC32 of the block's bytes.
Nothing here is ever unpickled: a chunk is data. A block is trusted only after its CRC32
matches.

Two versions. The fixed part is the same in both, so a reader learns which before it
parses the rest.

* **3** (unauthenticated): the rank; entries of key length, key, CRC32; then the header's
  CRC32.
* **4** (authenticated, :mod:`~vllm_kvtier.tiers.auth`): the rank, then the entries. Each
  entry is key length, key, CRC32 and a 32-byte tag. The tag is an HMAC-SHA256 of the
  namespace, the rank, the block's key and its bytes. Then the key id (8 bytes). It says
  which key signed it; it is derived from the key, never the key. Then the header's CRC32.
  Then the header's MAC: an HMAC-SHA256 of the chunk id and every header byte before it.
  So it covers the namespace, rank, sizes, keys and tags. A reader with the key verifies
  the header's MAC and each wanted block's tag before a block is delivered. This module
  only lays the fields out (:func:`signed_bytes` is what the MAC covers).

Versions 1 and 2 have no rank, so a rank's chunk copied over another rank's was served.
They are refused as ``format``: a miss, never read (see docs/upgrading.md).
"""

from __future__ import annotations

import os
import struct
import sys
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_kvtier.errors import FailureReason

MAGIC = b"KVTCHNK1"
VERSION = 3
#: The authenticated format (per-block tags, key id, header MAC).
VERSION_AUTH = 4
#: Versions of earlier releases (no rank in the header): refused, ``format``.
OLD_VERSIONS = (1, 2)
#: Bytes of a tag (per block) and of the header MAC: HMAC-SHA256.
TAG_BYTES = 32
KEY_ID_BYTES = 8
ALIGN = 4096
MAX_KEY = 64
#: The most blocks a chunk may have (the config's bound on ``chunk_blocks``).
MAX_CHUNK_BLOCKS = 256

_FIXED = struct.Struct("<8sI16sIQQQ")  # magic, version, namespace, nblocks, block_bytes, stride, header_bytes
_RANK = struct.Struct("<I")  # the store rank, right after the fixed part
_ENTRY = struct.Struct(f"<B{MAX_KEY}sI")  # key length, key, crc32
_ENTRY_AUTH = struct.Struct(f"<B{MAX_KEY}sI{TAG_BYTES}s")  # key length, key, crc32, tag
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
    #: Version 2 only (empty in version 1): each block's tag, the signing key's id, the
    #: header's MAC. Carried along so a reader can re-verify a header it keeps.
    tags: tuple[bytes, ...] = ()
    key_id: bytes = b""
    mac: bytes = b""
    #: The store rank the chunk was written for (its shard; the medium's ``r<rank>``).
    rank: int = 0

    @property
    def nblocks(self) -> int:
        return len(self.keys)

    @property
    def authenticated(self) -> bool:
        """Version 2: signed with a key (whose id is :attr:`key_id`)."""
        return bool(self.key_id)

    @property
    def version(self) -> int:
        return VERSION_AUTH if self.authenticated else VERSION

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.nblocks * self.stride

    def block_offset(self, i: int) -> int:
        return self.header_bytes + i * self.stride


def header_memory_bytes(h: ChunkHeader) -> int:
    """About the memory a decoded header holds: what a header cache bounded by bytes
    counts.

    It counts the object, its tuples, keys, CRCs and tags; the namespace string is shared.
    A 16-block unsigned header is about 2.1 KB, 256 blocks about 29 KB."""
    return (sys.getsizeof(h) + 2 * 64  # the object, key_id and mac
            + sys.getsizeof(h.keys) + sum(map(sys.getsizeof, h.keys))
            + sys.getsizeof(h.crcs) + 32 * len(h.crcs)
            + sys.getsizeof(h.tags) + sum(map(sys.getsizeof, h.tags)))


def header_bytes_for(nblocks: int, authenticated: bool = False) -> int:
    """The header length of a chunk of ``nblocks`` (version 2 when ``authenticated``)."""
    if authenticated:
        return align_up(_FIXED.size + _RANK.size + nblocks * _ENTRY_AUTH.size + KEY_ID_BYTES + _CRC.size + TAG_BYTES)
    return align_up(_FIXED.size + _RANK.size + nblocks * _ENTRY.size + _CRC.size)


#: Bytes of a header's fixed part: enough to learn (and bound) its full length.
FIXED_BYTES = _FIXED.size


def chunk_id_for(keys: Iterable[bytes]) -> str:
    """A new chunk's id: the first key plus a random suffix.

    The first key is a chained hash naming the whole prefix. The suffix means a re-written
    chunk never collides with one being deleted."""
    first = next(iter(keys))
    return f"{first.hex()[:32]}-{os.urandom(4).hex()}"


def max_chunk_bytes(max_blocks: int, block_bytes: int) -> int:
    """The largest chunk an engine could have written (in either version).

    The engine writes at most ``max_blocks`` blocks of ``block_bytes``. This is the bound
    of every size read back from stored bytes."""
    return header_bytes_for(max_blocks, True) + max_blocks * align_up(block_bytes)


def bounded_header_bytes(head: bytes | bytearray | memoryview, *, max_blocks: int, block_bytes: int | None) -> int:
    """The full header length announced by the fixed part ``head`` of a header that is NOT
    verified yet.

    Every size in it is first checked against what this engine could have written. So no
    garbage count sizes an allocation or a read. ``block_bytes`` None: any block size (a
    reader that does not know it, e.g. the scheduler's scan).

    Raises ChunkFormatError. ``truncated``: shorter than the fixed part. ``format``: not a
    chunk, or blocks of another size, or sizes that do not agree. ``too_large``: more
    blocks than ``max_blocks``."""
    if len(head) < _FIXED.size:
        raise ChunkFormatError("truncated header", FailureReason.TRUNCATED)
    magic, version, _, nblocks, bb, stride, hbytes = _FIXED.unpack_from(head, 0)
    if magic != MAGIC or version not in (VERSION, VERSION_AUTH):
        raise ChunkFormatError(_version_problem(magic, version), FailureReason.FORMAT)
    if nblocks > max_blocks:
        raise ChunkFormatError(f"too large: {nblocks} blocks, at most {max_blocks}", FailureReason.TOO_LARGE)
    if block_bytes is not None and bb != block_bytes:
        raise ChunkFormatError(f"format: blocks of {bb} B, expected {block_bytes}", FailureReason.FORMAT)
    if nblocks < 1 or stride != align_up(bb) or hbytes != header_bytes_for(nblocks, version == VERSION_AUTH):
        raise ChunkFormatError("inconsistent header sizes", FailureReason.FORMAT)
    return int(hbytes)


def _version_problem(magic: bytes, version: int) -> str:
    if magic != MAGIC:
        return "bad magic"
    if version in OLD_VERSIONS:
        return f"format version {version} of an earlier release (no rank in the header): not read"
    return f"format version {version}, expected {VERSION} or {VERSION_AUTH}"


def keys_match(h: ChunkHeader, positions: Iterable[int], keys: Iterable[bytes] | None) -> bool:
    """Whether the chunk holds ``keys`` at ``positions`` (True when no keys are expected)."""
    if keys is None:
        return True
    pos, ks = list(positions), list(keys)
    return len(pos) == len(ks) and all(0 <= p < h.nblocks and h.keys[p] == k for p, k in zip(pos, ks, strict=True))


def make_header(namespace: str, keys: list[bytes], crcs: list[int], block_bytes: int, *,
                tags: list[bytes] | None = None, key_id: bytes = b"", rank: int = 0) -> ChunkHeader:
    """A version 3 header of store rank ``rank``, or version 4 with ``tags`` and ``key_id``
    (its MAC still empty: the signer sets it over :func:`signed_bytes`)."""
    if not 0 <= rank < 1 << 32:
        raise ValueError(f"rank {rank} out of range")
    for k in keys:
        if len(k) > MAX_KEY:
            raise ValueError(f"block key longer than {MAX_KEY} bytes")
    auth = bool(key_id)
    if auth and (len(key_id) != KEY_ID_BYTES or tags is None or len(tags) != len(keys)
                 or any(len(t) != TAG_BYTES for t in tags)):
        raise ValueError(f"an authenticated header needs a {KEY_ID_BYTES}-byte key id and a "
                         f"{TAG_BYTES}-byte tag per block")
    return ChunkHeader(namespace, tuple(keys), tuple(crcs), block_bytes, align_up(block_bytes),
                       header_bytes_for(len(keys), auth), tuple(tags or ()) if auth else (), key_id, rank=rank)


def _pack(h: ChunkHeader) -> tuple[bytearray, int]:
    """The header's bytes (its MAC field, if any, zero) and the offset of that field."""
    ns = h.namespace.encode("ascii")
    if len(ns) > 16:
        raise ValueError("namespace longer than 16 characters")
    buf = bytearray(h.header_bytes)
    _FIXED.pack_into(buf, 0, MAGIC, h.version, ns, h.nblocks, h.block_bytes, h.stride, h.header_bytes)
    _RANK.pack_into(buf, _FIXED.size, h.rank)
    off = _FIXED.size + _RANK.size
    if h.authenticated:
        for k, c, t in zip(h.keys, h.crcs, h.tags, strict=True):
            _ENTRY_AUTH.pack_into(buf, off, len(k), k, c, t)
            off += _ENTRY_AUTH.size
        buf[off : off + KEY_ID_BYTES] = h.key_id
        off += KEY_ID_BYTES
    else:
        for k, c in zip(h.keys, h.crcs, strict=True):
            _ENTRY.pack_into(buf, off, len(k), k, c)
            off += _ENTRY.size
    _CRC.pack_into(buf, off, zlib.crc32(memoryview(buf)[:off]))
    return buf, off + _CRC.size


def signed_bytes(h: ChunkHeader) -> bytes:
    """What a version 2 header's MAC covers: every header byte before the MAC field."""
    buf, end = _pack(h)
    return bytes(buf[:end])


def encode_header(h: ChunkHeader, out: memoryview) -> None:
    """Write ``h`` into ``out[:h.header_bytes]`` (zero padded)."""
    buf, end = _pack(h)
    if h.authenticated:
        buf[end : end + TAG_BYTES] = h.mac.ljust(TAG_BYTES, b"\0")[:TAG_BYTES]
    out[: h.header_bytes] = buf


def decode_header(data: bytes | memoryview, namespace: str, *, rank: int | None = None) -> ChunkHeader:
    """Parse and verify a header (either version).

    A version 4 header's MAC is NOT checked here: that needs the key
    (:mod:`~vllm_kvtier.tiers.auth`). Raises ChunkFormatError on any mismatch. With
    ``rank`` given, a header of another store rank is ``key_mismatch``. That is a rank's
    shard copied or moved to another rank's place: never served there."""
    if len(data) < _FIXED.size:
        raise ChunkFormatError("truncated header", FailureReason.TRUNCATED)
    magic, version, ns, nblocks, block_bytes, stride, header_bytes = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise ChunkFormatError("bad magic", FailureReason.FORMAT)
    if version not in (VERSION, VERSION_AUTH):
        raise ChunkFormatError(_version_problem(magic, version), FailureReason.FORMAT)
    auth = version == VERSION_AUTH
    if ns.rstrip(b"\0").decode("ascii", "replace") != namespace:
        raise ChunkFormatError("namespace mismatch", FailureReason.NAMESPACE)
    if (header_bytes != header_bytes_for(nblocks, auth) or stride != align_up(block_bytes)
            or len(data) < header_bytes):
        raise ChunkFormatError("inconsistent header sizes", FailureReason.FORMAT)
    (stored_rank,) = _RANK.unpack_from(data, _FIXED.size)
    off = _FIXED.size + _RANK.size
    keys, crcs, tags = [], [], []
    entry = _ENTRY_AUTH if auth else _ENTRY
    for _ in range(nblocks):
        fields = entry.unpack_from(data, off)
        klen, key, crc = fields[0], fields[1], fields[2]
        if klen > MAX_KEY:
            raise ChunkFormatError("bad key length", FailureReason.FORMAT)
        keys.append(bytes(key[:klen]))
        crcs.append(crc)
        if auth:
            tags.append(bytes(fields[3]))
        off += entry.size
    key_id = b""
    if auth:
        key_id = bytes(data[off : off + KEY_ID_BYTES])
        off += KEY_ID_BYTES
    (crc,) = _CRC.unpack_from(data, off)
    if crc != zlib.crc32(memoryview(data)[:off]):
        raise ChunkFormatError("header checksum mismatch", FailureReason.CHECKSUM)
    if rank is not None and stored_rank != rank:
        raise ChunkFormatError(f"a chunk of rank {stored_rank} where rank {rank}'s belong", FailureReason.KEY_MISMATCH)
    mac = bytes(data[off + _CRC.size : off + _CRC.size + TAG_BYTES]) if auth else b""
    return ChunkHeader(namespace, tuple(keys), tuple(crcs), block_bytes, stride, header_bytes, tuple(tags),
                       key_id, mac, stored_rank)


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
