"""Worker side of a chunk tier (NVMe files, S3 objects).

It moves blocks between CPU pool slots and chunks.

Who calls it: :class:`~vllm_kvtier.transfer.worker.WorkerHalf`, from the worker's main
thread. I/O runs on the store's threads (:class:`ChunkStore`). This class copies read
buffers back into slots, and reports outcomes to the scheduler (``WorkerReport``). Nothing
here raises into vLLM: failures are results.

Writes copy their slots into a write buffer in one of two places. A *demotion* is copied
here, at once, before this step's saves. In a demotion the CPU tier evicted the block,
and this step's saves reuse its slot. Every other write is copied on the store's I/O
thread (``WriteBuffer.fill``). Those are write-through and the background flush of
write-back blocks, which slots keep holding. The fill is a plain memmove. So it is not
used with an FP8 codec, whose torch ops stay on this thread. The engine thread's time
delays every token of the step, so it does not copy. Copying there took 10 of the 12 ms
the plugin took of the engine thread per low-load request. That was ``bench/serving.py``'s
``cpu-nvme``, with 28 blocks flushed. Such a copy checks the slots' generations
(:class:`SlotTable`) before and after. A slot claimed or re-keyed meanwhile ends the
write ``superseded``, nothing written.

It is handed the worker's :class:`~vllm_kvtier.transfer.slots.SlotTable` once, at
construction. The table says what each slot holds and which device copy still uses it.
It reads that table: a job whose slots no longer hold their keys is not written. It
writes the table only to claim the slots a read lands in. :meth:`ChunkWorker.poll`
returns the reads that finished, and the worker records their keys.

A tier may store blocks encoded (``storage_dtype: fp8``). The codec turns slot rows into
the stored block and back, on this thread (:class:`~.slot_buffers.SlotBuffers`). It takes
~1 ms per 2 MiB bf16 block each way (see :mod:`vllm_kvtier.transfer.fp8`).

The store is any :class:`~vllm_kvtier.tiers.base.ChunkStore` (the one store contract).
Each read passes the keys the scheduler expects at its positions. The store fails a
chunk holding others (``key_mismatch``).

A failed read is a miss either way. It marks the chunk *bad* only when its
:class:`~vllm_kvtier.errors.FailureReason` is ``damaged``. Then the bytes are wrong or
gone (checksum, truncated, missing, key mismatch...), and the scheduler forgets and
deletes it. It marks the chunk *untrusted* when the reason is ``unauthenticated``
(unsigned, or signed with a key this instance no longer accepts). The scheduler then
forgets it, so that it can be written again, and does not delete it. A read that failed
for the path to it (deadline, throttling, breaker open, timeout) leaves the chunk alone.
On a shared bucket it is good data other instances use.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from vllm_kvtier.chunkformat import ChunkHeader, chunk_id_for
from vllm_kvtier.config.stores import HEADER_CACHE_BYTES, HEADER_CACHE_ENTRIES
from vllm_kvtier.errors import AUTH_REASONS, FailureReason
from vllm_kvtier.jobs import ChunkRead, ChunkWriteJob
from vllm_kvtier.jobs import WorkerReport as KVTierWorkerMeta
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters, GaugeName
from vllm_kvtier.tiers.base import ChunkStore, Forgets, IOResult, ReportsRemoteStats
from vllm_kvtier.tiers.buffers import BufferPool, out_of_memory
from vllm_kvtier.tiers.resilience import RemoteStats
from vllm_kvtier.transfer.fp8 import BlockCodec
from vllm_kvtier.transfer.header_cache import HeaderCache
from vllm_kvtier.transfer.slot_buffers import SlotBuffers
from vllm_kvtier.transfer.slots import SlotTable

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_HEADERS", "DEFAULT_MAX_HEADER_BYTES", "ChunkStore", "ChunkWorker", "DriverContext",
           "DriverSection", "DriverSettings"]

#: Headers a worker keeps for a store that can fetch them (S3, Mooncake): about 2 KB each
#: for 16-block chunks; the S3 tier passes ``s3.header_cache_entries``.
DEFAULT_MAX_HEADERS = HEADER_CACHE_ENTRIES
#: ... and the memory they hold at most (:func:`~vllm_kvtier.chunkformat.header_memory_bytes`;
#: 256-block headers are ~29 KB each); the S3 tier passes ``s3.header_cache_bytes``.
DEFAULT_MAX_HEADER_BYTES = HEADER_CACHE_BYTES


class DriverSection(Protocol):
    """What a chunk driver reads of its tier's settings: every lower tier's config
    section has these (:class:`~vllm_kvtier.config.lower.LowerTierSection`)."""

    @property
    def mode(self) -> Literal["write-back", "write-through"]: ...

    @property
    def chunk_blocks(self) -> int: ...

    @property
    def flush_on_shutdown_s(self) -> float: ...

    @property
    def header_cache_entries(self) -> int: ...

    @property
    def header_cache_bytes(self) -> int: ...


@dataclass(frozen=True)
class DriverSettings:
    """A :class:`DriverSection` given directly (tools and tests)."""

    mode: Literal["write-back", "write-through"]
    chunk_blocks: int
    flush_on_shutdown_s: float
    header_cache_entries: int = DEFAULT_MAX_HEADERS
    header_cache_bytes: int = DEFAULT_MAX_HEADER_BYTES


@dataclass(frozen=True)
class DriverContext:
    """What one chunk driver works with, beside its store and settings."""

    #: The worker's slot table (the CPU pool and what each slot holds).
    slots: SlotTable
    counters: Counters
    #: How a slot becomes a stored block (None: stored as it is).
    codec: BlockCodec | None = None
    #: Where write buffers come from (the worker's pool; None: the process default).
    buffers: BufferPool | None = None
    #: The store can read a chunk whose header this driver does not hold (a shared medium).
    fetches_headers: bool = False
    #: False: a replica reader (see :class:`ChunkWorker`).
    writes: bool = True


class _PendingIO:
    """The I/O a chunk driver queued and has no result for yet, by job id."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        #: read id -> (the read, whether it is a prefetch's)
        self.reads: dict[int, tuple[ChunkRead, bool]] = {}
        #: write id -> its blocks, while queued (one result comes for each)
        self.writes: dict[int, int] = {}

    def next_id(self) -> int:
        return next(self._ids)

    def add_read(self, read: ChunkRead, prefetch: bool) -> int:
        rid = self.next_id()
        self.reads[rid] = (read, prefetch)
        return rid


class _RemoteFigures:
    """A remote store's requests, retries and breaker, as counters and a gauge.

    The store keeps running totals; each report adds what changed since the last."""

    def __init__(self, stats: Callable[[], RemoteStats]) -> None:
        self._stats = stats
        self._reported = (0, 0, 0)  # requests, retries, breaker opens already counted

    def report(self, counters: Counters, tier: TierName) -> None:
        st = self._stats()
        now = (sum(st.requests.values()), st.retries, st.breaker.opens)
        names = (CounterName.REQUESTS, CounterName.RETRIES, CounterName.BREAKER_OPENS)
        for name, new, old in zip(names, now, self._reported, strict=True):
            counters.add(name, tier, new - old)
        self._reported = now
        counters.set_gauge(GaugeName.BREAKER_STATE, tier, int(st.breaker.state))


class ChunkWorker:
    def __init__(self, tier: TierName, store: ChunkStore | None, settings: DriverSection, ctx: DriverContext,
                 headers: dict[str, ChunkHeader] | None = None) -> None:
        """``store`` None: the tier could not start here; every write and read is a miss.
        ``settings``: the tier's config section (or :class:`DriverSettings`). ``ctx``: the
        slot table, counters, codec and buffers (:class:`DriverContext`). ``headers``:
        chunks this rank already holds.

        ``ctx.fetches_headers``: the store can read a chunk whose header we do not have
        (S3: another instance wrote it). The headers kept are then an LRU cache. It holds
        at most ``settings.header_cache_entries`` headers and
        ``settings.header_cache_bytes`` bytes. A header it no longer has costs one more
        ranged GET at that chunk's next read. Otherwise every chunk's header is kept (the
        store cannot read without it).

        ``ctx.writes`` False: a *replica reader*. Another rank stores the bytes this rank
        would store. An MLA model's latent cache is the same on every TP rank. Its TP
        group's first rank writes the one copy (see
        :class:`~vllm_kvtier.engine.lower.RankRole`). ``store`` reads that rank's chunks.
        Writes, shutdown flushes, deletes and manifest changes are then the writer's. Here
        they only drop cached headers, and report nothing. The scheduler counts the
        writer's acknowledgement alone. Reads fetch the header of a chunk they have not
        seen. ``fetches_headers`` is forced on: this rank never wrote it."""
        self.tier = tier
        self.store = store
        self.counters = ctx.counters
        self.slots = ctx.slots
        #: mode, chunk size, shutdown flush bound, header cache bounds
        self.settings = settings
        self.writes = ctx.writes
        self._headers = HeaderCache(headers, bounded=ctx.fetches_headers or not ctx.writes,
                                    max_entries=settings.header_cache_entries,
                                    max_bytes=settings.header_cache_bytes)
        self._bytes = SlotBuffers(ctx.slots, ctx.codec, ctx.buffers,
                                  authenticated=store is not None and store.authenticated)
        self._jobs = _PendingIO()
        #: read id -> its time from issue to done, for reads :meth:`poll` returned
        self._read_seconds: dict[int, float] = {}
        self._meta = KVTierWorkerMeta()
        #: slots whose block is only in DRAM and goes to this tier at shutdown (write-back),
        #: as the scheduler says (:meth:`mark_dirty`, :meth:`clean`)
        self._dirty: set[int] = set()
        #: a remote store's request, retry and breaker figures, reported as metrics
        self._remote = _RemoteFigures(store.stats) if isinstance(store, ReportsRemoteStats) else None

    @property
    def headers(self) -> Mapping[str, ChunkHeader]:
        """The chunk headers held, oldest first (see ``ctx.fetches_headers``)."""
        return self._headers.entries

    @property
    def codec(self) -> BlockCodec | None:
        """How this tier encodes its blocks (FP8), None when it stores them as they are.
        Shadow verification decodes what it reads with it."""
        return self._bytes.codec

    # ---- writes -------------------------------------------------------------------

    def mark_dirty(self, slots: Iterable[int]) -> None:
        """These slots' blocks are only in DRAM: flush them at shutdown (write-back)."""
        if self.writes:
            self._dirty.update(slots)

    def clean(self, slots: Iterable[int]) -> None:
        """These slots no longer hold what was marked (saved over, or written)."""
        self._dirty.difference_update(slots)

    def write(self, jobs: list[ChunkWriteJob], *, copy_now: bool = False) -> None:
        """Queue each job's chunk write; its slots are copied out on the store's I/O thread,
        or here, now, with ``copy_now`` (a demotion: the slots are about to be reused). A
        job whose slots do not all hold their keys (a save into them failed) is not
        written. A replica reader (``writes`` False) writes nothing: the writer rank writes
        these chunks."""
        if not self.writes:
            return
        for job in jobs:
            ref = (self.tier, job.chunk_id)
            if not all(self.slots.holds(s, k) for s, k in zip(job.slots, job.keys, strict=True)):
                self._meta.failed.add(ref)
                continue
            for s in job.slots:
                self.slots.wait(s)  # a save into this slot may still be in flight (CUDA)
            if self.store is None:
                self._meta.failed.add(ref)
                continue
            try:
                wb = self._bytes.write_buffer(job.keys, job.slots, copy_now=copy_now)
            except (MemoryError, OSError) as e:  # no memory for the buffer: not written now
                if not out_of_memory(e):
                    raise
                logger.warning("kvtier %s: no memory for a write buffer of %s: %s", self.tier, job.chunk_id, e)
                self.counters.add(CounterName.NO_BUFFER, self.tier)
                self.counters.add(CounterName.STORE_SKIPPED, self.tier, len(job.keys))
                self._meta.refused.add(ref)  # like a full queue: back-pressure, not a failing tier
                continue
            wid = self._jobs.next_id()
            if not self.store.submit_write(wid, job.chunk_id, wb):
                wb.buf.close()
                self.counters.add(CounterName.STORE_SKIPPED, self.tier, len(job.keys))
                self._meta.refused.add(ref)  # queue full: back-pressure, not a failing tier
                continue  # still dirty: the shutdown flush may write them yet
            self._jobs.writes[wid] = len(job.keys)
            self.clean(job.slots)

    def delete(self, chunk_ids: list[str]) -> None:
        for fid in chunk_ids:
            self._headers.drop(fid)
            if self.store is not None and self.writes:  # the writer's file: it deletes it
                self.store.submit_delete(fid)

    def forget(self, chunk_ids: list[str]) -> None:
        """Chunks a rescan no longer lists: their cached headers go, and a store that keeps
        a writer's manifest (S3) prunes them from it. No request is sent."""
        for fid in chunk_ids:
            self._headers.drop(fid)
        if chunk_ids and self.writes and isinstance(self.store, Forgets):
            self.store.forget(chunk_ids)

    # ---- reads --------------------------------------------------------------------

    def start_read(self, read: ChunkRead, *, prefetch: bool = False) -> int | None:
        """Queue a read; its id, or None if it cannot be read here (a miss)."""
        header = self._headers.get(read.chunk_id)
        if self.store is None or (header is None and not self._headers.bounded):
            self._meta.bad.add((self.tier, read.chunk_id))
            return None
        # a prefetch is counted by the scheduler as prefetch_blocks, not as a request's load
        rid = self._jobs.add_read(read, prefetch)
        # header None only for a store that fetches it (see fetches_headers).
        self.store.submit_read(rid, read.chunk_id, header, list(read.positions), list(read.keys))
        return rid

    def took(self, rid: int) -> float:
        """How long read ``rid``, returned by the last :meth:`poll`, took from issue to done
        (0.0 once asked, or when unknown)."""
        return self._read_seconds.pop(rid, 0.0)

    def poll(self) -> list[tuple[int, ChunkRead, bool]]:
        """Handle finished I/O: fill slots from completed reads. Returns (read id, read,
        ok) for every read that finished; the caller records the slots' new keys."""
        finished: list[tuple[int, ChunkRead, bool]] = []
        self._read_seconds.clear()  # :meth:`took` answers for this poll's reads only
        for res in self.store.poll() if self.store is not None else ():
            if res.kind == "write":
                self._on_write(res)
            elif res.kind == "read":
                entry = self._jobs.reads.pop(res.job_id, None)
                if entry is None:
                    res.release()
                    continue
                read, was_prefetch = entry
                ok, reason = res.ok, res.reason
                if ok:
                    assert res.blocks is not None
                    # before their bytes change: unstamped for peers, and a copy out of them
                    # on a store's thread sees it must be dropped
                    self.slots.claim(read.slots)
                    try:
                        for slot, data in zip(read.slots, res.blocks, strict=True):
                            self.slots.wait(slot)  # a device copy may still use the slot (CUDA)
                            self._bytes.fill_slot(slot, data)
                    except ValueError as e:  # a block of the wrong size: never served
                        logger.warning("kvtier %s: %s: %s", self.tier, read.chunk_id, e)
                        ok, reason = False, FailureReason.FORMAT
                if ok:
                    if res.header is not None:
                        self._headers.keep(read.chunk_id, res.header)
                    if not was_prefetch:
                        self.counters.add(CounterName.READS, self.tier)
                        self.counters.add(CounterName.BLOCKS_LOADED, self.tier, len(read.slots))
                        self.counters.add(CounterName.BYTES_LOADED, self.tier, res.nbytes)
                        self.counters.add(CounterName.LOAD_SECONDS, self.tier, res.seconds)
                else:
                    logger.warning("kvtier %s: read of %s failed (%s); recomputing %d blocks",
                                   self.tier, read.chunk_id, reason, len(read.slots))
                    self.counters.add(CounterName.LOAD_FAILURES, self.tier, len(read.slots))
                    if reason is FailureReason.NO_BUFFER:
                        self.counters.add(CounterName.NO_BUFFER, self.tier)
                    if reason in AUTH_REASONS:
                        self.counters.add(CounterName.AUTH_FAILURES, self.tier)
                    if reason is not None and reason.damaged:
                        self._meta.bad.add((self.tier, read.chunk_id))
                        self._headers.drop(read.chunk_id)
                    elif reason is FailureReason.UNAUTHENTICATED:  # forgotten, not deleted
                        self._meta.untrusted.add((self.tier, read.chunk_id))
                        self._headers.drop(read.chunk_id)
                res.release()
                self._read_seconds[res.job_id] = res.seconds
                finished.append((res.job_id, read, ok))
        if self._remote is not None:
            self._remote.report(self.counters, self.tier)
        return finished

    def _on_write(self, res: IOResult) -> None:
        ref = (self.tier, res.chunk_id)
        nblocks = self._jobs.writes.pop(res.job_id, 0)
        if res.ok:
            assert res.header is not None
            self._headers.keep(res.chunk_id, res.header)
            self._meta.written[ref] = self._meta.written.get(ref, 0) + 1
            self.counters.add(CounterName.BLOCKS_STORED, self.tier, res.header.nblocks)
            self.counters.add(CounterName.BYTES_STORED, self.tier, res.nbytes)
            self.counters.add(CounterName.STORE_SECONDS, self.tier, res.seconds)
        elif res.reason == FailureReason.SUPERSEDED:  # its slots were reused before the copy: not the tier's fault
            self.counters.add(CounterName.STORE_SKIPPED, self.tier, nblocks)
            self._meta.refused.add(ref)
        else:
            self.counters.add(CounterName.STORE_FAILURES, self.tier)
            self._meta.failed.add(ref)

    def take_meta(self, into: KVTierWorkerMeta) -> None:
        """Move what happened since the last call into ``into``."""
        m, self._meta = self._meta, KVTierWorkerMeta()
        for ref, n in m.written.items():
            into.written[ref] = into.written.get(ref, 0) + n
        into.failed |= m.failed
        into.bad |= m.bad
        into.refused |= m.refused
        into.untrusted |= m.untrusted

    def wait_for_reads(self, timeout_s: float) -> None:
        """Idle steps only: give the I/O threads the GIL until a read may have finished."""
        if self._jobs.reads and self.store is not None:
            self.store.wait(timeout_s)

    def pending_reads(self) -> int:
        return len(self._jobs.reads)

    # ---- shutdown -----------------------------------------------------------------

    def close(self) -> None:
        """Flush write-back blocks still only in DRAM (bounded by ``flush_on_shutdown_s``),
        then finish queued I/O and stop."""
        if self.store is None:
            return
        chunk_blocks = self.settings.chunk_blocks
        deadline = time.monotonic() + self.settings.flush_on_shutdown_s
        if self.settings.mode == "write-back" and self._dirty:
            items = [(s, k) for s in sorted(self._dirty) if (k := self.slots.key(s)) is not None]
            written = 0
            for i in range(0, len(items), chunk_blocks):
                if time.monotonic() > deadline:
                    break
                part = items[i : i + chunk_blocks]
                keys = tuple(k for _, k in part)
                try:
                    wb = self._bytes.copied(keys, tuple(s for s, _ in part))
                except (MemoryError, OSError) as e:
                    if not out_of_memory(e):
                        raise
                    self.counters.add(CounterName.NO_BUFFER, self.tier)
                    break  # no memory: the rest stays unwritten, as past the deadline
                while not self.store.submit_write(self._jobs.next_id(), chunk_id_for(keys), wb):
                    if time.monotonic() > deadline:
                        wb.buf.close()
                        break
                    time.sleep(0.01)
                else:
                    written += len(keys)
            logger.info("kvtier %s: flushed %d write-back blocks at shutdown", self.tier, written)
        self.store.close(timeout_s=max(0.0, deadline - time.monotonic()) + 5.0)
