"""Worker half: the data path, in each worker process (one per TP rank).

Who calls it: :class:`~vllm_kvtier.connector.KVTierConnector` in the worker role, from the
worker's main thread; the copy engine may use one background thread of its own. It reads
plain :class:`~vllm_kvtier.jobs.StepPlan` values and returns a
:class:`~vllm_kvtier.jobs.WorkerReport` (no vLLM here); the tiers below CPU are built by
the ``make_tiers`` the connector hands in (its wiring, ``connector/lower.py``).

Per step, in vLLM's order:

1. ``begin_step(meta)`` (from ``handle_preemptions``, before the step touches any block, or
   at the latest from ``start_load_kv``): allocate the pool on first use, settle the host
   saves that finished and queue their lower-tier writes, then issue this step's
   **saves**. Saves come first so a load in the same step can read a block saved in it,
   and before the forward so no block is overwritten before it is copied.
   ``end_step`` (from ``wait_for_save``, after the forward) saves the blocks the forward
   completed. On a host KV cache those copies run on the copy thread while the step samples
   its tokens, vLLM schedules the next one and, on the next forward, computes (a token
   waits for none of them). That forward writes no block they read: vLLM frees a block
   only when its request finishes or is preempted, and ``begin_step`` orders the saves of
   those requests (``StepPlan.freed``, ``preempted``) before the forward, the first that
   can rewrite the block (vLLM never waits for our copies to reuse it); a hybrid model's
   sliding-window blocks are saved inline (``wait_saves``). A step that
   reads or writes pool slots on the host (loads, demotions, prefetches, verification)
   first waits for every save and settles it, so a failed save's slots are never used;
   otherwise the saves of forwards before the last are waited for, so at most one
   forward's saves are queued.
2. ``start_loads()`` (from ``start_load_kv``): verify and issue **loads**. Sync loads are
   ordered before the model reads the KV cache; async loads complete later.
3. ``transfer_results(finished)`` (from ``get_transfer_results``): poll transfers; report
   async loads done (``finished_recving``; no block is held for a save, so there is never
   a ``finished_sending``). Failed blocks go to ``take_load_errors`` no later than the pass
   that reports their request, so vLLM recomputes them.

A load fails (and its blocks are recomputed, never served) when the slot does not hold the
expected key, when its checksum does not match (``cpu.checksum``), when the copy raises, or
when fault injection says so. No failure raises into vLLM.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.errors import run_all
from vllm_kvtier.jobs import ChunkRead, ChunkWriteJob, LoadJob, PrefetchJob, SaveJob, StepPlan, WorkerReport
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.transfer.copier import CopyEngine, Transfer, _HostSave, make_copy_engine
from vllm_kvtier.transfer.layout import KVLayout, build_layout
from vllm_kvtier.transfer.peer import PeerLink
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.thread_cpu import SAMPLER
from vllm_kvtier.transfer.tier_io import ChunkWorker
from vllm_kvtier.transfer.verify import BlockVerifier

logger = logging.getLogger(__name__)

TIER = TierName.CPU


@dataclass
class _AsyncLoad:
    req_id: str
    transfer: Transfer | None
    failed_blocks: set[int]
    loading_blocks: list[int]
    #: Lower-tier reads (tier, read id) still filling CPU slots; the slot -> engine copy
    #: starts after them.
    job: LoadJob | None = None
    pending_reads: set[tuple[str, int]] | None = None
    #: Blocks of this load that came from lower tiers (counted there, not under "cpu").
    lower_blocks: int = 0


_F = TypeVar("_F", bound=Callable[..., Any])


def _step_timed(fn: _F) -> _F:
    """Count the call's time into the step's total (``step_seconds``, see transfer_results)."""
    @functools.wraps(fn)
    def timed(self: WorkerHalf, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._step_time += time.perf_counter() - t0
    return cast(_F, timed)


class WorkerHalf:
    def __init__(self, cfg: KVTierConfig, *, num_blocks: int, namespace: str = "", rank: int = 0,
                 make_tiers: Callable[..., dict[str, ChunkWorker]] | None = None,
                 cache_dtype: str = "auto") -> None:
        """``make_tiers(cfg, namespace=, rank=, block_bytes=, counters=, kv_dtype=)``: this
        rank's tiers below CPU by name, built once the pool exists (None: none).
        ``cache_dtype``: vLLM's ``cache_dtype`` (which fp8 format a ``uint8`` cache holds)."""
        self.cfg = cfg
        self.cache_dtype = cache_dtype
        self._make_tiers: Callable[..., dict[str, Any]] | None = make_tiers
        self.num_blocks = num_blocks
        self.namespace = namespace
        self.rank = rank
        #: The tiers below CPU, by name ("nvme", "s3"); built with the pool.
        self.lower: dict[str, ChunkWorker] = {}
        self.counters = Counters()
        self.layout: KVLayout | None = None
        self.pool: CPUPool | None = None
        self.engine: CopyEngine | None = None
        #: what each CPU slot holds and which device copy still uses it; made with the pool
        #: and handed to every tier driver
        self.slots: SlotTable | None = None
        self._step_begun = -1
        self._step_ended = -1
        self._meta: StepPlan | None = None
        self._inflight_saves: dict[str, list[Transfer]] = {}
        self._async_loads: list[_AsyncLoad] = []
        self._load_errors: set[int] = set()
        #: Report a failed async load per request (``take_failed_loads``), never by block:
        #: vLLM refuses block-level errors for a model with more than one KV cache group.
        self.request_level_failures = False
        #: Wait for each save's copy before the step ends (hybrid models: vLLM frees a
        #: sliding-window group's blocks as the window passes, without waiting for us).
        self.wait_saves = False
        self._failed_loads: set[str] = set()
        #: P/D peer to peer over NIXL (a ``nixl`` section): this rank's agent and stamps.
        self.peer: PeerLink | None = None
        self._peer_published = False
        #: why this rank has no PeerLink (published instead of a description)
        self._peer_unavailable = ""
        self._peer_done: set[str] = set()
        #: Host saves on the copy thread, with their jobs and the step that issued them:
        #: settled (a failed one's slots invalidated) in transfer_results, and waited for
        #: in begin_step only as far as it must (see there).
        self._host_saves: list[tuple[Transfer, SaveJob, int]] = []
        #: Lower-tier writes of the slots those saves fill: (step, tier, jobs), queued once
        #: every save issued up to that step is settled (they copy the slots' bytes out).
        self._deferred_writes: list[tuple[int, str, list[ChunkWriteJob]]] = []
        #: CUDA saves whose slots get their stamp once the copy is done: (transfer, slots, keys)
        self._unstamped: list[tuple[Transfer, tuple[int, ...], tuple[bytes, ...]]] = []
        #: Prefetch reads: (tier, read id) -> prefetch id; prefetch id -> reads left, failed?
        self._prefetch_reads: dict[tuple[str, int], int] = {}
        self._prefetch_left: dict[int, list] = {}
        self._prefetch_done = WorkerReport()
        #: Layer-by-layer sync loads: on once the pool exists and the config/device say so.
        self.layered = False
        #: layer name -> (transfer of that layer, its blocks), waited for in wait_for_layer
        self._layer_loads: dict[str, list[tuple[Transfer, list[int]]]] = {}
        self._rng = random.Random(cfg.fault_injection.seed)
        #: this step's time in our calls so far (counted by transfer_results)
        self._step_time = 0.0
        #: Shadow verification (``verify.sample_rate`` > 0 only); made with the pool.
        self.verifier: BlockVerifier | None = None
        #: The scheduler's namespace when it is not ours (then no lower tier is built, and
        #: every lower-tier job is refused); "" while they agree.
        self.namespace_conflict = ""

    @property
    def _table(self) -> SlotTable:
        assert self.slots is not None, "the slot table is made with the pool, on the first step"
        return self.slots

    # ---- setup -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layout = build_layout(kv_caches, self.num_blocks)
        logger.info("kvtier: KV layout %s, %d B per block", self.layout.description,
                    self.layout.block_bytes)
        if self.layout.shared and self.cfg.layer_pipelined_loads != "off":
            logger.info("kvtier: layers share KV tensors (hybrid KV cache groups): layer-by-layer loads off")

    def _check_namespace(self, theirs: str) -> None:
        """Compare the scheduler's namespace (sent in the first plan) with ours, once, before
        the lower tiers exist. The two processes compute it apart (the scheduler cannot see
        this worker's tensors or environment); if they differ, the scheduler's index and this
        worker's stored headers would name different things, and either one may be wrong:
        no lower tier is built, and every lower-tier job is refused and counted."""
        if not theirs or theirs == self.namespace or self.namespace_conflict:
            return
        self.namespace_conflict = theirs
        logger.error("kvtier: rank %d computed namespace %s but the scheduler computed %s (model files, config or "
                     "KV layout seen differently by the two processes): this rank refuses every NVMe/S3/pool read "
                     "and write (blocks recomputed, nothing stored); the scheduler's and this worker's namespace "
                     "log lines show the inputs", self.rank, self.namespace, theirs)

    def _refuse_lower(self, meta: StepPlan) -> None:
        """A namespace conflict: the step's lower-tier writes are reported failed (the
        scheduler drops those chunks; its breaker pauses the tier), each counted."""
        for job in meta.demotes + meta.write_through:
            self._prefetch_done.failed.add((job.tier, job.file_id))  # the report being built
            self.counters.add(CounterName.NAMESPACE_MISMATCH, job.tier)
        for read in [r for load in meta.loads for r in load.reads] + [r for pf in meta.prefetches for r in pf.reads]:
            self.counters.add(CounterName.NAMESPACE_MISMATCH, read.tier)

    def _ensure_pool(self, num_slots: int) -> None:
        if self.pool is not None:
            if num_slots != self.pool.num_slots:
                raise RuntimeError(
                    f"kvtier: scheduler changed the pool size ({self.pool.num_slots} -> {num_slots})"
                )
            return
        assert self.layout is not None, "register_kv_caches was not called"
        pin_cfg = self.cfg.cpu.pin_memory
        pin = pin_cfg == "on" or (pin_cfg == "auto" and self.layout.device.type == "cuda")
        self.pool = CPUPool(num_slots, self.layout.plane_bytes, pin=pin, prefault=self.cfg.cpu.prefault)
        self.engine = make_copy_engine(self.layout, self.pool)
        mode = self.cfg.layer_pipelined_loads
        self.layered = not self.layout.shared and (mode == "on" or (mode == "auto" and self.layout.device.type == "cuda"))
        self.slots = SlotTable(self.pool)
        if self.cfg.nixl is not None:
            try:
                self.peer = PeerLink(self.cfg.nixl, self.pool, rank=self.rank, counters=self.counters)
            except Exception as e:  # ImportError (install hint), no UCX...: P/D falls back to recompute
                logger.error("kvtier peer: NIXL unavailable, P/D peer transfers disabled: %s", e)
                self.counters.add(CounterName.STORE_FAILURES, TierName.PEER)
                self._peer_unavailable = str(e)
            else:
                self.slots.stamp_with(self.peer)
        if self.cfg.verify.sample_rate > 0:
            self.verifier = BlockVerifier(self.cfg.verify, self.layout, self.slots, namespace=self.namespace,
                                          rank=self.rank, cache_dtype=self.cache_dtype)
        if self._make_tiers is not None and not self.namespace_conflict:
            self.lower = self._make_tiers(self.cfg, namespace=self.namespace, rank=self.rank,
                                          slots=self.slots, counters=self.counters, kv_dtype=self.layout.dtype)

    # ---- per step ----------------------------------------------------------------

    @_step_timed
    def begin_step(self, meta: StepPlan) -> None:
        """Issue this step's saves. Idempotent per step (vLLM may call us twice)."""
        self._meta = meta
        if meta.step == self._step_begun:
            return
        self._step_begun = meta.step
        self._finish_layered_loads()
        self._check_namespace(meta.namespace)
        self._ensure_pool(meta.num_slots)
        assert self.engine is not None and self.pool is not None
        if self.namespace_conflict:
            self._refuse_lower(meta)  # the reads fail below: no such tier here
        # The last forward's saves may run on through this forward (why that is safe: the
        # module's docstring). A step that uses pool slots on the host waits for them all.
        touches_slots = bool(meta.loads or meta.demotes or meta.verifies or meta.prefetches)
        self._settle_host_saves(wait_before=math.inf if touches_slots else self._step_ended)
        # Demoted slots are copied out before this step's saves reuse them.
        for name, tier in self.lower.items():
            tier.write([j for j in meta.demotes if j.tier == name], copy_now=True)
            tier.delete([fid for t, fid in meta.deletes if t == name])
            tier.forget([fid for t, fid in meta.forgets if t == name])
        self._run_saves(meta.saves)
        for req_id in meta.preempted + meta.freed:
            # Its blocks went back to vLLM's pool; this step's forward must not overwrite
            # them before our copies out of them (its final save just above) complete.
            for t in self._inflight_saves.pop(req_id, []):
                self.engine.order_before_compute(t)
        for pf in meta.prefetches:
            self._start_prefetch(pf)
        if self.verifier is not None:
            for vj in meta.verifies:
                self.verifier.start(vj, self.lower)

    @_step_timed
    def end_step(self) -> None:
        """After the forward (from ``wait_for_save``): save the blocks this step completed,
        then write-through to the lower tiers. Idempotent per step."""
        meta = self._meta
        if meta is None or meta.step == self._step_ended or self.pool is None:
            return
        self._step_ended = meta.step
        self._finish_layered_loads()
        self._run_saves(meta.saves_after, background=True)
        if self.verifier is not None and meta.verifies:
            self.verifier.capture(meta.verifies)  # the forward computed their blocks
        for name, tier in self.lower.items():
            for job in meta.saves + meta.saves_after:
                tier.clean(job.slots)
            tier.mark_dirty(meta.persist_slots.get(TierName(name), ()))  # make_workers keys by TierName
            jobs = [j for j in meta.write_through if j.tier == name]
            if self._host_saves:  # they copy slots still being filled: once those are done
                self._deferred_writes.append((meta.step, name, jobs))
            else:
                tier.write(jobs)

    def _settle_host_saves(self, *, wait_before: float = -math.inf) -> None:
        """Account the host saves that finished, after waiting for those issued by a step
        before ``wait_before`` (``math.inf``: all of them): a failed one's slots hold
        nothing (a future miss). Then queue the lower-tier writes whose saves are all
        settled, in the order they were held back."""
        if self._host_saves:
            for t, _, step in self._host_saves:
                if step < wait_before:
                    t.wait()  # the copy thread runs them in order: mostly one real wait
            left = []
            for t, job, step in self._host_saves:
                if not t.done():
                    left.append((t, job, step))
                    continue
                error = getattr(t, "error", None)
                if error is not None:
                    logger.error("kvtier: save of %d blocks failed: %r", len(job.block_ids), error)
                    self.counters.add(CounterName.STORE_FAILURES, TIER, len(job.block_ids))
                    assert self.slots is not None
                    for s, k in zip(job.slots, job.keys, strict=True):
                        if self.slots.holds(s, k):  # not saved over since by a later save
                            self.slots.set_key(s, None)
            self._host_saves = left
        if self._deferred_writes:
            oldest = min((step for _, _, step in self._host_saves), default=math.inf)
            ready = 0
            while ready < len(self._deferred_writes) and self._deferred_writes[ready][0] < oldest:
                ready += 1
            writes, self._deferred_writes = self._deferred_writes[:ready], self._deferred_writes[ready:]
            # each tier's writes even when another tier's raise
            run_all(functools.partial(self.lower[name].write, jobs) for _, name, jobs in writes)

    def _log_unwritten(self) -> None:
        """At shutdown, after the settling: lower-tier writes still held back (their saves
        never finished: the copy engine failed to shut down) are lost, as a cache loses
        them; say how many."""
        if self._deferred_writes or self._host_saves:
            n = sum(len(j.keys) for _, _, jobs in self._deferred_writes for j in jobs)
            logger.error("kvtier: shutdown: %d host save(s) unfinished; %d block(s) not written to the tiers "
                         "below DRAM", len(self._host_saves), n)

    def _run_saves(self, jobs: list[SaveJob], *, background: bool = False) -> None:
        """``background``: the copy may run on the engine's copy thread (host KV cache); its
        slots are busy until :meth:`_settle_host_saves` has seen it done."""
        assert self.engine is not None and self.slots is not None
        for job in jobs:
            # before the first byte changes: a peer may be reading them, a lower-tier copy out may run
            self.slots.claim(job.slots)
            try:
                t = self.engine.submit("save", list(job.block_ids), list(job.slots), background=background)
                if self.wait_saves:
                    t.wait()
                if isinstance(t, _HostSave):
                    self._host_saves.append((t, job, self._step_ended))
            except Exception:  # a failed save is a future miss, never a failed step
                logger.exception("kvtier: save of %d blocks failed", len(job.block_ids))
                for s in job.slots:
                    self.slots.set_key(s, None)
                continue
            # A peer may read these slots: stamp them only once their bytes are complete.
            done = t.done()
            for s, k in zip(job.slots, job.keys, strict=True):
                self.slots.set_key(s, k, "now" if done else "later")
            if not done and self.peer is not None:
                self._unstamped.append((t, job.slots, job.keys))
            self._inflight_saves.setdefault(job.req_id, []).append(t)
            self._table.mark_busy(job.slots, t)
            self.counters.add(CounterName.BLOCKS_STORED, TIER, len(job.block_ids))
            self.counters.add(CounterName.BYTES_STORED, TIER, t.nbytes)
            if self.cfg.cpu.checksum:
                t.wait()
                for s in job.slots:
                    self.slots.record_crc(s)

    @_step_timed
    def start_loads(self) -> None:
        meta = self._meta
        if meta is None or not meta.loads:
            return
        assert self.engine is not None
        for job in meta.loads:
            self._start_load(job)

    def _verify(self, job: LoadJob, skip: set[int] = frozenset()) -> tuple[list[int], list[int], set[int]]:  # type: ignore[assignment]
        """Split a job into the blocks that can be loaded and the ones that cannot."""
        ok_blocks, ok_slots, failed = [], [], set()
        rate = self.cfg.fault_injection.load_error_rate
        for b, s, k in zip(job.block_ids, job.slots, job.keys, strict=True):
            if b in skip:
                continue
            good = self.slots is not None and self.slots.holds(s, k)
            if good and self.cfg.cpu.checksum:
                good = self.slots is not None and self.slots.crc_matches(s)
            if good and rate and self._rng.random() < rate:
                good = False
            if good:
                ok_blocks.append(b)
                ok_slots.append(s)
            else:
                failed.add(b)
        return ok_blocks, ok_slots, failed

    def _start_load(self, job: LoadJob) -> None:
        assert self.engine is not None
        if job.reads or job.peer_read is not None or job.unloadable:
            self._start_lower_load(job)
            return
        blocks, slots, failed = self._verify(job)
        if blocks and self.layered and not job.asynchronous:
            self._start_layered_load(job, blocks, slots, failed)
            return
        transfer: Transfer | None = None
        if blocks:
            try:
                transfer = self.engine.submit("load", blocks, slots, background=job.asynchronous)
            except Exception:
                logger.exception("kvtier: load of %d blocks failed", len(blocks))
                failed.update(blocks)
                blocks = []
        if failed:
            logger.warning("kvtier: %d of %d blocks of request %s failed to load; recomputing",
                           len(failed), len(job.block_ids), job.req_id)
            self.counters.add(CounterName.LOAD_FAILURES, TIER, len(failed))
        if transfer is not None:
            self._table.mark_busy(slots, transfer)
        if job.asynchronous:
            self._async_loads.append(_AsyncLoad(job.req_id, transfer, failed, blocks))
            return
        if transfer is not None:
            try:
                self.engine.order_before_compute(transfer)
            except Exception:
                logger.exception("kvtier: load of %d blocks failed", len(blocks))
                failed.update(blocks)
                blocks = []
            self._account_load(transfer, len(blocks))
        self._load_errors.update(failed)

    def _start_layered_load(self, job: LoadJob, blocks: list[int], slots: list[int], failed: set[int]) -> None:
        """Sync load, one transfer per layer: the forward waits for each layer just before
        its attention runs (``wait_for_layer``)."""
        assert self.engine is not None
        if failed:
            self.counters.add(CounterName.LOAD_FAILURES, TIER, len(failed))
            self._load_errors.update(failed)
        try:
            layers = self.engine.submit_layers(blocks, slots)
        except Exception:
            logger.exception("kvtier: load of %d blocks failed", len(blocks))
            self.counters.add(CounterName.LOAD_FAILURES, TIER, len(blocks))
            self._load_errors.update(blocks)
            return
        for name, t in layers.items():
            self._layer_loads.setdefault(name, []).append((t, blocks))
        last = list(layers.values())[-1]  # layers are copied in order: the last ends last
        self._table.mark_busy(slots, last)
        if self.layout is not None:
            self.counters.add(CounterName.BLOCKS_LOADED, TIER, len(blocks))
            self.counters.add(CounterName.BYTES_LOADED, TIER, len(blocks) * self.layout.block_bytes)

    def wait_for_layer(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention (``wait_for_layer_load``): its rows are in place."""
        pending = self._layer_loads.pop(layer_name, None)
        if not pending or self.engine is None:
            return
        t0 = time.perf_counter()
        for t, blocks in pending:
            try:
                self.engine.order_before_compute(t)
            except Exception:
                logger.exception("kvtier: layer load of %s failed", layer_name)
                self.counters.add(CounterName.LOAD_FAILURES, TIER, len(blocks))
                self._load_errors.update(blocks)
        self.counters.add(CounterName.LOAD_WAIT_SECONDS, TIER, time.perf_counter() - t0)
        self._step_time += time.perf_counter() - t0
        if not self._layer_loads:
            seconds = max(time.perf_counter() - t.started_s for t, _ in pending)
            self.counters.add(CounterName.LOAD_SECONDS, TIER, seconds)

    def _finish_layered_loads(self) -> None:
        """Layers the forward did not ask for (or no forward ran): wait for them now."""
        if self._layer_loads:
            self.counters.add(CounterName.LAYER_LOADS_UNWAITED, TIER, len(self._layer_loads))
        for name in list(self._layer_loads):
            self.wait_for_layer(name)

    def _start_lower_load(self, job: LoadJob) -> None:
        """Async load with blocks below CPU: read them into their CPU slots first (blocks
        without a slot fail at once: recomputed)."""
        failed = set(job.unloadable)
        pending: set[tuple[str, int]] = set()
        for read in job.reads:
            tier = self.lower.get(read.tier)
            rid = tier.start_read(read) if tier is not None else None
            if rid is None:
                failed.update(self._blocks_of(job, read.slots))
            else:
                pending.add((read.tier, rid))
        n_lower = sum(len(r.slots) for r in job.reads)
        if job.peer_read is not None:
            if self.slots is not None:  # NIXL writes into them from now on
                self.slots.claim(job.peer_read.slots)
            prid = self.peer.read(job.peer_read) if self.peer is not None else None
            if prid is None:
                failed.update(self._blocks_of(job, job.peer_read.slots))
            else:
                pending.add((TierName.PEER, prid))
            n_lower += len(job.peer_read.slots)
        self._async_loads.append(_AsyncLoad(job.req_id, None, failed, [], job, pending, n_lower))

    @staticmethod
    def _blocks_of(job: LoadJob, slots: tuple[int, ...]) -> set[int]:
        wanted = set(slots)
        return {b for b, s in zip(job.block_ids, job.slots, strict=True) if s in wanted}

    def _start_prefetch(self, job: PrefetchJob) -> None:
        """Read a prefetch's chunks into their CPU slots (reported in worker meta)."""
        state: list = [0, False]  # reads left, any failed
        for read in job.reads:
            tier = self.lower.get(read.tier)
            rid = tier.start_read(read, prefetch=True) if tier is not None else None
            if rid is None:
                state[1] = True
            else:
                self._prefetch_reads[(read.tier, rid)] = job.prefetch_id
                state[0] += 1
        self._prefetch_left[job.prefetch_id] = state
        if state[0] == 0:
            self._end_prefetch(job.prefetch_id)

    def _end_prefetch(self, pid: int) -> None:
        _, failed = self._prefetch_left.pop(pid)
        if failed:
            self._prefetch_done.prefetch_failed.add(pid)
        else:
            self._prefetch_done.prefetched[pid] = 1

    def _on_read(self, rid: int, read: ChunkRead, ok: bool) -> None:
        if ok and self.slots is not None:
            for s, k in zip(read.slots, read.keys, strict=True):
                self.slots.set_key(s, k)
                if self.cfg.cpu.checksum:
                    self.slots.record_crc(s)
        ref = (read.tier, rid)
        if self.verifier is not None and self.verifier.on_read(read.tier, rid, read, ok):
            return
        pid = self._prefetch_reads.pop(ref, None)
        if pid is not None:
            state = self._prefetch_left[pid]
            state[0] -= 1
            state[1] = state[1] or not ok
            if state[0] == 0:
                self._end_prefetch(pid)
            return
        for a in self._async_loads:
            if a.pending_reads is not None and ref in a.pending_reads:
                a.pending_reads.discard(ref)
                if not ok and a.job is not None:
                    a.failed_blocks.update(self._blocks_of(a.job, read.slots))

    def _finish_lower_stage(self, a: _AsyncLoad) -> None:
        """All lower-tier reads of ``a`` are done: copy its good slots into the engine blocks."""
        assert a.job is not None and self.engine is not None
        blocks, slots, failed = self._verify(a.job, skip=a.failed_blocks)
        a.failed_blocks |= failed
        if failed:
            self.counters.add(CounterName.LOAD_FAILURES, TIER, len(failed))
        a.loading_blocks = blocks
        a.pending_reads = None
        if blocks:
            try:
                a.transfer = self.engine.submit("load", blocks, slots, background=True)
                self._table.mark_busy(slots, a.transfer)
            except Exception:
                logger.exception("kvtier: load of %d blocks failed", len(blocks))
                a.failed_blocks.update(blocks)
                a.loading_blocks = []

    def _account_load(self, t: Transfer, nblocks: int) -> None:
        if nblocks and self.layout is not None:
            self.counters.add(CounterName.BLOCKS_LOADED, TIER, nblocks)
            self.counters.add(CounterName.BYTES_LOADED, TIER, nblocks * self.layout.block_bytes)
            self.counters.add(CounterName.LOAD_SECONDS, TIER, time.perf_counter() - t.started_s)

    def transfer_results(self, finished_req_ids: set[str], *, idle_step: bool = False) -> set[str]:
        """Return the requests whose async loads ended (``finished_recving``).

        ``idle_step``: this step ran no forward (vLLM only waits for transfers); then we
        wait up to 2 ms for lower-tier reads instead of returning at once, so the engine's
        busy loop does not starve the I/O threads of the GIL.

        The step's last connector call: the time this rank's calls took in a step that ran
        a forward is counted (``step_seconds``, ``step_calls``); idle steps delay no token."""
        t0 = time.perf_counter()
        try:
            return self._transfer_results(idle_step)
        finally:
            if not idle_step:
                self.counters.add(CounterName.STEP_SECONDS, TIER, self._step_time + time.perf_counter() - t0)
                self.counters.add(CounterName.STEP_CALLS, TIER, 1)
            self._step_time = 0.0

    def _transfer_results(self, idle_step: bool) -> set[str]:
        recving: set[str] = set()
        if self.pool is not None:
            self._settle_host_saves()
            for tier in self.lower.values():
                if idle_step and tier.pending_reads():
                    tier.wait_for_reads(0.002)
                    idle_step = False  # one wait per step
                for rid, read, ok in tier.poll():
                    self._on_read(rid, read, ok)
            if self.peer is not None:
                self._poll_peer()
        still: list[_AsyncLoad] = []
        for a in self._async_loads:
            if a.pending_reads is not None:
                if a.pending_reads:
                    still.append(a)
                    continue
                self._finish_lower_stage(a)
            if a.transfer is not None:
                try:
                    if not a.transfer.done():
                        still.append(a)
                        continue
                    self._account_load(a.transfer, max(0, len(a.loading_blocks) - a.lower_blocks))
                except Exception:
                    logger.exception("kvtier: async load for %s failed", a.req_id)
                    self.counters.add(CounterName.LOAD_FAILURES, TIER, len(a.loading_blocks))
                    a.failed_blocks.update(a.loading_blocks)  # every block is suspect
            if self.request_level_failures and a.failed_blocks:
                self._failed_loads.add(a.req_id)
            else:
                self._load_errors.update(a.failed_blocks)
            recving.add(a.req_id)
        self._async_loads = still

        for req_id, transfers in list(self._inflight_saves.items()):
            transfers[:] = [t for t in transfers if not t.done()]
            if not transfers:
                del self._inflight_saves[req_id]
        return recving

    def _poll_peer(self) -> None:
        assert self.peer is not None
        if self._unstamped:
            left = []
            for t, slots, keys in self._unstamped:
                if t.done():
                    if getattr(t, "error", None) is not None:
                        continue  # settled as failed: its slots hold nothing
                    for s, k in zip(slots, keys, strict=True):
                        if self.slots is not None and self.slots.holds(s, k):
                            self.slots.stamp(s)
                else:
                    left.append((t, slots, keys))
            self._unstamped = left
        self._peer_done |= self.peer.done_requests()
        for prid, res in self.peer.poll():
            for s, k in zip(res.read.slots, res.read.keys, strict=True):
                if self.slots is not None:  # the peer link filled and stamped them itself
                    self.slots.set_key(s, k if k in res.good else None, "unchanged")
            ref = (TierName.PEER, prid)
            for a in self._async_loads:
                if a.pending_reads is not None and ref in a.pending_reads:
                    a.pending_reads.discard(ref)
                    if a.job is not None:
                        bad = [s for s, k in zip(res.read.slots, res.read.keys, strict=True) if k not in res.good]
                        a.failed_blocks.update(self._blocks_of(a.job, tuple(bad)))

    def worker_meta(self) -> WorkerReport | None:
        meta, self._prefetch_done = self._prefetch_done, WorkerReport()
        if self.cfg.nixl is not None and self.pool is not None and not self._peer_published:
            # Once, with the first step (the pool exists from then on). A rank without NIXL
            # says so, so that the scheduler stops waiting for its address.
            meta.peer_info[self.rank] = self.peer.describe() if self.peer is not None \
                else {"unavailable": self._peer_unavailable}
            self._peer_published = True
        if self.peer is not None:
            meta.peer_done, self._peer_done = self._peer_done, set()
        for tier in self.lower.values():
            tier.take_meta(meta)
        if self.verifier is not None:
            self.verifier.take_report(meta)
        return None if meta.is_empty() else meta

    def take_failed_loads(self) -> set[str]:
        """Requests whose async load failed (``request_level_failures`` only); each is also
        reported in ``finished_recving``, in this pass or an earlier one."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> dict[str, dict[str, float]] | None:
        """This rank's counters since the last call, with the CPU time of the plugin's
        threads in this process (sampled at most once a second, :mod:`.thread_cpu`)."""
        if self.pool is not None:
            SAMPLER.sample(self.counters)
        return self.counters.drain()

    def shutdown(self) -> None:
        """Every step runs even when one fails (a tier that cannot close must not keep the
        others' threads alive); the first failure is raised at the end."""
        steps: list[Callable[[], None]] = []
        if self.engine is not None:
            steps.append(self.engine.shutdown)  # the copy thread's saves finish first
            steps.append(lambda: self._settle_host_saves(wait_before=math.inf))  # then the writes they held back
        steps.append(self._log_unwritten)
        steps.extend(tier.close for tier in self.lower.values())
        if self.peer is not None:
            steps.append(self.peer.close)
        try:
            run_all(steps)  # (the settling step writes through self.lower)
        finally:
            self.lower, self.peer = {}, None
