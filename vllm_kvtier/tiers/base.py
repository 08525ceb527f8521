"""THE store contract: what every chunk medium (memory, NVMe, S3, Mooncake) offers the
worker's data path, and what it promises.

A *chunk* is a few consecutive KV blocks in the format of :mod:`~vllm_kvtier.chunkformat`.
That is a header with every block's key and CRC32, then the blocks at a fixed stride. It is
stored under a *chunk id* (``[A-Za-z0-9_.-]{1,128}``, see :func:`~vllm_kvtier.chunkformat.chunk_id_for`).
Every store holds a :class:`~vllm_kvtier.tiers.kernel.StoreKernel` over a medium's byte
primitives, so the guarantees below are written once. ``tests/tiers/contract.py`` checks
them for every medium. :class:`~vllm_kvtier.tiers.memory.MemoryStore` is both the
reference implementation and the fake for higher layers.

Who calls it: the worker half's chunk driver
(:class:`~vllm_kvtier.transfer.tier_io.ChunkWorker`), from the worker's main thread. Tools
and tests call it from theirs. There is ONE caller thread per store. The store's own I/O
threads do the transfers. Results come back only through :meth:`ChunkStore.poll`, on the
caller's thread.

Never blocking: ``submit_write``, ``submit_read``, ``submit_delete`` and ``poll`` return at
once, whatever the medium does (a dead endpoint, a stalled disk). Only ``wait`` (bounded by
its argument), ``close`` (shutdown) and the optional start-up abilities block.

Failure (style rule 9): no method raises for a failed transfer. It is an :class:`IOResult`
with ``ok`` False and a :class:`~vllm_kvtier.errors.FailureReason`. The reason's
``damaged`` property tells the caller what to do. Damaged: drop the chunk (the bytes are
wrong or gone). Not damaged: keep it (the way to it failed). Programming errors (a
malformed chunk id) may raise.

Every store opens the same way, through its medium's spec in the tier registry
(:mod:`~vllm_kvtier.tiers.registry`): ``open_store(section, ctx)``.

Optional abilities are separate small protocols, checked with ``isinstance``:
:class:`Scannable` (list and verify what the medium holds, at start-up),
:class:`Probeable` (does a chunk exist, without reading it), :class:`ReportsRemoteStats`
(request, retry and breaker figures of a remote medium).
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from vllm_kvtier.chunkformat import ChunkHeader
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.buffers import Releasable, WriteBuffer
from vllm_kvtier.tiers.resilience import RemoteStats

__all__ = [
    "ChunkStore",
    "IOKind",
    "IOResult",
    "Probeable",
    "ReportsRemoteStats",
    "ScanResult",
    "Scannable",
    "drain",
]

IOKind = Literal["read", "write", "delete"]


@dataclass
class IOResult:
    """The outcome of one submitted job, handed out once by :meth:`ChunkStore.poll`.

    ``ok`` is True exactly when ``reason`` is None. A read's ``blocks`` are views into
    ``buffer``: copy them out, then :meth:`release` (which hands the memory back for
    reuse); keep no view after releasing."""

    job_id: int
    kind: IOKind
    chunk_id: str
    ok: bool
    reason: FailureReason | None = None
    #: bytes moved (a write: the chunk's total size; a read: the bytes fetched)
    nbytes: int = 0
    #: from submit to completion
    seconds: float = 0.0
    #: writes: the header stamped; reads: the verified header (for a read submitted with
    #: none, the caller keeps it for the next read of this chunk)
    header: ChunkHeader | None = None
    #: reads: the verified bytes of each requested position (same order), else None.
    blocks: list[memoryview] | None = None
    #: reads: the memory behind ``blocks``
    buffer: Releasable | None = None

    def __post_init__(self) -> None:
        # Media that label failures with plain strings (their classifiers' values) are
        # typed here; an unknown label is a programming error and raises.
        if self.reason == "":
            self.reason = None
        elif self.reason is not None and not isinstance(self.reason, FailureReason):
            self.reason = FailureReason(self.reason)
        if not self.ok and self.reason is None:
            self.reason = FailureReason.ERROR

    def release(self) -> None:
        if self.blocks is not None:
            for b in self.blocks:
                b.release()
            self.blocks = None
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


def drain(q: queue.SimpleQueue[IOResult]) -> list[IOResult]:
    """Everything queued right now, without waiting (completion queues of the stores)."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


@runtime_checkable
class ChunkStore(Protocol):
    """The submit/poll data path of one chunk medium for one (namespace, rank).

    Every method is called from the one caller thread (see the module doc). Exactly one
    result comes back by :meth:`poll` for every submitted read and every accepted write;
    deletes report too (``job_id`` -1) and may be ignored.
    """

    @property
    def block_bytes(self) -> int:
        """Bytes of every block this store writes and accepts on read."""
        ...

    @property
    def authenticated(self) -> bool:
        """Whether it signs and verifies chunks (a key). The caller builds its write buffers
        with the same ``authenticated`` (the signed header needs more room)."""
        ...

    def submit_write(self, job_id: int, chunk_id: str, wb: WriteBuffer) -> bool:
        """Queue a write of the chunk assembled in ``wb``. Never blocks.

        Every ``wb.block(i)`` is filled, or a ``wb.fill`` fills them. The store calls the
        fill on its I/O thread first. A False from it ends the write ``superseded`` with
        nothing written. The store stamps the header: keys, CRC32s, namespace.

        Returns False when refused: the bounded write queue is full (back-pressure), or the
        store is closed. Then nothing was queued and no result will come. The CALLER still
        owns ``wb`` (close it or retry). Returns True when queued. The STORE then owns
        ``wb`` and closes it when the write ends. One result comes by ``poll`` (``header``
        set when ok). A write is atomic: a reader of ``chunk_id`` sees the old chunk, the
        new one, or none, never a mix. Writing an id that exists succeeds. The chunk is
        replaced, or kept where the medium refuses overwrites (e.g. Mooncake: ids name
        their content). Failure reasons: ``queue``/``closed`` never (that is False);
        ``disk_full``, ``permission``, ``read_only``, ``io_error``, ``os_error``,
        ``timeout``, ``throttled``, ``unavailable``, ``breaker_open``, ``no_buffer``,
        ``pool_full``, ``error``...
        """
        ...

    def submit_read(
        self, job_id: int, chunk_id: str, header: ChunkHeader | None, positions: Sequence[int],
        keys: Sequence[bytes],
    ) -> None:
        """Queue a read of the blocks at ``positions``, which must hold ``keys``.

        ``positions`` may be in any order; the result's ``blocks`` follow it. ``keys`` are
        the keys the scheduler expects there, in the same order. Never blocks; exactly one
        result comes by ``poll``.

        ``header``: the chunk's header as the caller knows it (from a write, a scan or an
        earlier read). None for a chunk this process has not seen (another instance wrote
        it). Then the store reads and verifies the header first, within the same deadline.
        It returns it in the result's ``header``.

        What a successful read guarantees (the ONE verified read path of the kernel):

        * Every size taken from stored bytes was bounded BEFORE any memory was sized from
          it. The bound is what this engine could have written (``too_large``).
        * The key at each position equals the key asked for (``key_mismatch``).
        * Every block's CRC32 matched before the result was made (``checksum``).
        * A stored header read along is the caller's header (``checksum``).
        * The object is complete (``truncated``).
        * A store with a key (``authenticated``) also verified the header's MAC. The
          caller's header is re-verified too, wherever it came from. It also verified the
          tag of every returned block (``auth_failed``).
        * A store with a key serves only chunks signed with a key it accepts
          (``unauthenticated`` otherwise). A store without a key serves only unsigned
          chunks.
        * Every store serves only chunks whose header names its own rank. Another rank's
          shard, copied or moved to this rank's place, is ``key_mismatch``.

        Deadline: the result arrives within the store's ``read_deadline_s`` of this call.
        If the medium has not answered by then, ``poll`` reports the read failed with
        ``deadline`` (transient). The late answer is dropped and its buffer freed.

        Failure reasons, damaged (the caller drops the chunk): ``checksum``,
        ``truncated``, ``missing``, ``namespace``, ``format``, ``key_mismatch``,
        ``too_large``, ``not_regular``, ``bad_request`` (positions out of range),
        ``io_error``, ``auth_failed``. Kept, but the caller forgets it (so it is written
        again): ``unauthenticated``. Transient (kept): ``deadline``, ``timeout``,
        ``throttled``, ``unavailable``, ``breaker_open``, ``no_buffer``, ``closed`` (a read
        submitted after close), ``permission``, ``error``.
        """
        ...

    def submit_delete(self, chunk_id: str) -> None:
        """Queue the removal of ``chunk_id`` (absent is fine). Never blocks. Space is
        reclaimed by the medium, possibly after the result. Ignored once closed."""
        ...

    def poll(self) -> list[IOResult]:
        """Every result completed since the last call, and every read past its deadline
        (failed, ``deadline``). Never blocks. The caller owns the results (release them)."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until some job completed since the last call (True)
        or not. For idle engine steps only: it hands the GIL to the I/O threads."""
        ...

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued I/O (up to ``timeout_s``), then stop the threads and free the
        medium's resources. Idempotent. Afterwards writes are refused, reads fail with
        ``closed`` and deletes are ignored; what a durable medium wrote stays."""
        ...


@dataclass(frozen=True)
class ScanResult:
    """What a medium holds for this (namespace, rank), each chunk's header verified."""

    #: chunk id -> header, oldest first where the medium can tell
    found: dict[str, ChunkHeader] = field(default_factory=dict)
    #: what was left out, by reason (``partial_write`` for leftovers of a crashed write)
    problems: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class Scannable(Protocol):
    """A medium that can list what it holds (NVMe's directory, S3's prefix). Blocks:
    called at start-up, by the worker that owns the medium (``cleanup`` True: leftovers
    and chunks that fail to verify are deleted) or read-only by the scheduler."""

    def scan(self, *, cleanup: bool = False) -> ScanResult: ...


@runtime_checkable
class Forgets(Protocol):
    """A store that keeps its own record of what it wrote (S3's writer manifest) and
    drops chunks from it that the tier no longer lists (deleted or expired out of band).
    Called by the worker's thread with chunk ids of any writer; sends nothing."""

    def forget(self, chunk_ids: list[str]) -> None: ...


@runtime_checkable
class Probeable(Protocol):
    """A medium that can say whether chunks exist without reading them (Mooncake's
    master). Blocks for one request; an error reads as False (a miss)."""

    def exists(self, chunk_ids: list[str]) -> list[bool]: ...


@runtime_checkable
class ReportsRemoteStats(Protocol):
    """A remote medium's request, retry and breaker figures (for metrics). Any thread."""

    def stats(self) -> RemoteStats: ...
