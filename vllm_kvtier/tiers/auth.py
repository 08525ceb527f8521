"""Authenticated chunks: the key, the tags and MACs of the version 2 chunk format.

Why: a CRC32 detects accidents, not intent. Anyone who can write to a shared bucket or
join a Mooncake pool can compute our block keys offline (they are vLLM's chained hashes of
token ids) and plant a chunk with valid CRCs that every reader would serve. With a key,
every chunk carries a MAC that only holders of the key can make, and the store kernel
(:mod:`~vllm_kvtier.tiers.kernel`) verifies it before a block is delivered.

What is signed (:mod:`~vllm_kvtier.tiers.chunkfile`, version 2):

* each block: ``tag = HMAC-SHA256(key, "kvtier.block.v2" | namespace | key length | block key | block bytes)``,
  stored in the block's header entry, so a read of a few blocks of a chunk verifies just
  those (and a block moved to another position, key or namespace fails);
* the header: ``mac = HMAC-SHA256(key, "kvtier.header.v2" | chunk id | header bytes before the MAC)``,
  which covers the namespace, every size, every key and every tag: a header cannot be
  replayed under another chunk id or edited, and it vouches for the tags of the blocks it
  lists.

HMAC-SHA256 rather than keyed BLAKE2b: measured with Python's hashlib on this project's
x86 machines (SHA-NI), 1.9 GB/s against 1.1 GB/s for one core on 4 MiB; both release the
GIL, so a store's I/O threads verify in parallel. See bench/nvme_throughput.py ``--auth``.

The key: at least 32 bytes, given as hex (64+ hex digits, whitespace ignored) in an
environment variable (``auth.key_env``, default ``KVTIER_AUTH_KEY``) or a small file
(``auth.key_file``, a mounted secret). Never in config values, never logged, never in a
repr: only its *key id* (8 bytes of HMAC of a fixed label, which tells nothing of the key)
is stored in chunks and may be logged.

Who calls it: the kernel's I/O threads (tag and verify; a :class:`ChunkAuth` is immutable
and thread-safe) and the worker's start-up (:func:`load_auth`, which may raise
:class:`~vllm_kvtier.errors.ConfigError`).
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from vllm_kvtier.config.parse import read_small_file
from vllm_kvtier.config.sections import AuthConfig
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.tiers.chunkfile import KEY_ID_BYTES, MAX_KEY, ChunkHeader, signed_bytes

__all__ = ["MIN_KEY_BYTES", "ChunkAuth", "load_auth", "parse_key"]

logger = logging.getLogger(__name__)

#: The shortest key accepted (HMAC-SHA256's full strength).
MIN_KEY_BYTES = 32
#: The longest key accepted (a key file is a few hundred bytes at most).
MAX_KEY_BYTES = 1024

_BLOCK = b"kvtier.block.v2\0"
_HEADER = b"kvtier.header.v2"
_KEY_ID = b"kvtier.key-id.v2"


class ChunkAuth:
    """A key, and what the chunk format computes with it. The key itself is private: not
    in ``repr``, not in any log line; :attr:`key_id` is what identifies it."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"an auth key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._key = bytes(key)
        #: 8 bytes derived from the key: stored in every chunk it signs, safe to log.
        self.key_id: bytes = hmac.digest(self._key, _KEY_ID, "sha256")[:KEY_ID_BYTES]

    def __repr__(self) -> str:
        return f"ChunkAuth(key_id={self.key_id.hex()})"

    def block_tag(self, namespace: str, key: bytes, data: memoryview | bytes) -> bytes:
        """The tag of one block's bytes under its namespace and block key."""
        if len(key) > MAX_KEY:
            raise ValueError(f"block key longer than {MAX_KEY} bytes")
        h = hmac.new(self._key, _BLOCK + namespace.encode("ascii").ljust(16, b"\0") + bytes([len(key)]) + key,
                     "sha256")
        h.update(data)
        return h.digest()

    def header_mac(self, chunk_id: str, h: ChunkHeader) -> bytes:
        """The MAC of header ``h`` stored as ``chunk_id`` (over :func:`signed_bytes`)."""
        cid = chunk_id.encode("ascii")
        return hmac.digest(self._key, _HEADER + bytes([len(cid)]) + cid + signed_bytes(h), "sha256")

    def verify_header(self, chunk_id: str, h: ChunkHeader) -> bool:
        """Whether ``h`` was signed with this key for ``chunk_id`` (constant-time compare)."""
        return h.key_id == self.key_id and hmac.compare_digest(self.header_mac(chunk_id, h), h.mac)

    def verify_block(self, namespace: str, key: bytes, data: memoryview | bytes, tag: bytes) -> bool:
        return hmac.compare_digest(self.block_tag(namespace, key, data), tag)


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


def load_auth(cfg: AuthConfig, environ: Mapping[str, str] | None = None) -> ChunkAuth | None:
    """The key ``cfg`` points at: ``auth.key_file`` if set, else the environment variable
    ``auth.key_env``; None when neither holds one (unauthenticated) unless ``auth.required``,
    which raises ConfigError. Called at start-up, once per process that builds stores.

    A key file must be a small regular file; one that group or other can read is refused
    (ConfigError naming ``auth.key_file``) unless ``auth.allow_readable_key_file``."""
    env = os.environ if environ is None else environ
    key: bytes | None = None
    if cfg.key_file is not None:
        path = Path(cfg.key_file)
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            raise ConfigError("auth.key_file", f"cannot read the key file: {e.strerror}") from None
        if stat.S_ISREG(mode) and mode & 0o077 and not cfg.allow_readable_key_file:
            raise ConfigError("auth.key_file", f"the key file is readable by group or other (mode "
                                               f"{stat.S_IMODE(mode):o}); chmod 600 it, or set "
                                               "auth.allow_readable_key_file")
        try:
            text = read_small_file(path, 4 * MAX_KEY_BYTES)
        except ValueError as e:
            raise ConfigError("auth.key_file", str(e)) from None
        key = parse_key(text, "auth.key_file")
    else:
        value = env.get(cfg.key_env)
        if value is not None and value.strip():
            key = parse_key(value, f"auth.key_env (environment variable {cfg.key_env})")
    if key is None:
        if cfg.required:
            where = f"file {cfg.key_file}" if cfg.key_file else f"environment variable {cfg.key_env}"
            raise ConfigError("auth.required", f"no key found ({where}); refusing to run unauthenticated")
        return None
    auth = ChunkAuth(key)
    logger.info("kvtier auth: chunks of %s are signed and verified with key id %s",
                "every tier below CPU" if cfg.local_tiers else "the shared tiers (s3, mooncake)", auth.key_id.hex())
    return auth
