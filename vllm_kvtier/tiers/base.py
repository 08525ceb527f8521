"""The common contract of a keyed block tier: put, get, contains, delete, usage, close.

Who calls it: one owner thread at a time (the worker's tier code, a tool, or a test).
Implementations are not thread-safe; the owner serialises calls. Calls may block: an
in-memory tier for one copy of a block, a disk tier for one file write (with fsync) or
read, bounded by the tier's timeout. Code that must not block the engine step uses the
submit/poll media (:class:`~vllm_kvtier.tiers.nvme.NVMeStore`) directly; this contract is
what every medium can promise, so one test suite (``tests/test_tier_contract.py``) runs
against all of them and :class:`~vllm_kvtier.tiers.memory.MemoryTier` is both the
reference implementation and the fake for higher layers.

Blocks have a fixed size, ``block_bytes``. A key is a non-empty ``bytes`` of at most
:data:`MAX_KEY_BYTES` (vLLM's chained block hash, which names the content): two puts under
one key carry the same bytes, so a second put stores nothing.

Failure semantics (style rule 9, failure becomes a miss and a counter): ``put`` and ``get``
never raise for a bad block, a full tier, a failed verification or an I/O error. ``put``
returns False (counted as ``store_failures``); ``get`` returns None, and when a stored
block fails its CRC32 check or cannot be read, the entry is dropped and counted as
``load_failures``. Each implementation owns a :class:`~vllm_kvtier.metrics.Counters` in
``counters`` and counts under its ``name`` (``evictions``, ``load_failures``,
``store_failures``). Programming errors (a key of the wrong type) may raise.

Eviction is least-recently-used within ``capacity_bytes``; ``put`` and a hit in ``get``
make a key the most recently used.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.chunkfile import MAX_KEY as MAX_KEY_BYTES

__all__ = ["MAX_KEY_BYTES", "BlockTier", "refusal", "count_failure"]


@runtime_checkable
class BlockTier(Protocol):
    """Keyed storage of fixed-size blocks, one medium per implementation."""

    #: Label in counters and logs ("memory", "cpu", "nvme").
    name: str
    #: Size of every block; a put of any other size is refused.
    block_bytes: int
    #: Upper bound of :meth:`usage_bytes`, as configured.
    capacity_bytes: int
    #: Where this tier counts evictions and failures, under ``name``.
    counters: Counters

    def put(self, key: bytes, data: bytes | memoryview) -> bool:
        """Store ``data`` under ``key``, evicting least recently used blocks to make room.

        Returns True if the block is stored, or was already present (then nothing is
        written and the key is refreshed). Returns False, and stores nothing, if refused:
        wrong size, bad key, a block that cannot fit even in an empty tier or when nothing
        is evictable, an I/O error, or the tier is closed. Never raises for those. Atomic:
        after a False, a later ``get`` of a new key misses; a reader never sees a partial
        block. Blocks evicted to make room stay evicted even if the write then fails.
        """
        ...

    def get(self, key: bytes) -> bytes | None:
        """The block's bytes, verified against the CRC32 recorded at put, or None.

        None is a miss: the key is absent, or the stored bytes failed verification or
        could not be read, in which case the entry is dropped (``contains`` becomes
        False) and ``load_failures`` is counted. Never raises for those.
        """
        ...

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is indexed. Does no I/O and no verification, so a following
        ``get`` can still miss if the medium was damaged meanwhile."""
        ...

    def delete(self, key: bytes) -> bool:
        """Drop ``key``; True if it was present. Space is reclaimed by the medium (for
        a disk, possibly after the call returns)."""
        ...

    def usage_bytes(self) -> int:
        """Bytes of the medium held by stored blocks, including per-block overhead (a file
        header); never more than ``capacity_bytes``."""
        ...

    def close(self) -> None:
        """Release the medium (finishing queued I/O). Idempotent. Afterwards ``put``
        returns False and ``get`` returns None; what a durable tier wrote stays."""
        ...


def refusal(key: bytes, data: bytes | memoryview, block_bytes: int) -> str | None:
    """Why a put of ``data`` under ``key`` must be refused, or None if it is acceptable."""
    if not key or len(key) > MAX_KEY_BYTES:
        return f"key of {len(key)} bytes (allowed 1..{MAX_KEY_BYTES})"
    n = memoryview(data).nbytes
    if n != block_bytes:
        return f"block of {n} bytes, expected {block_bytes}"
    return None


def count_failure(tier: BlockTier, metric: str, key: bytes, reason: str, log: logging.Logger) -> None:
    """Count one ``store_failures``/``load_failures`` and say why in one log line."""
    tier.counters.add(metric, tier.name)
    log.warning("kvtier %s tier: %s for key %s: %s", tier.name, metric.rstrip("s"), key.hex()[:16], reason)
