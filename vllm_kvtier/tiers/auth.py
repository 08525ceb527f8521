"""Authenticated chunks: the keys, the tags and MACs of the version 4 chunk format.

Why: a CRC32 detects accidents, not intent. Anyone who can write to a shared bucket or
join a Mooncake pool can compute our block keys offline. They are vLLM's chained hashes of
token ids. Such a writer can plant a chunk with valid CRCs that every reader would serve.
With a key, every chunk carries a MAC that only holders of the key can make. The store
kernel (:mod:`~vllm_kvtier.tiers.kernel`) verifies it before a block is delivered.

What is signed (:mod:`~vllm_kvtier.chunkformat`, version 4):

* Each block: ``tag = HMAC-SHA256(key, "kvtier.block.v3" | namespace | rank | key length | block key | block bytes)``.
  It is stored in the block's header entry. So a read of a few blocks of a chunk verifies
  just those. A block moved to another position, key, rank or namespace fails.
* The header: ``mac = HMAC-SHA256(key, "kvtier.header.v2" | chunk id | header bytes before the MAC)``.
  It covers the namespace, the store rank, every size, every key and every tag. So a
  header cannot be replayed under another chunk id or edited. It vouches for the tags of
  the blocks it lists. The reader checks that the rank it covers is its own. Every TP/PP
  rank stores its shard under the same chunk id. Only the medium's path, which is not
  signed, tells them apart.
* A manifest (:meth:`ChunkAuth.manifest_mac`): ``HMAC-SHA256(key, "kvtier.manifest.v1" |
  namespace | rank | writer id | manifest bytes)``. So a manifest cannot be forged, nor
  moved to another rank or another writer's name.
* A manifest's object name (:meth:`ChunkAuth.manifest_name_tag`): 8 bytes of
  ``HMAC-SHA256(key, "kvtier.manifest-name.v1" | namespace | rank | writer id)``, in hex.
  A reader refuses a name whose tag does not verify from the listing alone, with no GET.

Several keys (rotation): one *signs* (``auth.key_file`` / ``auth.key_env``). Any number
of *verify keys* (``auth.verify_key_files`` / ``auth.verify_key_envs``) are accepted too
on reads. A chunk names the key that signed it by its key id, so a reader picks the key.

HMAC-SHA256 rather than keyed BLAKE2b: measured with Python's hashlib on this project's
x86 machines (SHA-NI), 1.9 GB/s against 1.1 GB/s for one core on 4 MiB. Both release the
GIL, so a store's I/O threads verify in parallel. See bench/nvme_throughput.py ``--auth``.

The key: at least 32 bytes, given as hex (64+ hex digits, whitespace ignored). It comes
from an environment variable (``auth.key_env``, default ``KVTIER_AUTH_KEY``) or a small
file (``auth.key_file``, a mounted secret). Never in config values, never logged, never in
a repr. Only its *key id* is stored in chunks and may be logged. The key id is 8 bytes of
HMAC of a fixed label, which tells nothing of the key.

Who calls it: the kernel's I/O threads (tag and verify; a :class:`ChunkAuth` is immutable
and thread-safe). Also the worker's start-up (:func:`load_auth`, which may raise
:class:`~vllm_kvtier.errors.ConfigError`).
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllm_kvtier.chunkformat import KEY_ID_BYTES, MAX_KEY, ChunkHeader, signed_bytes
from vllm_kvtier.config.files import read_small_file
from vllm_kvtier.config.integrity import AuthConfig
from vllm_kvtier.errors import ConfigError, FailureReason

__all__ = ["MIN_KEY_BYTES", "ChunkAuth", "load_auth", "parse_key", "refusal", "refusal_reason"]

logger = logging.getLogger(__name__)

#: The shortest key accepted (HMAC-SHA256's full strength).
MIN_KEY_BYTES = 32
#: The longest key accepted (a key file is a few hundred bytes at most).
MAX_KEY_BYTES = 1024

_BLOCK = b"kvtier.block.v3\0"
_HEADER = b"kvtier.header.v2"
_KEY_ID = b"kvtier.key-id.v2"
_MANIFEST = b"kvtier.manifest.v1"
_MANIFEST_NAME = b"kvtier.manifest-name.v1"
#: Bytes of a manifest name's tag (16 hex digits in the name).
MANIFEST_NAME_TAG_BYTES = 8
#: Verify keys accepted at most (a rotation needs one or two).
MAX_VERIFY_KEYS = 8


def _key_id(key: bytes) -> bytes:
    return hmac.digest(key, _KEY_ID, "sha256")[:KEY_ID_BYTES]


class ChunkAuth:
    """The signing key and the verify keys, and what the chunk format computes with them.

    The keys themselves are private: not in ``repr``, not in any log line. Key ids
    (:attr:`key_id`, :attr:`key_ids`) are what identify them.

    ``key`` signs every chunk written, and verifies. ``verify``: older (or newer) keys
    whose chunks are accepted on reads too. They are never used to sign. This is for a key
    rotation: see docs/security.md."""

    __slots__ = ("_key", "_keys", "key_id", "key_ids")

    def __init__(self, key: bytes, verify: Sequence[bytes] = ()) -> None:
        for k in (key, *verify):
            if len(k) < MIN_KEY_BYTES:
                raise ValueError(f"an auth key needs at least {MIN_KEY_BYTES} bytes, got {len(k)}")
        self._key = bytes(key)
        #: 8 bytes derived from the signing key: stored in every chunk it signs, safe to log.
        self.key_id: bytes = _key_id(self._key)
        #: key id -> key, of every key accepted on reads (the signing key's first)
        self._keys: dict[bytes, bytes] = {self.key_id: self._key}
        for k in verify:
            self._keys.setdefault(_key_id(bytes(k)), bytes(k))
        #: The ids of every key accepted on reads (the signing key's and the verify keys').
        self.key_ids: frozenset[bytes] = frozenset(self._keys)

    def __repr__(self) -> str:
        extra = [k.hex() for k in self._keys if k != self.key_id]
        return f"ChunkAuth(key_id={self.key_id.hex()}" + (f", verify={extra}" if extra else "") + ")"

    def block_tag(self, namespace: str, rank: int, key: bytes, data: memoryview | bytes,
                  key_id: bytes | None = None) -> bytes:
        """The tag of one block's bytes under its namespace, store rank and block key.

        It uses the signing key, or the accepted key ``key_id``. KeyError if that is not
        one."""
        if len(key) > MAX_KEY:
            raise ValueError(f"block key longer than {MAX_KEY} bytes")
        h = hmac.new(self._secret(key_id), _BLOCK + namespace.encode("ascii").ljust(16, b"\0") + rank.to_bytes(4, "little")
                     + bytes([len(key)]) + key, "sha256")
        h.update(data)
        return h.digest()

    def header_mac(self, chunk_id: str, h: ChunkHeader, key_id: bytes | None = None) -> bytes:
        """The MAC of header ``h`` stored as ``chunk_id`` (over :func:`signed_bytes`), with
        the signing key (or the accepted key ``key_id``)."""
        cid = chunk_id.encode("ascii")
        return hmac.digest(self._secret(key_id), _HEADER + bytes([len(cid)]) + cid + signed_bytes(h), "sha256")

    def _secret(self, key_id: bytes | None) -> bytes:
        """The signing key (None), or the accepted key ``key_id`` (KeyError if not one)."""
        return self._key if key_id is None else self._keys[key_id]

    def accepts(self, key_id: bytes) -> bool:
        """Whether chunks signed by the key ``key_id`` are accepted on reads."""
        return key_id in self._keys

    def verify_header(self, chunk_id: str, h: ChunkHeader) -> bool:
        """Whether ``h`` was signed for ``chunk_id`` with an accepted key (constant-time compare)."""
        return h.key_id in self._keys and hmac.compare_digest(self.header_mac(chunk_id, h, h.key_id), h.mac)

    def verify_block(self, namespace: str, rank: int, key: bytes, data: memoryview | bytes, tag: bytes,
                     key_id: bytes) -> bool:
        """Whether ``tag`` is the tag of the block under key ``key_id`` (False if not accepted)."""
        if key_id not in self._keys:
            return False
        return hmac.compare_digest(self.block_tag(namespace, rank, key, data, key_id), tag)

    def manifest_mac(self, namespace: str, rank: int, writer_id: str, body: bytes | memoryview,
                     key_id: bytes | None = None) -> bytes:
        """The MAC of manifest bytes ``body`` of writer ``writer_id`` for (namespace, rank),
        with the signing key (or the accepted key ``key_id``; KeyError if it is not one)."""
        h = hmac.new(self._secret(key_id), _manifest_label(namespace, rank, writer_id), "sha256")
        h.update(body)
        return h.digest()

    def manifest_hashers(self, namespace: str, rank: int, writer_id: str) -> dict[bytes, hmac.HMAC]:
        """Key id -> a running MAC of writer ``writer_id``'s manifest for (namespace, rank).

        There is one per accepted key. A reader streams the manifest's bytes through them
        all. The trailer's key id, read last, says which one must match."""
        label = _manifest_label(namespace, rank, writer_id)
        return {kid: hmac.new(secret, label, "sha256") for kid, secret in self._keys.items()}

    def manifest_name_tag(self, namespace: str, rank: int, writer_id: str) -> str:
        """The tag (16 hex digits) in the object name of writer ``writer_id``'s manifest for
        (namespace, rank), with the signing key. Only a key holder can make one."""
        label = _MANIFEST_NAME + _manifest_label(namespace, rank, writer_id)[len(_MANIFEST) :]
        return hmac.digest(self._key, label, "sha256")[:MANIFEST_NAME_TAG_BYTES].hex()

    def verify_manifest_name_tag(self, namespace: str, rank: int, writer_id: str, tag: str) -> bool:
        """Whether ``tag`` is writer ``writer_id``'s manifest name tag for (namespace, rank)
        under any accepted key (constant-time compares, all keys tried)."""
        label = _MANIFEST_NAME + _manifest_label(namespace, rank, writer_id)[len(_MANIFEST) :]
        ok = False
        for secret in self._keys.values():
            want = hmac.digest(secret, label, "sha256")[:MANIFEST_NAME_TAG_BYTES].hex()
            ok |= hmac.compare_digest(want, tag)
        return ok


def _manifest_label(namespace: str, rank: int, writer_id: str) -> bytes:
    """What a manifest's MAC binds besides its bytes: the namespace, rank and writer id."""
    wid = writer_id.encode("ascii")
    return _MANIFEST + namespace.encode("ascii").ljust(16, b"\0") + rank.to_bytes(4, "little") + bytes([len(wid)]) + wid


def refusal(auth: ChunkAuth | None, chunk_id: str, h: ChunkHeader) -> tuple[FailureReason, str] | None:
    """Why a store holding ``auth`` (None: no key) must not trust header ``h`` of
    ``chunk_id`` (None: it may). Unsigned chunks are trusted only without a key; signed
    ones only with an accepted key and a MAC that verifies. Used by every read (the store
    kernel) and every scan before a header is indexed."""
    if auth is None:
        if h.authenticated:
            return FailureReason.UNAUTHENTICATED, "a signed chunk, and this store holds no key"
        return None
    if not h.authenticated:
        return FailureReason.UNAUTHENTICATED, "an unsigned chunk, and this store verifies MACs"
    if not auth.accepts(h.key_id):
        return FailureReason.UNAUTHENTICATED, (f"signed with key id {h.key_id.hex()}, this store accepts "
                                               f"{sorted(k.hex() for k in auth.key_ids)}")
    if not auth.verify_header(chunk_id, h):
        return FailureReason.AUTH_FAILED, "the header's MAC does not verify"
    return None


def refusal_reason(auth: ChunkAuth | None, chunk_id: str, h: ChunkHeader) -> FailureReason | None:
    """:func:`refusal`'s reason alone (a scan's filter)."""
    why = refusal(auth, chunk_id, h)
    return None if why is None else why[0]


def parse_key(text: str, where: str) -> bytes:
    """The key in ``text`` (hex, whitespace ignored). ConfigError naming ``where`` (a field
    or an environment variable) if it is not hex or shorter than :data:`MIN_KEY_BYTES`;
    the message never quotes the text."""
    digits = "".join(text.split())
    try:
        key = bytes.fromhex(digits)
    except ValueError:
        raise ConfigError(where, f"the key must be hex digits ({2 * MIN_KEY_BYTES} or more), "
                                 "e.g. from `openssl rand -hex 32`") from None
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise ConfigError(where, f"the key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes "
                                 f"({2 * MIN_KEY_BYTES}+ hex digits), got {len(key)} bytes")
    return key


def _read_key_file(path_text: str, where: str, allow_readable: bool) -> bytes:
    """The key in the file ``path_text``. A key file must be a small regular file; one that
    group or other can read is refused unless ``allow_readable``. ConfigError naming ``where``."""
    path = Path(path_text)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ConfigError(where, f"cannot read the key file {path}: {e.strerror}") from None
    if stat.S_ISREG(mode) and mode & 0o077 and not allow_readable:
        raise ConfigError(where, f"the key file {path} is readable by group or other (mode "
                                 f"{stat.S_IMODE(mode):o}); chmod 600 it, or set auth.allow_readable_key_file")
    try:
        text = read_small_file(path, 4 * MAX_KEY_BYTES)
    except ValueError as e:
        raise ConfigError(where, str(e)) from None
    return parse_key(text, where)


def check_key_files(cfg: AuthConfig) -> None:
    """Read every key file ``cfg`` names (``auth.key_file``, ``auth.verify_key_files``)
    as the engine will at start-up; the keys are not kept. ConfigError naming the field
    and the file when one cannot be used. For ``kvtier check-config`` and ``kvtier doctor``:
    a missing key file fails there, not at the engine's start."""
    if cfg.key_file is not None:
        _read_key_file(cfg.key_file, "auth.key_file", cfg.allow_readable_key_file)
    for i, f in enumerate(cfg.verify_key_files):
        _read_key_file(f, f"auth.verify_key_files[{i}]", cfg.allow_readable_key_file)


def load_auth(cfg: AuthConfig, environ: Mapping[str, str] | None = None) -> ChunkAuth | None:
    """The keys ``cfg`` points at.

    The signing key comes from ``auth.key_file`` if set, else the environment variable
    ``auth.key_env``. None when neither holds one (unauthenticated). But with
    ``auth.required`` that raises ConfigError. Then come the verify keys
    (``auth.verify_key_files``, ``auth.verify_key_envs``). Each must hold a key, and they
    need a signing key (ConfigError naming the entry). Called at start-up, once per
    process that builds stores or scans them.

    A key file must be a small regular file. One that group or other can read is refused
    (ConfigError naming the field), unless ``auth.allow_readable_key_file``."""
    env = os.environ if environ is None else environ
    key: bytes | None = None
    if cfg.key_file is not None:
        key = _read_key_file(cfg.key_file, "auth.key_file", cfg.allow_readable_key_file)
    else:
        value = env.get(cfg.key_env)
        if value is not None and value.strip():
            key = parse_key(value, f"auth.key_env (environment variable {cfg.key_env})")
    verify: list[bytes] = []
    for i, f in enumerate(cfg.verify_key_files):
        verify.append(_read_key_file(f, f"auth.verify_key_files[{i}]", cfg.allow_readable_key_file))
    for i, name in enumerate(cfg.verify_key_envs):
        where = f"auth.verify_key_envs[{i}] (environment variable {name})"
        value = env.get(name)
        if value is None or not value.strip():
            raise ConfigError(where, "not set: a verify key named in the config must be there")
        verify.append(parse_key(value, where))
    if key is None:
        if cfg.required:
            where = f"file {cfg.key_file}" if cfg.key_file else f"environment variable {cfg.key_env}"
            raise ConfigError("auth.required", f"no key found ({where}); refusing to run unauthenticated")
        if verify:
            field = "auth.verify_key_files" if cfg.verify_key_files else "auth.verify_key_envs"
            raise ConfigError(field, "verify keys without a signing key (auth.key_file or auth.key_env): "
                                     "set the signing key too")
        return None
    auth = ChunkAuth(key, verify)
    logger.info("kvtier auth: chunks of %s are signed with key id %s and verified with key ids %s",
                "every tier below CPU" if cfg.local_tiers else "the shared tiers (s3, mooncake)", auth.key_id.hex(),
                ", ".join(sorted(k.hex() for k in auth.key_ids)))
    return auth
