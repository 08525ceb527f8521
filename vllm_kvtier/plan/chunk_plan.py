"""Scheduler-side policy of a chunk tier below the CPU tier (NVMe, S3, Mooncake).

It covers admission, demotion, chunking, eviction, and what other instances stored.

Who calls it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`, from vLLM's
scheduler thread. No I/O and no thread here. The connector lists the tier at start-up and
hands the listing in (``found``). Later changes come from a catalog
(:mod:`vllm_kvtier.catalog`), which lists or asks on its own thread. A shared bucket's
rescans arrive as deltas (:class:`~vllm_kvtier.catalog.base.Rescans`). They are applied in
slices (:class:`~vllm_kvtier.plan.rescan_merge.RescanMerge`). The listing is authoritative.
A chunk it no longer shows leaves the index (deleted out of band, expired by a lifecycle
rule). A chunk a load is reading leaves at its unpin. A chunk shown on only some ranks is
never indexed. A pool's lookups are submitted and answered on a later step
(:class:`~vllm_kvtier.catalog.base.PoolLookups`, :meth:`ChunkPlanner.discover`).

* **Admission**: a block is written only once it appeared in at least ``admit_min_seen``
  requests' prompts (:class:`~vllm_kvtier.plan.admission.Admission`, a bounded table),
  1 by default. A first reuse comes after a small DRAM pool has cycled: a tier waiting for
  a second sight never serves it. 2 trades those hits for SSD writes (docs/planning.md).
* **Write-back**: a block goes down when the CPU tier evicts it (if admitted). The worker
  copies the slot out before the same step's saves reuse it. Write-back also **flushes in
  the background** the blocks still only in DRAM, whatever their admission count. So a
  restart (or an abort, or a crash) finds what DRAM held. While requests run, a block is
  flushed once it has stayed in DRAM ``flush_interval_s``. So an abort loses at most that
  window. A one-off block evicted sooner is not written: admission still protects the SSD
  from floods. When the engine has no request, all of them are flushed at once, a bounded
  number a step (:class:`~vllm_kvtier.plan.chunk_writes.WriteQueue`). The engine then asks
  vLLM for idle steps until they are written. Cost: a block is written once if it outlives
  the interval in DRAM or is in DRAM when the engine goes idle.
  **Write-through**: every admitted block saved to the CPU tier is also written at once.
  With both NVMe and S3 configured, each tier takes the CPU tier's blocks by its own mode.
  The hierarchy is inclusive: a block evicted from NVMe is usually still in S3. Nothing is
  copied NVMe -> S3.
* **Chunking**: one step's writes are grouped, in order, into chunks of up to
  ``chunk_blocks`` blocks, so I/Os are large and requests few.
* **Capacity**: a write reserves its bytes when planned. To make room the index evicts
  chunks by the policy's ``eviction`` (NVMe: ``nvme.eviction``, kvaware by default;
  others: LRU); the worker deletes them. A key becomes loadable
  only once every TP rank reported its chunk durable.
* **KV events** (:meth:`ChunkPlanner.attach_events`, only when vLLM's events are on): the
  index reports every key that becomes loadable or stops being so. A chunk is ``REMOTE``
  when another writer stored it, else ``LOCAL``. Another writer's chunk is found by a rescan
  or a pool lookup, or at start-up in a shared tier and not in our own manifest.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from vllm_kvtier.catalog.base import Found, Listing, common_chunks
from vllm_kvtier.chunkformat import align_up, chunk_id_for, header_bytes_for
from vllm_kvtier.index.chunk_index import ChunkIndex
from vllm_kvtier.jobs import ChunkWriteJob, WorkerReport
from vllm_kvtier.keys import BlockKey, TierName
from vllm_kvtier.metrics import CounterName, GaugeName
from vllm_kvtier.plan.admission import Admission
from vllm_kvtier.plan.chunk_acks import ChunkAcks, remember
from vllm_kvtier.plan.chunk_feed import CatalogFeed
from vllm_kvtier.plan.chunk_origins import ChunkOrigins
from vllm_kvtier.plan.chunk_policy import ChunkPolicy, PlannerContext
from vllm_kvtier.plan.chunk_writes import SlotKey, WriteQueue
from vllm_kvtier.plan.events import EventLog, Locality
from vllm_kvtier.plan.lookup_state import CoolDown
from vllm_kvtier.plan.rescan_merge import Added

__all__ = ["ChunkPlanner", "ChunkPolicy", "PlannerContext"]

logger = logging.getLogger(__name__)

#: Seconds after the last chunk write was planned during which an idle engine keeps
#: stepping until its writes are durable (:meth:`ChunkPlanner.awaits_writes`). A write
#: that takes longer (a stuck store) no longer keeps the engine busy; its report still
#: lands with the next request's steps.
WRITE_SETTLE_S = 30.0

#: Shared-tier chunks shadow verification found wrong, remembered so that no rescan or pool
#: lookup indexes them again (ids, ~100 B each; the oldest is forgotten beyond this).
_DISTRUSTED_CHUNKS = 4096


class ChunkPlanner:
    """One chunk tier's policy, over its parts. The :attr:`admission` picks which blocks
    are written and holds the write breaker. The :attr:`writes` queue what the next step
    writes and deletes. The :attr:`acks` count the ranks' write reports. The :attr:`feed`
    takes the catalog's rescans and pool answers. The :attr:`cooling` holds chunks whose
    read failed. The :attr:`origins` knows who wrote each chunk (KV events' locality, what
    a failed read deletes). The index stays here."""

    def __init__(self, policy: ChunkPolicy, ctx: PlannerContext, listing: Listing) -> None:
        """``listing``: what the tier's catalog found at start-up
        (:class:`~vllm_kvtier.catalog.base.Listing`). ``listing.found``: the chunks found.
        ``listing.catalog``: where later changes come from (:mod:`vllm_kvtier.catalog`).
        It is a listed tier's rescans (changes pushed) or a pool's lookups (answered
        asynchronously). None: nothing changes but by this planner's own writes. It is
        closed by :meth:`close`. ``listing.reserved_bytes_per_rank``: bytes the tier holds
        that are not chunks. Examples: an NVMe rank directory's lock file, anything else
        found in it. They are taken off the capacity, so that it bounds every byte on the
        medium. ``listing.local_chunks``: the chunks of ``found`` this instance wrote (a
        shared tier's own manifest). None means all of them on an exclusive tier and none on
        a shared one (KV events' locality). ``listing.unread``: chunks some rank's listing
        saw but could not read (a transient error). They are not indexed, and never
        reclaimed as partial. ``listing.writable`` False: the policy's mode becomes
        read-only. ``listing.reclaim``: chunks deleted at once."""
        if not listing.writable:
            policy = dataclasses.replace(policy, mode="read-only")
        self.policy = policy
        self.ctx = ctx
        # Capacity is per engine; each rank stores its shard of every chunk.
        cap = policy.capacity_bytes
        self.reserved_bytes = reserved = listing.reserved_bytes_per_rank
        self.index = ChunkIndex(None if cap is None else max(0, cap // ctx.world_size - reserved),
                                eviction=policy.eviction,
                                file_bytes=self.file_bytes(policy.chunk_blocks))
        self.admission = Admission(policy.tier, policy.admit_min_seen)
        self.writes = WriteQueue(flush_interval_s=policy.flush_interval_s, chunk_blocks=policy.chunk_blocks,
                                 clock=ctx.clock)
        self.acks = ChunkAcks(ctx.world_size)
        self.cooling = CoolDown()
        self.feed = CatalogFeed(listing.catalog)
        self.origins = ChunkOrigins()
        #: shared-tier chunks verification found wrong: never indexed again (:meth:`distrust_key`)
        self._distrusted: OrderedDict[str, None] = OrderedDict()
        #: Called with a chunk's keys once every rank reported it durable (this thread).
        #: The scheduler points it at the CPU index, whose policy learns what is below.
        self.on_durable: Callable[[Sequence[BlockKey]], None] | None = None
        #: when the last chunk write was planned (:meth:`awaits_writes`)
        self._last_write_s = -math.inf
        n_blocks, n_files = self._adopt(listing.found, listing.local_chunks, listing.unread)
        if n_files:
            logger.info("kvtier %s: found %d blocks in %d chunks", self.tier, n_blocks, n_files)
        if listing.reclaim:
            logger.info("kvtier %s: deleting %d chunk(s) a previous run left on only some ranks", self.tier,
                        len(listing.reclaim))
            self.reclaim(list(listing.reclaim))

    @property
    def tier(self) -> TierName:
        return self.policy.tier

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's shard on one rank."""
        return self.ctx.block_bytes_per_rank

    # ---- what the tier holds -------------------------------------------------------

    def _adopt(self, found: Found, local_chunks: frozenset[str] | None, unread: frozenset[str]) -> tuple[int, int]:
        """Index the start-up listing's chunks present on every rank; (blocks, chunks) added.

        A chunk that does not fit the capacity is deleted. An exclusive tier
        (:attr:`ChunkPolicy.exclusive`) deletes two more kinds. One is chunks present on
        only some ranks (a write that did not reach every rank). The other is chunks of
        another block size. The ranks that hold them delete them. They count as
        ``reclaimed_files``. A chunk in ``unread`` is not known partial. A rank could not
        read it (EMFILE, EIO). It is left alone. A rescan's chunks are only ignored then
        (:meth:`_apply_slice`). Another instance may be using or still writing them."""
        reclaim = self.policy.exclusive
        common = common_chunks(found)
        n_blocks = n_files = 0
        if reclaim:
            partial = {f for rank in found for f in rank if f not in common and f not in self.index and f not in unread}
            if partial:
                logger.info("kvtier %s: deleting %d chunk(s) present on only some TP ranks", self.tier, len(partial))
                self.reclaim(sorted(partial))
        for fid, h in common.items():  # oldest first
            if fid in self.index:
                continue
            if h.block_bytes != self.block_bytes and reclaim:
                self.reclaim([fid])  # misfit: another block size (another layout)
                continue
            if h.block_bytes != self.block_bytes or self.acks.failed(fid):
                continue
            ours = self.policy.exclusive if local_chunks is None else fid in local_chunks
            if self._add_found(fid, [BlockKey(k) for k in h.keys], h.total_bytes, remote=not ours):
                n_blocks += h.nblocks
                n_files += 1
            else:
                self.writes.delete([fid])
        return n_blocks, n_files

    def _add_found(self, fid: str, keys: Sequence[BlockKey], nbytes: int, *, remote: bool) -> bool:
        """Index a chunk a scan or lookup found (``remote``: another writer's)."""
        if fid in self._distrusted:
            return False
        if remote:
            self.origins.mark_remote(fid)  # before: indexing it reports its keys
        if self.index.add_existing(fid, keys, nbytes):
            return True
        self.origins.forget(fid, written=False)
        return False

    # ---- KV events -------------------------------------------------------------------

    def attach_events(self, log: EventLog) -> None:
        """Report to ``log`` every key that becomes loadable from this tier.

        Also every key that stops being so, from now on. Over the next steps, announce what
        it holds already."""
        tier = self.tier
        self.index.watch = lambda fid, keys, loadable: log.record(tier, keys, loadable, self._locality(fid))
        log.announce(tier, self._holdings())

    def _locality(self, fid: str) -> Locality:
        return "REMOTE" if self.origins.is_remote(fid) else "LOCAL"

    def _holdings(self) -> Iterator[tuple[Sequence[BlockKey], Locality]]:
        """The chunks indexed now, each as it is when the iterator reaches it.

        It iterates a snapshot of their ids (~100 B each). What is indexed later is
        reported by the watch."""
        fids = self.index.chunk_ids()

        def walk() -> Iterator[tuple[Sequence[BlockKey], Locality]]:
            for fid in fids:
                keys = self.index.loadable_keys(fid)
                if keys:
                    yield keys, self._locality(fid)

        return walk()

    def refresh(self) -> None:
        """Take what the catalog pushed.

        Pool answers are indexed at once. Finished background rescans come from a queue
        poll. Once per step, at most
        :data:`~vllm_kvtier.plan.rescan_merge.MERGE_SLICE` chunks are added, and as many
        removed. The rest go at the next steps. Called before lookups. So a request sees
        what other instances stored. And it no longer offers what the tier lost. A chunk
        waiting to be removed is not offered. A pinned one goes at its unpin."""
        self._take_answers()
        piece = self.feed.take_slice(self.ctx.counters, self.tier)
        if piece is not None:
            self._apply_slice(*piece)

    def _apply_slice(self, to_remove: list[str], to_add: list[Added]) -> None:
        removed = 0
        for fid in to_remove:
            if fid in self.index:
                removed += self.index.retire(fid)
        n_blocks = n_files = 0
        for fid, (keys, nbytes, block_bytes) in to_add:
            if fid in self.index:
                self.index.unretire(fid)
                continue
            if block_bytes != self.block_bytes or self.acks.failed(fid):
                continue
            if self._add_found(fid, keys, nbytes, remote=True):  # our own writes are never "added"
                n_blocks += len(keys)
                n_files += 1
        self.origins.prune(len(self.index), self.index.chunk_ids)  # (keys: >= chunks)
        if removed:
            self.ctx.counters.add(CounterName.RESCAN_REMOVED_CHUNKS, self.tier, removed)
        if n_files:
            logger.info("kvtier %s: rescan found %d new blocks in %d chunks", self.tier, n_blocks, n_files)

    def take_forgets(self) -> list[str]:
        """Chunks that the applied rescans no longer list, for this step's metadata.

        They were deleted or expired out of band since the last call. Each rank's store
        drops them from its writer's manifest. No request is sent; a chunk of another
        writer is not in it. At most :data:`~vllm_kvtier.plan.rescan_merge.MERGE_SLICE` go
        a step, as the slices that found them."""
        return self.feed.merge.take_forgets()

    def rescan_pending(self) -> int:
        """Chunks of finished rescans not applied yet (added or removed)."""
        return self.feed.merge.pending()

    def reclaim(self, chunk_ids: Sequence[str]) -> None:
        """Delete these chunks with the next step's deletes; counted as ``reclaimed_files``.

        They are ours, left unusable: on only some ranks by a crashed predecessor, or of
        another block size. Indexed chunks are never reclaimed."""
        fids = [f for f in chunk_ids if f not in self.index]
        self.writes.delete(fids)
        self.ctx.counters.add(CounterName.RECLAIMED_FILES, self.tier, len(fids))

    def discover(self, keys: Sequence[BlockKey]) -> bool:
        """Key-named tiers: submit a pool lookup of the ``keys`` this index does not know.

        It runs on the scheduler thread and never waits for the pool. It returns True while
        an answer about one of them is still to come within the lookup's deadline. The
        caller may then ask again next step (vLLM's ``None``). Until then they are a miss.
        An answer that comes is indexed by :meth:`refresh`, whoever asked."""
        if not self.feed.pooled:
            return False
        self._take_answers()
        ids = self.feed.unanswered([k.hex() for k in keys if self._unknown(k)])
        if not ids:
            return False
        self.feed.submit(ids)
        self._take_answers()  # a pool answered from memory has answered already
        return self.feed.waiting(ids)

    def _unknown(self, key: BlockKey) -> bool:
        return self.index.locate(key) is None and not self.index.knows(key)

    def _take_answers(self) -> None:
        """Index the chunks the pool's answers found (each one block, named by its key)."""
        nbytes = self.file_bytes(1)
        for fid, present in self.feed.take_answers():
            key = BlockKey(bytes.fromhex(fid))
            if present and self._unknown(key):
                self.acks.retry(fid)  # it is there again (rewritten)
                self._add_found(fid, [key], nbytes, remote=True)

    def locate(self, key: BlockKey) -> tuple[str, int] | None:
        """(chunk id, position) of ``key`` if it is loadable now."""
        loc = self.index.locate(key)
        if loc is not None and self.feed.merge.removing(loc[0]):
            return None  # gone from the tier; its removal is applied over the next steps
        if loc is not None and self.cooling.cooling(loc[0]):
            return None
        return loc

    def cool_down(self, chunk_id: str) -> None:
        """A read of ``chunk_id`` failed: skip it in lookups for a while."""
        self.cooling.start(chunk_id)

    # ---- admission -----------------------------------------------------------------

    def note_request(self, keys: Sequence[bytes]) -> None:
        """Count one more request whose prompt holds ``keys``."""
        self.admission.note_request(keys)

    def admitted(self, key: BlockKey) -> bool:
        if self.admission.paused():
            return False  # the breaker is open: the tier keeps failing
        return self.admission.seen_enough(key) and not self.index.knows(key)

    # ---- events from the CPU tier ----------------------------------------------------

    def on_cpu_evict(self, slot: int, key: BlockKey) -> None:
        self.writes.forget_dirty(key)
        if self.policy.mode == "write-back" and self.admitted(key):
            self.writes.demote(slot, key)

    def on_cpu_save(self, slot: int, key: BlockKey) -> None:
        if self.policy.mode == "write-through" and self.admitted(key):
            self.writes.write_through(slot, key)
        elif self.policy.mode == "write-back" and self.policy.flush_interval_s > 0 and not self.index.knows(key):
            self.writes.mark_dirty(slot, key)

    def awaits_writes(self) -> bool:
        """Whether chunks written lately are not durable yet: an idle engine should step
        on, so that the ranks' reports land and their keys become loadable before the
        next request looks them up. Bounded: a write planned more than
        :data:`WRITE_SETTLE_S` ago that never reports stops keeping the engine busy."""
        return self.index.writing() and self.ctx.clock() - self._last_write_s < WRITE_SETTLE_S

    def has_flush_work(self) -> bool:
        """Blocks only in DRAM that an idle engine should write now, or deletes to send.

        Deletes are the start-up reclaim: debris goes at the first step, not at the first
        request."""
        return self.writes.has_flush_work(paused=self.admission.paused())

    # ---- per step --------------------------------------------------------------------

    def file_bytes(self, nblocks: int) -> int:
        return header_bytes_for(nblocks) + nblocks * align_up(self.block_bytes)

    def _chunk(self, items: list[SlotKey]) -> list[ChunkWriteJob]:
        jobs = []
        n = self.policy.chunk_blocks
        for i in range(0, len(items), n):
            part = [(s, k) for s, k in items[i : i + n] if not self.index.knows(k)]
            if not part:
                continue
            keys = [k for _, k in part]
            fid = keys[0].hex() if self.policy.key_named else chunk_id_for(keys)
            evicted = self.index.reserve(fid, keys, self.file_bytes(len(keys)), reused=self.admission.reused(keys))
            if evicted is None:
                self.ctx.counters.add(CounterName.STORE_SKIPPED, self.tier, len(keys))
                continue
            self.writes.delete(evicted)
            self.acks.retry(fid)  # a key-named chunk may be written again
            jobs.append(ChunkWriteJob(self.tier, fid, tuple(s for s, _ in part), tuple(keys)))
        if jobs:
            self._last_write_s = self.ctx.clock()
        return jobs

    def take_jobs(
        self, saved_this_step: set[BlockKey], cpu_slot_of: Callable[[BlockKey], int | None], *,
        idle: bool = False,
    ) -> tuple[list[ChunkWriteJob], list[ChunkWriteJob], list[str]]:
        """(demotes, write-through writes, deletes) for this step's metadata.

        ``idle``: the engine has no request (flush every dirty block now, see the module
        doc). The worker copies demoted slots *before* this step's saves. It copies
        write-through slots *after* them. So a pair is dropped when the slot will not hold
        that key's bytes at that moment. One case is a demoted key saved in this same step
        (its bytes never reached the slot). The other is a write-through key whose slot was
        reused later in the step. Background flushes go with the write-through writes (the
        slot holds its key after the saves).
        """
        counters, world_size = self.ctx.counters, self.ctx.world_size
        self.feed.answered.new_step()
        self.refresh()
        demote, through = self.writes.take(saved_this_step, cpu_slot_of)
        if not self.admission.paused():
            flushed = self.writes.take_flush(cpu_slot_of, idle=idle, stored=self.index.knows)
            if flushed:
                counters.add(CounterName.FLUSHED_BLOCKS, self.tier, len(flushed))
                through += flushed
        before = self.index.evicted_blocks
        demote_jobs = self._chunk(demote)
        through_jobs = self._chunk(through)
        counters.add(CounterName.EVICTIONS, self.tier, self.index.evicted_blocks - before)
        deletes = self.writes.take_deletes()
        self.feed.merge.new_step()  # the next step applies the next slice of a rescan
        counters.set_gauge(GaugeName.USAGE_BYTES, self.tier, (self.index.used_bytes + self.reserved_bytes) * world_size)
        if self.index.capacity_bytes is not None:
            counters.set_gauge(GaugeName.CAPACITY_BYTES, self.tier,
                               (self.index.capacity_bytes + self.reserved_bytes) * world_size)
        return demote_jobs, through_jobs, deletes

    def drop_key(self, key: BlockKey) -> None:
        """``key``'s bytes are wrong (computed on top of a failed load): drop the chunk
        that holds or is writing it."""
        fid = self.index.file_holding(key)
        if fid is not None:
            self.index.remove(fid)
            self.acks.forget(fid)
            self.writes.delete([fid])

    def distrust_key(self, key: BlockKey) -> None:
        """Shadow verification found ``key``'s stored block wrong: never serve its chunk
        again. An exclusive tier (our own NVMe directory) deletes it, as :meth:`drop_key`.
        A shared tier (a bucket, a pool: other instances read it) only forgets it here, for
        good. No rescan or pool lookup indexes it again; it counts in
        ``verify_forgotten_chunks``. One sample on one instance may be a false alarm (a
        tolerance too tight for a kernel). A delete would take the chunk from every
        instance. Each instance verifies what it reads itself. The chunk goes when its
        writer or a lifecycle rule removes it, or when this instance writes the key again."""
        if self.policy.exclusive:
            self.drop_key(key)
            return
        fid = self.index.file_holding(key)
        if fid is None:
            return
        self.index.remove(fid)
        self.acks.forget(fid)
        self.feed.merge.drop(fid)
        remember(self._distrusted, fid, _DISTRUSTED_CHUNKS)
        self.ctx.counters.add(CounterName.VERIFY_FORGOTTEN_CHUNKS, self.tier)

    def on_worker_meta(self, meta: WorkerReport) -> None:
        tier = self.tier
        failed = {fid for t, fid in meta.failed if t == tier}
        bad = {fid for t, fid in meta.bad if t == tier}
        refused = {fid for t, fid in meta.refused if t == tier}  # dropped like failures, but
        # a full queue is back-pressure: it does not count toward the write breaker
        written = {fid: n for (t, fid), n in meta.written.items() if t == tier}
        self.admission.on_writes(len(failed), len(written))
        for fid in failed | bad | refused:
            self.acks.fail(fid)
            if self.index.remove(fid):
                logger.warning("kvtier %s: dropped chunk %s (write failed or unreadable)", tier, fid)
            ours = self._deletes_bad(fid)
            if fid in bad and fid not in failed | refused and not ours:
                # Another writer's chunk on a shared tier: what says it is bad may be our
                # own index (keys and header from an unsigned manifest anyone can forge), not
                # the object. Forgotten here (a miss), never deleted for every reader.
                self.ctx.counters.add(CounterName.FORGOTTEN_CHUNKS, tier)
                continue
            self.origins.forget(fid, remote=False)
            if ours:  # delete whatever a rank may have left
                self.writes.delete([fid])
            # Else a write that failed or was refused on a shared tier: its id names the content,
            # so the object may be another instance's. Nothing is deleted; what our other
            # ranks wrote is in our manifest (our next start reclaims it).
        for fid in {fid for t, fid in meta.untrusted if t == tier} - bad - failed:
            self._forget_untrusted(fid)
        for fid, n in written.items():
            if fid in failed or fid in refused or not self.acks.written(fid, n):
                continue
            # durable on every rank: ours now (also a key-named chunk we rewrote)
            self.origins.mark_ours(fid, shared=not self.policy.exclusive)
            self._distrusted.pop(fid, None)  # rewritten by us from freshly computed KV
            self.index.confirm(fid)
            if self.on_durable is not None:
                self.on_durable(self.index.loadable_keys(fid))
            self.feed.note_written(fid)

    def _deletes_bad(self, fid: str) -> bool:
        """Whether a chunk whose read or write failed is deleted, not only forgotten.

        On an exclusive tier it always is: every chunk there is this engine's. On a shared
        one, only a chunk this process wrote on every rank is deleted. Its header and keys
        came from its own write, so the failure is the object's. A shared object found by a
        listing or a manifest is left to its writer (and a lifecycle rule). So is one whose
        write failed."""
        return self.policy.exclusive or self.origins.written_here(fid)

    def _forget_untrusted(self, fid: str) -> None:
        """A read refused ``fid`` as ``unauthenticated``: out of the index, and kept out.

        The chunk was signed with a key no longer accepted (after a rotation), or unsigned.
        Leaving the index means its keys are written again. A rescan that still lists it
        does not bring it back. It is not deleted from a listed tier: on a shared bucket it
        may be another fleet's good data, and a lifecycle rule collects it. A key-named
        chunk (a pool) is deleted: the rewrite reuses its name, and a pool keeps an existing
        object on a put."""
        self.acks.fail(fid)
        if self.index.remove(fid):
            logger.info("kvtier %s: forgot chunk %s (not signed with an accepted key); its blocks are written "
                        "again", self.tier, fid)
            self.ctx.counters.add(CounterName.UNTRUSTED_CHUNKS, self.tier)
        if self.policy.key_named:
            self.writes.delete([fid])

    def close(self) -> None:
        """Shutdown (scheduler thread): close the catalog (its thread and stores)."""
        self.feed.close()
