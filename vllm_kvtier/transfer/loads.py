"""Loads: CPU slots copied into engine blocks, tracked until vLLM is told how they ended.

Who calls it: :class:`~vllm_kvtier.transfer.worker.WorkerHalf`, from the worker's main
thread, in vLLM's call order; copies may run on the copy engine's thread, lower-tier reads
on the tiers' threads. Every method that moves bytes takes the
:class:`~.datapath.DataPath`. Nothing here raises into vLLM and nothing blocks, except a
sync load (ordered before the model reads the KV cache) and :meth:`Loads.wait_for_layer`.

Three kinds of load:

- **Sync** (``LoadJob.asynchronous`` False): copied before the forward. With layered loads
  on, one transfer per layer (:class:`LayerLoad`), waited for just before that layer runs.
- **Async, from CPU**: the copy completes later; :meth:`Loads.poll` reports the request.
- **Async, from below CPU** (NVMe, S3, a P/D peer): the blocks are read into their CPU
  slots first. Each read is routed back to its load by ``(tier, read id)``. Once all of a
  load's reads are in, its good slots are verified and copied as above.

A block fails (and is recomputed, never served) when its slot does not hold the expected
key, when its checksum does not match (``cpu.checksum``), when a read or copy fails, or
when fault injection says so. Failed blocks go to :meth:`Loads.take_errors` no later than
the poll that reports their request; with ``by_request`` the request goes to
:meth:`Loads.take_failed` instead.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.jobs import ChunkRead, LoadJob
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters
from vllm_kvtier.transfer.copier import Transfer
from vllm_kvtier.transfer.datapath import DataPath
from vllm_kvtier.transfer.peer import PeerResult

logger = logging.getLogger(__name__)

TIER = TierName.CPU

#: A lower-tier read: (tier name, the read id that tier gave).
ReadRef = tuple[str, int]


@dataclass(slots=True)
class AsyncLoad:
    """An async load not reported yet."""

    req_id: str
    #: The slot -> engine copy; None until it starts.
    transfer: Transfer | None
    failed_blocks: set[int]
    #: The blocks the copy fills.
    loading_blocks: list[int]
    job: LoadJob | None = None
    #: Lower-tier reads still filling CPU slots; the copy starts after them. None: no
    #: lower-tier stage, or it is over.
    pending_reads: set[ReadRef] | None = None
    #: Blocks of this load that came from lower tiers (counted there, not under "cpu").
    lower_blocks: int = 0
    #: The slowest of its lower-tier reads, from issue to done on the tier's I/O threads
    #: (the tiers' own time: no wait for an engine step in it).
    read_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class LayerLoad:
    """One layer's transfer of a layered sync load, and the blocks it fills."""

    transfer: Transfer
    blocks: list[int]


def blocks_of(job: LoadJob, slots: tuple[int, ...]) -> set[int]:
    """The blocks of ``job`` that ``slots`` fill."""
    wanted = set(slots)
    return {b for b, s in zip(job.block_ids, job.slots, strict=True) if s in wanted}


class Loads:
    def __init__(self, cfg: KVTierConfig, counters: Counters) -> None:
        self.cfg = cfg
        self.counters = counters
        #: Report a failed async load per request (:meth:`take_failed`), never by block:
        #: vLLM refuses block-level errors for a model with more than one KV cache group.
        self.by_request = False
        self._rng = random.Random(cfg.fault_injection.seed)
        self._async: list[AsyncLoad] = []
        #: (tier, read id) -> the async load that read fills
        self._by_read: dict[ReadRef, AsyncLoad] = {}
        #: layer name -> the transfers of that layer, waited for in wait_for_layer
        self._layers: dict[str, list[LayerLoad]] = {}
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        #: request -> its finished async load's slowest lower-tier read (s), for the report
        self._read_seconds: dict[str, float] = {}

    # ---- start ----------------------------------------------------------------------

    def start(self, path: DataPath, job: LoadJob) -> None:
        """Verify and issue one load. A sync one is ordered before the forward here."""
        if job.reads or job.peer_read is not None or job.unloadable:
            self._start_lower(path, job)
            return
        blocks, slots, failed = self._verify(path, job)
        if blocks and path.layered and not job.asynchronous:
            self._start_layered(path, blocks, slots, failed)
            return
        transfer: Transfer | None = None
        if blocks:
            try:
                transfer = path.engine.submit("load", blocks, slots, background=job.asynchronous)
            except Exception:
                logger.exception("kvtier: load of %d blocks failed", len(blocks))
                failed.update(blocks)
                blocks = []
        if failed:
            logger.warning("kvtier: %d of %d blocks of request %s failed to load; recomputing",
                           len(failed), len(job.block_ids), job.req_id)
            self.counters.add(CounterName.LOAD_FAILURES, TIER, len(failed))
        if transfer is not None:
            path.slots.mark_busy(slots, transfer)
        if job.asynchronous:
            self._async.append(AsyncLoad(job.req_id, transfer, failed, blocks))
            return
        if transfer is not None:
            try:
                path.engine.order_before_compute(transfer)
            except Exception:
                logger.exception("kvtier: load of %d blocks failed", len(blocks))
                failed.update(blocks)
                blocks = []
            self._account(path, transfer, len(blocks))
        self._errors.update(failed)

    def _verify(self, path: DataPath, job: LoadJob,
                skip: frozenset[int] | set[int] = frozenset()) -> tuple[list[int], list[int], set[int]]:
        """Split a job into the blocks that can be loaded (with their slots) and those that cannot."""
        ok_blocks, ok_slots, failed = [], [], set()
        rate = self.cfg.fault_injection.load_error_rate
        for b, s, k in zip(job.block_ids, job.slots, job.keys, strict=True):
            if b in skip:
                continue
            good = path.slots.holds(s, k)
            if good and self.cfg.cpu.checksum:
                good = path.slots.crc_matches(s)
            if good and rate and self._rng.random() < rate:
                good = False
            if good:
                ok_blocks.append(b)
                ok_slots.append(s)
            else:
                failed.add(b)
        return ok_blocks, ok_slots, failed

    def _start_layered(self, path: DataPath, blocks: list[int], slots: list[int], failed: set[int]) -> None:
        """Sync load, one transfer per layer: the forward waits for each layer just before
        its attention runs (:meth:`wait_for_layer`)."""
        if failed:
            self.counters.add(CounterName.LOAD_FAILURES, TIER, len(failed))
            self._errors.update(failed)
        try:
            layers = path.engine.submit_layers(blocks, slots)
        except Exception:
            logger.exception("kvtier: load of %d blocks failed", len(blocks))
            self.counters.add(CounterName.LOAD_FAILURES, TIER, len(blocks))
            self._errors.update(blocks)
            return
        for name, t in layers.items():
            self._layers.setdefault(name, []).append(LayerLoad(t, blocks))
        last = list(layers.values())[-1]  # layers are copied in order: the last ends last
        path.slots.mark_busy(slots, last)
        self.counters.add(CounterName.BLOCKS_LOADED, TIER, len(blocks))
        self.counters.add(CounterName.BYTES_LOADED, TIER, len(blocks) * path.layout.block_bytes)

    def _start_lower(self, path: DataPath, job: LoadJob) -> None:
        """Async load with blocks below CPU: read them into their CPU slots first (blocks
        without a slot fail at once: recomputed)."""
        failed = set(job.unloadable)
        pending: set[ReadRef] = set()
        for read in job.reads:
            tier = path.lower.get(read.tier)
            rid = tier.start_read(read) if tier is not None else None
            if rid is None:
                failed.update(blocks_of(job, read.slots))
            else:
                pending.add((read.tier, rid))
        n_lower = sum(len(r.slots) for r in job.reads)
        if job.peer_read is not None:
            path.slots.claim(job.peer_read.slots)  # NIXL writes into them from now on
            prid = path.peer.read(job.peer_read) if path.peer is not None else None
            if prid is None:
                failed.update(blocks_of(job, job.peer_read.slots))
            else:
                pending.add((TierName.PEER, prid))
            n_lower += len(job.peer_read.slots)
        load = AsyncLoad(job.req_id, None, failed, [], job, pending, n_lower)
        self._async.append(load)
        for ref in pending:
            self._by_read[ref] = load

    # ---- layered loads --------------------------------------------------------------

    def unwaited_layers(self) -> list[str]:
        """The layers whose loads were not waited for yet, in the order they were issued."""
        return list(self._layers)

    def wait_for_layer(self, path: DataPath, layer_name: str) -> float:
        """Before ``layer_name``'s attention: wait until its rows are in place. Returns the
        seconds waited (0 when nothing was pending). A failed layer's blocks are errors."""
        pending = self._layers.pop(layer_name, None)
        if not pending:
            return 0.0
        t0 = time.perf_counter()
        for ll in pending:
            try:
                path.engine.order_before_compute(ll.transfer)
            except Exception:
                logger.exception("kvtier: layer load of %s failed", layer_name)
                self.counters.add(CounterName.LOAD_FAILURES, TIER, len(ll.blocks))
                self._errors.update(ll.blocks)
        waited = time.perf_counter() - t0
        self.counters.add(CounterName.LOAD_WAIT_SECONDS, TIER, waited)
        if not self._layers:
            seconds = max(time.perf_counter() - ll.transfer.started_s for ll in pending)
            self.counters.add(CounterName.LOAD_SECONDS, TIER, seconds)
        return waited

    # ---- completions ----------------------------------------------------------------

    def on_read(self, ref: ReadRef, read: ChunkRead, ok: bool, seconds: float = 0.0) -> bool:
        """A lower-tier read ended, ``seconds`` after it was issued. Returns whether it was
        one of a load's."""
        load = self._by_read.pop(ref, None)
        if load is None:
            return False
        assert load.pending_reads is not None and load.job is not None
        load.pending_reads.discard(ref)
        load.read_seconds = max(load.read_seconds, seconds)
        if not ok:
            load.failed_blocks.update(blocks_of(load.job, read.slots))
        return True

    def on_peer_read(self, prid: int, res: PeerResult) -> None:
        """A P/D peer read ended. Its slots hold what it verified; the other blocks fail."""
        load = self._by_read.pop((TierName.PEER, prid), None)
        if load is None:
            return
        assert load.pending_reads is not None and load.job is not None
        load.pending_reads.discard((TierName.PEER, prid))
        bad = [s for s, k in zip(res.read.slots, res.read.keys, strict=True) if k not in res.good]
        load.failed_blocks.update(blocks_of(load.job, tuple(bad)))

    def poll(self, path: DataPath) -> set[str]:
        """The requests whose async loads ended (``finished_recving``). Their failed blocks
        are errors (or the requests failed) from now on."""
        recving: set[str] = set()
        still: list[AsyncLoad] = []
        for a in self._async:
            if a.pending_reads is not None:
                if a.pending_reads:
                    still.append(a)
                    continue
                self._finish_lower_stage(path, a)
            if a.transfer is not None:
                try:
                    if not a.transfer.done():
                        still.append(a)
                        continue
                    self._account(path, a.transfer, max(0, len(a.loading_blocks) - a.lower_blocks))
                except Exception:
                    logger.exception("kvtier: async load for %s failed", a.req_id)
                    self.counters.add(CounterName.LOAD_FAILURES, TIER, len(a.loading_blocks))
                    a.failed_blocks.update(a.loading_blocks)  # every block is suspect
            if self.by_request and a.failed_blocks:
                self._failed.add(a.req_id)
            else:
                self._errors.update(a.failed_blocks)
            if a.read_seconds > 0:
                self._read_seconds[a.req_id] = a.read_seconds
            recving.add(a.req_id)
        self._async = still
        return recving

    def _finish_lower_stage(self, path: DataPath, a: AsyncLoad) -> None:
        """All lower-tier reads of ``a`` are done: copy its good slots into the engine blocks."""
        assert a.job is not None
        blocks, slots, failed = self._verify(path, a.job, skip=a.failed_blocks)
        a.failed_blocks |= failed
        if failed:
            self.counters.add(CounterName.LOAD_FAILURES, TIER, len(failed))
        a.loading_blocks = blocks
        a.pending_reads = None
        if blocks:
            try:
                a.transfer = path.engine.submit("load", blocks, slots, background=True)
                path.slots.mark_busy(slots, a.transfer)
            except Exception:
                logger.exception("kvtier: load of %d blocks failed", len(blocks))
                a.failed_blocks.update(blocks)
                a.loading_blocks = []

    def _account(self, path: DataPath, t: Transfer, nblocks: int) -> None:
        if nblocks:
            self.counters.add(CounterName.BLOCKS_LOADED, TIER, nblocks)
            self.counters.add(CounterName.BYTES_LOADED, TIER, nblocks * path.layout.block_bytes)
            self.counters.add(CounterName.LOAD_SECONDS, TIER, time.perf_counter() - t.started_s)

    # ---- outcomes -------------------------------------------------------------------

    def take_errors(self) -> set[int]:
        """Failed blocks since the last call (vLLM recomputes them)."""
        errors, self._errors = self._errors, set()
        return errors

    def take_read_seconds(self) -> dict[str, float]:
        """Per request reported by :meth:`poll` since the last call: its slowest lower-tier
        read's time (requests whose load read nothing below CPU are absent)."""
        out, self._read_seconds = self._read_seconds, {}
        return out

    def take_failed(self) -> set[str]:
        """Requests whose async load failed (``by_request`` only); each is also reported by
        :meth:`poll`, in this pass or an earlier one."""
        failed, self._failed = self._failed, set()
        return failed
