"""Manifest objects: one writer's list of (object id, chunk header), so that a reader can
rebuild its index with one GET per writer instead of one ranged GET per object.

A manifest is a cache, never the truth: the bucket listing says which objects exist, and a
manifest entry is used only for an object the listing shows with at least the header's
size. A lost, stale or damaged manifest costs requests (header GETs), never correctness.

Signed (a key is set): the bytes below, then a trailer of :data:`SIG_MAGIC`, the key id
and an HMAC over them bound to the namespace, rank and writer id (:func:`sign_manifest`,
:func:`split_signature`; the S3 store verifies it before decoding).

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

from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.chunkfile import (
    MAX_CHUNK_BLOCKS,
    ChunkFormatError,
    ChunkHeader,
    bounded_header_bytes,
    decode_header,
    encode_header,
    header_bytes_for,
)

MAGIC = b"KVTMANI1"
VERSION = 1
#: The most entries a manifest may announce: one writer's live chunks (a million chunks of
#: 16 blocks is far beyond any one cache); checked before anything is decoded.
MAX_ENTRIES = 1 << 20
#: Compressed bytes fed to zlib per step: the decompressed bytes held at once stay about
#: one entry plus what this much input can expand to.
_STEP = 64 << 10

_FIXED = struct.Struct("<8sI16sIQ")
_ID = struct.Struct("<H")
_HLEN = struct.Struct("<I")
_CRC = struct.Struct("<I")
_MAX_ID = 128


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


def decode_manifest(data: bytes | memoryview, namespace: str, *, max_blocks: int = MAX_CHUNK_BLOCKS,
                    max_entries: int = MAX_ENTRIES, block_bytes: int | None = None) -> dict[str, ChunkHeader]:
    """Parse and verify a manifest. Raises ChunkFormatError on any mismatch.

    Nothing in it sizes memory before it is bounded: the entry count by ``max_entries``
    (``too_large``), each entry's header by ``max_blocks`` (and ``block_bytes`` when given)
    before it is decoded, and the payload is decompressed step by step, never more than
    one entry's bound plus one step's output held at once (a damaged or forged length
    field cannot make a reader inflate a huge buffer)."""
    if len(data) < _FIXED.size + _CRC.size:
        raise ChunkFormatError("truncated manifest", FailureReason.TRUNCATED)
    magic, version, ns, count, plen = _FIXED.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise ChunkFormatError("bad manifest magic or version", FailureReason.FORMAT)
    if ns.rstrip(b"\0").decode("ascii", "replace") != namespace:
        raise ChunkFormatError("namespace mismatch", FailureReason.NAMESPACE)
    if count > max_entries:
        raise ChunkFormatError(f"too large: a manifest of {count} entries, at most {max_entries}",
                               FailureReason.TOO_LARGE)
    end = _FIXED.size + plen
    if len(data) != end + _CRC.size:
        raise ChunkFormatError("truncated manifest", FailureReason.TRUNCATED)
    if _CRC.unpack_from(data, end)[0] != zlib.crc32(memoryview(data)[:end]):
        raise ChunkFormatError("manifest checksum mismatch", FailureReason.CHECKSUM)
    max_head = header_bytes_for(max_blocks, True)  # either version (an authenticated header is longer)
    entry_bound = _ID.size + _MAX_ID + _HLEN.size + max_head
    reader = _Inflater(memoryview(data)[_FIXED.size : end], entry_bound)
    out: dict[str, ChunkHeader] = {}
    for _ in range(count):
        (n,) = _ID.unpack(reader.take(_ID.size))
        if not 0 < n <= _MAX_ID:
            raise ChunkFormatError(f"manifest entry id of {n} bytes", FailureReason.FORMAT)
        try:
            oid = reader.take(n).decode("ascii")
        except UnicodeDecodeError as e:
            raise ChunkFormatError(f"manifest entry id: {e}", FailureReason.FORMAT) from e
        (hlen,) = _HLEN.unpack(reader.take(_HLEN.size))
        if hlen > max_head:
            raise ChunkFormatError(f"too large: a manifest header of {hlen} B, at most {max_head}",
                                   FailureReason.TOO_LARGE)
        head = reader.take(hlen)
        if bounded_header_bytes(head, max_blocks=max_blocks, block_bytes=block_bytes) != hlen:
            raise ChunkFormatError("manifest header of the wrong length", FailureReason.FORMAT)
        out[oid] = decode_header(head, namespace)
    return out


class _Inflater:
    """The decompressed payload, handed out in pieces as it is inflated."""

    def __init__(self, payload: memoryview, max_piece: int) -> None:
        self._d = zlib.decompressobj()
        self._src = payload
        self._pos = 0
        self._buf = bytearray()
        self._max = max_piece

    def take(self, n: int) -> bytes:
        while len(self._buf) < n:
            if self._d.unconsumed_tail:
                chunk = self._d.unconsumed_tail
            elif self._pos < len(self._src):
                chunk = bytes(self._src[self._pos : self._pos + _STEP])
                self._pos += len(chunk)
            else:
                raise ChunkFormatError("truncated manifest entry", FailureReason.TRUNCATED)
            try:
                self._buf += self._d.decompress(chunk, self._max)
            except zlib.error as e:
                raise ChunkFormatError(f"manifest payload: {e}", FailureReason.FORMAT) from e
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out


# ---- signatures (a key is set: :meth:`~vllm_kvtier.tiers.auth.ChunkAuth.manifest_mac`) ------

#: A signed manifest is the manifest's bytes, then this magic, the key id (8 bytes) and
#: the MAC (32 bytes) over those bytes, bound to the namespace, rank and writer id.
SIG_MAGIC = b"KVTMSIG1"
SIG_BYTES = len(SIG_MAGIC) + 8 + 32


def sign_manifest(body: bytes, key_id: bytes, mac: bytes) -> bytes:
    """``body`` (an :func:`encode_manifest` result) with its signature trailer."""
    if len(key_id) != 8 or len(mac) != 32:
        raise ValueError("a manifest signature is an 8-byte key id and a 32-byte MAC")
    return body + SIG_MAGIC + key_id + mac


def split_signature(data: bytes | memoryview) -> tuple[bytes | memoryview, bytes, bytes]:
    """(manifest bytes, key id, MAC) of a stored manifest; key id and MAC empty when it
    carries no signature trailer. The manifest bytes of a signed one are a view of
    ``data`` (no copy). Nothing here is trusted yet: the caller verifies the MAC (or
    refuses a signed manifest it holds no key for) before decoding the bytes."""
    if len(data) > SIG_BYTES and bytes(data[-SIG_BYTES : -SIG_BYTES + len(SIG_MAGIC)]) == SIG_MAGIC:
        tail = bytes(data[-SIG_BYTES + len(SIG_MAGIC) :])
        return memoryview(data)[:-SIG_BYTES], tail[:8], tail[8:]
    return data, b"", b""
