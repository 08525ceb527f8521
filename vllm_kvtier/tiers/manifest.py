"""Manifest objects: one writer's list of (object id, chunk header), so that a reader can
rebuild its index with one GET per writer instead of one ranged GET per object.

A manifest is a cache, never the truth: the bucket listing says which objects exist, and a
manifest entry is used only for an object the listing shows with at least the header's
size. A lost, stale or damaged manifest costs requests (header GETs), never correctness.

Layout (little endian)::

    magic b"KVTMANI1", version u32, namespace 16s, entry count u32, payload length u64
    payload: zlib( per entry: id length u16, id (ASCII), header length u32, header bytes )
    CRC32 of everything above, u32

The header bytes are exactly the chunk's own header (``chunkfile``), verified again with
its own CRC32 when decoded; their zero padding is what zlib removes. Nothing is unpickled.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

from vllm_kvtier.tiers.chunkfile import ChunkFormatError, ChunkHeader, decode_header, encode_header

MAGIC = b"KVTMANI1"
VERSION = 1
#: Decompressed payload bound: a damaged length field must not size a huge allocation.
MAX_PAYLOAD_BYTES = 1 << 30

_FIXED = struct.Struct("<8sI16sIQ")
_ID = struct.Struct("<H")
_HLEN = struct.Struct("<I")
_CRC = struct.Struct("<I")


def encode_manifest(namespace: str, entries: Iterable[tuple[str, ChunkHeader]]) -> bytes:
    parts: list[bytes] = []
    count = 0
    for object_id, h in entries:
        oid = object_id.encode("ascii")
        head = bytearray(h.header_bytes)
        encode_header(h, memoryview(head))
        parts += [_ID.pack(len(oid)), oid, _HLEN.pack(len(head)), bytes(head)]
        count += 1
    payload = zlib.compress(b"".join(parts), 1)  # level 1: the padding is all it needs to remove
    out = _FIXED.pack(MAGIC, VERSION, namespace.encode("ascii"), count, len(payload)) + payload
    return out + _CRC.pack(zlib.crc32(out))


def decode_manifest(data: bytes, namespace: str) -> dict[str, ChunkHeader]:
    """Parse and verify a manifest. Raises ChunkFormatError on any mismatch."""
    if len(data) < _FIXED.size + _CRC.size:
        raise ChunkFormatError("truncated manifest")
    magic, version, ns, count, plen = _FIXED.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise ChunkFormatError("bad manifest magic or version")
    if ns.rstrip(b"\0").decode("ascii", "replace") != namespace:
        raise ChunkFormatError("namespace mismatch")
    end = _FIXED.size + plen
    if len(data) != end + _CRC.size:
        raise ChunkFormatError("truncated manifest")
    if _CRC.unpack_from(data, end)[0] != zlib.crc32(memoryview(data)[:end]):
        raise ChunkFormatError("manifest checksum mismatch")
    d = zlib.decompressobj()
    body = d.decompress(memoryview(data)[_FIXED.size : end], MAX_PAYLOAD_BYTES)
    if d.unconsumed_tail:
        raise ChunkFormatError("manifest payload too large")
    out: dict[str, ChunkHeader] = {}
    off = 0
    try:
        for _ in range(count):
            (n,) = _ID.unpack_from(body, off)
            oid = body[off + _ID.size : off + _ID.size + n].decode("ascii")
            off += _ID.size + n
            (hlen,) = _HLEN.unpack_from(body, off)
            off += _HLEN.size
            out[oid] = decode_header(body[off : off + hlen], namespace)
            off += hlen
    except (struct.error, UnicodeDecodeError) as e:
        raise ChunkFormatError(f"truncated manifest entry: {e}") from e
    return out
