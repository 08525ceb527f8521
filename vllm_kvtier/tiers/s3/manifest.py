"""Manifest objects: one writer's list of (object id, chunk header).

A reader can then rebuild its index with one GET per writer, instead of one ranged GET
per object.

A manifest is a cache, never the truth: the bucket listing says which objects exist. A
manifest entry is used only for an object the listing shows with at least the header's
size. A lost, stale or damaged manifest costs requests (header GETs), never correctness.
Without a key a manifest is not signed: whoever can write the bucket can write one. So a
reader treats it as hostile input. Its size is bounded before it is read
(:func:`max_manifest_bytes`). It is decoded entry by entry as its bytes arrive
(:func:`iter_manifest`). Only the entries a reader keeps (the listed objects) become
Python objects.

Signed (a key is set): the bytes below, then a trailer of :data:`SIG_MAGIC`, the key id
and an HMAC over them bound to the namespace, rank and writer id (:func:`sign_manifest`).
A reader streams the bytes through :func:`signed_body`, which checks the trailer when they
end. The scanner does so over the raw bytes before it decodes any of them: a forged
manifest costs an HMAC pass, never a decode.

Names (:func:`manifest_file_name`): without a key, ``<writer id>.kvm``. With a key,
``<writer id>.<tag>.kvm``, the tag 16 hex digits of a MAC over the namespace, rank and
writer id (:meth:`~vllm_kvtier.tiers.auth.ChunkAuth.manifest_name_tag`). A reader with a
key checks the tag from the listing alone (:func:`manifest_name_refusal`). So a forger
without the key cannot make a name it will read: a flood of forged manifests costs no GET.
One who overwrites a real writer's manifest is caught by its signature, one GET per change.

The header bytes in the layout below are the chunk's own header (``chunkformat``). They
are verified again with their own CRC32 when decoded. Their zero padding is what zlib
removes. Nothing is unpickled. Layout (little endian)::

    magic b"KVTMANI1", version u32, namespace 16s, entry count u32, payload length u64
    payload: zlib( per entry: id length u16, id (ASCII), header length u32, header bytes )
    CRC32 of everything above, u32
"""

from __future__ import annotations

import hmac
import struct
import zlib
from collections.abc import Callable, Container, Iterable, Iterator

from vllm_kvtier.chunkformat import (
    MAX_CHUNK_BLOCKS,
    ChunkFormatError,
    ChunkHeader,
    bounded_header_bytes,
    decode_header,
    encode_header,
    header_bytes_for,
)
from vllm_kvtier.config.stores import MAX_MANIFEST_ENTRIES
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.keys import SAFE_ID
from vllm_kvtier.tiers.auth import MANIFEST_NAME_TAG_BYTES, ChunkAuth
from vllm_kvtier.tiers.s3.config import MANIFEST_SUFFIX

MAGIC = b"KVTMANI1"
VERSION = 1
#: The most entries a manifest may announce when the caller gives no bound of its own (a
#: store passes ``s3.manifest_max_entries``); checked before anything is decoded.
MAX_ENTRIES = MAX_MANIFEST_ENTRIES
#: Compressed bytes fed to zlib per step: the decompressed bytes held at once stay about
#: one entry plus what this much input can expand to.
_STEP = 64 << 10
#: The most a manifest's payload may inflate, per compressed byte. An honest one inflates
#: at most about 43 times (one-block chunks: a 4 KiB header of which ~100 B are not zero
#: padding; block keys are hashes); a zip bomb a thousand times. So decoding costs CPU in
#: proportion to the bytes read, whoever wrote them.
MAX_INFLATION = 128
#: Inflated bytes allowed beyond that ratio: small manifests of test-like keys (which
#: compress far better than hashes) always decode.
_INFLATION_SLACK = 4 << 20

_FIXED = struct.Struct("<8sI16sIQ")
_ID = struct.Struct("<H")
_HLEN = struct.Struct("<I")
_CRC = struct.Struct("<I")
_MAX_ID = 128


def max_entry_bytes(max_blocks: int = MAX_CHUNK_BLOCKS) -> int:
    """The most uncompressed payload bytes one entry can take.

    That is the longest id and the longest header of ``max_blocks`` blocks (either header
    version)."""
    return _ID.size + _MAX_ID + _HLEN.size + header_bytes_for(max_blocks, True)


def max_manifest_bytes(max_entries: int, max_blocks: int = MAX_CHUNK_BLOCKS) -> int:
    """The largest manifest object of ``max_entries`` entries of at most ``max_blocks``
    blocks.

    It is the fixed part, the CRC, and zlib's worst case for the payload. Data that does
    not compress goes out as stored blocks: 5 bytes per 16 KiB or so, plus 11. A reader
    refuses a larger object before it reads a byte of it."""
    raw = max_entries * max_entry_bytes(max_blocks)
    return _FIXED.size + _CRC.size + raw + (raw >> 12) + 64


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


def decode_manifest(data: bytes, namespace: str, *, max_blocks: int = MAX_CHUNK_BLOCKS,
                    max_entries: int = MAX_ENTRIES, block_bytes: int | None = None,
                    keep: Container[str] | None = None) -> dict[str, ChunkHeader]:
    """Parse and verify a whole manifest held in memory (:func:`iter_manifest` over
    ``data``; ``keep`` as there). Raises ChunkFormatError on any mismatch."""
    return dict(iter_manifest([data], namespace, max_blocks=max_blocks, max_entries=max_entries,
                              block_bytes=block_bytes, keep=keep))


def iter_manifest(pieces: Iterable[bytes | bytearray | memoryview], namespace: str, *,
                  max_blocks: int = MAX_CHUNK_BLOCKS, max_entries: int = MAX_ENTRIES,
                  block_bytes: int | None = None,
                  keep: Container[str] | None = None) -> Iterator[tuple[str, ChunkHeader]]:
    """Decode a manifest entry by entry from its bytes as they arrive.

    ``pieces``: the object's body in any split. The producer may reuse a piece once the
    next one is asked for. Yields (object id, header) for the entries whose id is in
    ``keep`` (None: all). An entry not kept is bounded and skipped, its header never
    decoded. Raises ChunkFormatError on any mismatch. The CRC32 of the whole object is
    checked last (after the last entry). So the caller keeps what it was given only once
    the iterator ended without raising.

    Nothing in it sizes memory before it is bounded. The entry count is bounded by
    ``max_entries`` (``too_large``, before anything is inflated). Each entry's header is
    bounded by ``max_blocks`` (and ``block_bytes`` when given) before it is decoded. The
    payload is decompressed step by step. Never more than one entry's bound plus one
    step's output is held at once. So a damaged or forged length field cannot make a
    reader inflate a huge buffer. Memory held: about one step of input and one entry, plus
    the entries yielded (the caller's)."""
    src = _Stream(pieces)
    magic, version, ns, count, plen = _FIXED.unpack(src.read(_FIXED.size))
    if magic != MAGIC or version != VERSION:
        raise ChunkFormatError("bad manifest magic or version", FailureReason.FORMAT)
    if ns.rstrip(b"\0").decode("ascii", "replace") != namespace:
        raise ChunkFormatError("namespace mismatch", FailureReason.NAMESPACE)
    if count > max_entries:
        raise ChunkFormatError(f"too large: a manifest of {count} entries, at most {max_entries}",
                               FailureReason.TOO_LARGE)
    if plen > max_manifest_bytes(max_entries, max_blocks):
        raise ChunkFormatError(f"too large: a manifest payload of {plen} B", FailureReason.TOO_LARGE)
    left = plen

    def more() -> bytes | None:
        nonlocal left
        if not left:
            return None
        got = src.read(min(_STEP, left))
        left -= len(got)
        return got

    max_head = header_bytes_for(max_blocks, True)  # either version (an authenticated header is longer)
    reader = _Inflater(more, max_entry_bytes(max_blocks))
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
        if keep is not None and oid not in keep:
            continue  # not listed: no object made of it
        if bounded_header_bytes(head, max_blocks=max_blocks, block_bytes=block_bytes) != hlen:
            raise ChunkFormatError("manifest header of the wrong length", FailureReason.FORMAT)
        yield oid, decode_header(head, namespace)
    while more() is not None:  # the rest of the payload (zlib's end), for the CRC
        pass
    crc = src.crc
    if _CRC.unpack(src.read(_CRC.size))[0] != crc:
        raise ChunkFormatError("manifest checksum mismatch", FailureReason.CHECKSUM)
    if not src.at_end():
        raise ChunkFormatError("manifest longer than its payload", FailureReason.FORMAT)


class _Stream:
    """A manifest's bytes as they arrive: exact reads, and the running CRC32 of what was read."""

    def __init__(self, pieces: Iterable[bytes | bytearray | memoryview]) -> None:
        self._it = iter(pieces)
        self._cur = memoryview(b"")
        self.crc = 0

    def _next(self) -> bool:
        for piece in self._it:
            self._cur = memoryview(piece).cast("B")
            if self._cur.nbytes:
                return True
        return False

    def read(self, n: int) -> bytes:
        """Exactly ``n`` bytes (``truncated`` if the object ends first).

        ``n`` is always a bounded size: a fixed field, or at most one step."""
        out = bytearray()
        while len(out) < n:
            if not self._cur.nbytes and not self._next():
                raise ChunkFormatError("truncated manifest", FailureReason.TRUNCATED)
            take = self._cur[: n - len(out)]
            out += take
            self._cur = self._cur[take.nbytes :]
        self.crc = zlib.crc32(out, self.crc)
        return bytes(out)

    def at_end(self) -> bool:
        return not self._cur.nbytes and not self._next()


class _Inflater:
    """The decompressed payload, handed out in pieces as it is inflated.

    It never inflates more than :data:`MAX_INFLATION` times the compressed bytes it
    consumed (plus 4 MiB). So a zip bomb costs CPU in proportion to its size, as an honest
    manifest does."""

    def __init__(self, more: Callable[[], bytes | None], max_piece: int) -> None:
        self._d = zlib.decompressobj()
        self._more = more
        self._buf = bytearray()
        self._max = max_piece
        self._fed = 0  # compressed bytes handed to zlib (its unconsumed tail included)
        self._made = 0  # bytes inflated

    def take(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self._d.unconsumed_tail
            if not chunk:
                got = self._more()
                if got is None:
                    raise ChunkFormatError("truncated manifest entry", FailureReason.TRUNCATED)
                chunk = got
                self._fed += len(chunk)
            try:
                out = self._d.decompress(chunk, self._max)
            except zlib.error as e:
                raise ChunkFormatError(f"manifest payload: {e}", FailureReason.FORMAT) from e
            self._made += len(out)
            used = self._fed - len(self._d.unconsumed_tail)
            if self._made > MAX_INFLATION * used + _INFLATION_SLACK:
                raise ChunkFormatError(f"too large: a manifest payload inflating more than {MAX_INFLATION}x",
                                       FailureReason.TOO_LARGE)
            self._buf += out
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out


# ---- names (a key is set: the name carries a tag) ---------------------------------------------


def manifest_file_name(writer_id: str, auth: ChunkAuth | None, namespace: str, rank: int) -> str:
    """The object name (after ``.../manifest/``) of writer ``writer_id``'s manifest."""
    if auth is None:
        return f"{writer_id}{MANIFEST_SUFFIX}"
    return f"{writer_id}.{auth.manifest_name_tag(namespace, rank, writer_id)}{MANIFEST_SUFFIX}"


def manifest_name_refusal(file_name: str, auth: ChunkAuth | None, namespace: str,
                          rank: int) -> tuple[str, FailureReason | None]:
    """The writer id that a manifest's object name ``file_name`` gives.

    Also why a reader holding ``auth`` must not read it (None: it may). No key: every name
    is read, and the whole stem is the writer id. With a key, a name without a tag is
    ``unauthenticated``. That is an older build's name, or a forger's. A tag no accepted
    key makes is ``auth_failed``."""
    stem = file_name.removesuffix(MANIFEST_SUFFIX)
    if auth is None:
        return stem, None
    writer, _, tag = stem.rpartition(".")
    if (len(tag) != 2 * MANIFEST_NAME_TAG_BYTES or tag.strip("0123456789abcdef")
            or not SAFE_ID.fullmatch(writer)):
        return stem, FailureReason.UNAUTHENTICATED
    if not auth.verify_manifest_name_tag(namespace, rank, writer, tag):
        return writer, FailureReason.AUTH_FAILED
    return writer, None


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


def signed_body(pieces: Iterable[bytes | bytearray | memoryview],
                hashers: dict[bytes, hmac.HMAC] | None) -> Iterator[memoryview]:
    """The manifest bytes of a stored manifest as they arrive (``pieces``), for
    :func:`iter_manifest`.

    The signature trailer is left out. It is checked when the pieces end. So an iterator
    over what this yields ends without raising only if it verifies.

    ``hashers``: a store's running MACs by accepted key id
    (:meth:`~vllm_kvtier.tiers.auth.ChunkAuth.manifest_hashers`). The manifest must be
    signed with one of them. Else it raises ChunkFormatError ``unauthenticated``. A MAC
    that does not verify is ``auth_failed``. None (no key): a signed manifest is refused
    as ``unauthenticated``. Its chunks are signed, and this store serves none. It holds
    back the last :data:`SIG_BYTES` bytes at most, so memory stays one piece."""
    tail = b""
    for piece in pieces:
        data = tail + bytes(piece)
        if len(data) <= SIG_BYTES:
            tail = data
            continue
        out, tail = data[:-SIG_BYTES], data[-SIG_BYTES:]
        for h in (hashers or {}).values():
            h.update(out)
        yield memoryview(out)
    signed = len(tail) == SIG_BYTES and tail.startswith(SIG_MAGIC)
    if hashers is None:
        if signed:
            raise ChunkFormatError("a signed manifest, and this store holds no key", FailureReason.UNAUTHENTICATED)
        if tail:
            yield memoryview(tail)
        return
    if not signed:
        raise ChunkFormatError("an unsigned manifest, and this store verifies MACs", FailureReason.UNAUTHENTICATED)
    key_id, mac = tail[len(SIG_MAGIC) : len(SIG_MAGIC) + 8], tail[len(SIG_MAGIC) + 8 :]
    running = hashers.get(key_id)
    if running is None:
        raise ChunkFormatError(f"a manifest signed with key id {key_id.hex()}, not accepted here",
                               FailureReason.UNAUTHENTICATED)
    if not hmac.compare_digest(running.digest(), mac):
        raise ChunkFormatError("the manifest's MAC does not verify", FailureReason.AUTH_FAILED)
