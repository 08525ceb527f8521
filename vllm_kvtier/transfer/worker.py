"""Worker half: the data path, in each worker process (one per TP rank).

Who calls it: :class:`~vllm_kvtier.connector.KVTierConnector` in the worker role, from the
worker's main thread; the copy engine may use one background thread of its own. It reads
plain :class:`~vllm_kvtier.jobs.StepPlan` values and returns a
:class:`~vllm_kvtier.jobs.WorkerReport` (no vLLM here). No failure raises into vLLM.

It is the per-step orchestrator: it calls its parts in vLLM's order and forwards.

- :class:`~.datapath.DataPath`: pool, copy engine, slot table, peer link and verifier,
  built once by :func:`~.datapath.build_datapath` in ``register_kv_caches``. This rank
  sizes its pool itself and tells the scheduler (:mod:`.datapath` says how). The tiers
  below CPU (``make_tiers``, the connector's wiring, ``engine/lower.py``) are opened at
  the first plan, only when the scheduler's namespace agrees with ours.
- :class:`~.namespace_gate.NamespaceGate`: opens the lower tiers at the first plan, and
  refuses their jobs while the scheduler's namespace is not ours.
- :class:`~.saves.Saves`, :class:`~.loads.Loads`, :class:`~.prefetches.Prefetches`:
  what is in flight, in small typed records. A finished lower-tier read is routed by
  ``(tier, read id)``: to the verifier, a prefetch or a load.

Per step, in vLLM's order:

1. ``begin_step(meta)`` is called from ``handle_preemptions``, or at the latest from
   ``start_load_kv``. It checks the plan's namespace and pool size (the first plan opens
   the lower tiers). It settles the host saves that finished and queues their lower-tier
   writes. Then it issues the **final saves** of finished requests whose blocks vLLM holds
   for them (``StepPlan.saves``). Saves come first so a load in the same step can read a
   block saved in it. A step that reads or writes pool slots on the host (loads,
   demotions, prefetches, verification) first waits for every save and settles it. So a
   failed save's slots are never used. Lower-tier writes of slots still being filled are
   held until their saves settle. With a peer link, a slot is stamped only once its copy
   is done. ``end_step`` (from ``wait_for_save``, after the forward) saves the blocks the
   forward completed. Then it fences those copies (``CopyEngine.fence``). On a host KV
   cache it waits for the copy thread. On CUDA the compute stream waits for the copy
   stream. Why: vLLM frees a block when its request finishes or is preempted, never
   waiting for our copies. And a runner may write a freed block before any hook of ours
   runs in the next step. vLLM's V2 runner zeroes new blocks and applies copy-on-write
   copies in ``update_requests``, before ``pre_forward``. So no save outlives the step
   that issued it, whatever the order of the runner's hooks. The final saves read held
   blocks, which vLLM frees only once ``transfer_results`` reported them (``take_sent``).
   ``begin_step`` still orders the saves of freed and preempted requests
   (``StepPlan.freed``, ``preempted``) before the forward; after the fence that costs
   nothing. A hybrid model's sliding-window blocks are saved inline (``wait_saves``).
2. ``start_loads()`` (from ``start_load_kv``): verify and issue **loads**. Sync loads are
   ordered before the model reads the KV cache; async loads complete later.
3. ``transfer_results(finished)`` (from ``get_transfer_results``): poll transfers; report
   async loads done (``finished_recving``) and, through ``take_sent``, the held requests
   whose final saves are done (``finished_sending``). Failed blocks go to
   ``take_load_errors`` no later than the pass that reports their request, so vLLM
   recomputes them.

A load fails (and its blocks are recomputed, never served) when the slot does not hold the
expected key, when its checksum does not match (``cpu.checksum``), when the copy raises, or
when fault injection says so.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.errors import run_all
from vllm_kvtier.jobs import ChunkRead, StepPlan, WorkerReport
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters
from vllm_kvtier.transfer.copier import CopyEngine
from vllm_kvtier.transfer.datapath import DataPath, build_datapath
from vllm_kvtier.transfer.layout import KVLayout, build_layout
from vllm_kvtier.transfer.loads import Loads
from vllm_kvtier.transfer.namespace_gate import NamespaceGate
from vllm_kvtier.transfer.prefetches import Prefetches
from vllm_kvtier.transfer.saves import Saves
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.thread_cpu import SAMPLER
from vllm_kvtier.transfer.tier_io import ChunkWorker

logger = logging.getLogger(__name__)

TIER = TierName.CPU


@dataclass(slots=True)
class _Step:
    """Where this rank is in vLLM's steps."""

    #: The last plan ``begin_step`` was given (vLLM may give the same step twice).
    plan: StepPlan | None = None
    #: The last step whose ``end_step`` ran.
    ended: int = -1
    #: This step's time in our calls so far (counted by ``transfer_results``).
    seconds: float = 0.0


_F = TypeVar("_F", bound=Callable[..., Any])


def _step_timed(fn: _F) -> _F:
    """Count the call's time into the step's total (``step_seconds``, see transfer_results)."""
    @functools.wraps(fn)
    def timed(self: WorkerHalf, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._step.seconds += time.perf_counter() - t0
    return cast(_F, timed)


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker half is built from, beside its config (the connector's wiring)."""

    #: vLLM's KV cache blocks per layer
    num_blocks: int
    #: The CPU pool's size, computed in ``register_kv_caches``, after vLLM allocated its
    #: KV cache.
    pool_slots: Callable[[], int]
    namespace: str = ""
    rank: int = 0
    #: ``make_tiers(cfg, namespace=, rank=, slots=, counters=, kv_dtype=)``: this rank's
    #: tiers below CPU by name. They are opened at the first plan when the scheduler's
    #: namespace agrees (None: none).
    make_tiers: Callable[..., dict[str, ChunkWorker]] | None = None
    #: vLLM's ``cache_dtype``. It says which fp8 format a ``uint8`` cache holds.
    cache_dtype: str = "auto"


class WorkerHalf:
    def __init__(self, cfg: KVTierConfig, setup: WorkerSetup) -> None:
        self.cfg = cfg
        self.setup = setup
        self.counters = Counters()
        #: opens the lower tiers at the first plan, only under the scheduler's namespace
        self._gate = NamespaceGate(setup.namespace, setup.rank, setup.make_tiers)
        #: built in ``register_kv_caches``
        self.path: DataPath | None = None
        self.saves = Saves(self.counters, checksum=cfg.cpu.checksum)
        self.loads = Loads(cfg, self.counters)
        self.prefetches = Prefetches()
        self._step = _Step()
        #: The report to the scheduler being built (``worker_meta`` hands it over).
        self._report = WorkerReport()

    @property
    def namespace(self) -> str:
        return self.setup.namespace

    @property
    def rank(self) -> int:
        return self.setup.rank

    @property
    def namespace_conflict(self) -> str:
        """The scheduler's namespace when it is not ours (then no lower tier is built, and
        every lower-tier job is refused); "" while they agree."""
        return self._gate.conflict

    # ---- the connector's switches, set once before the first step --------------------

    @property
    def request_level_failures(self) -> bool:
        """Report a failed async load per request (``take_failed_loads``), never by block.

        vLLM refuses block-level errors for a model with more than one KV cache group."""
        return self.loads.by_request

    @request_level_failures.setter
    def request_level_failures(self, on: bool) -> None:
        self.loads.by_request = on

    @property
    def wait_saves(self) -> bool:
        """Wait for each save's copy before the step ends.

        This is for hybrid models. vLLM frees a sliding-window group's blocks as the window
        passes, without waiting for us."""
        return self.saves.wait

    @wait_saves.setter
    def wait_saves(self, on: bool) -> None:
        self.saves.wait = on

    # ---- parts of the data path (None, or empty, until ``register_kv_caches``) ----------

    @property
    def layout(self) -> KVLayout | None:
        """This rank's KV cache tensors, seen as block rows (``register_kv_caches``)."""
        return self.path.layout if self.path is not None else None

    @property
    def engine(self) -> CopyEngine | None:
        return self.path.engine if self.path is not None else None

    @property
    def slots(self) -> SlotTable | None:
        """What each CPU slot holds and which device copy still uses it."""
        return self.path.slots if self.path is not None else None

    @property
    def lower(self) -> dict[str, ChunkWorker]:
        """The tiers below CPU, by name ("nvme", "s3")."""
        return self.path.lower if self.path is not None else {}

    # ---- setup -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """See the KV cache tensors, size the CPU pool, and build the data path on them.
        Raises :class:`~vllm_kvtier.errors.ConfigError` when ``cpu.capacity_bytes`` cannot
        fit in this process's memory (the engine then stops at start-up, not at a request)."""
        setup = self.setup
        layout = build_layout(kv_caches, setup.num_blocks)
        logger.info("kvtier: KV layout %s, %d B per block", layout.description, layout.block_bytes)
        if layout.shared and self.cfg.layer_pipelined_loads != "off":
            logger.info("kvtier: layers share KV tensors (hybrid KV cache groups): layer-by-layer loads off")
        self.path = build_datapath(self.cfg, layout, setup.pool_slots(), namespace=setup.namespace, rank=setup.rank,
                                   counters=self.counters, cache_dtype=setup.cache_dtype)
        if self.path.peer_info is not None:  # published once, so that the scheduler can reach this rank
            self._report.peer_info[self.rank] = self.path.peer_info

    @property
    def num_slots(self) -> int:
        """The CPU pool's size (0 before ``register_kv_caches``): sent to the scheduler once."""
        return self.path.pool.num_slots if self.path is not None else 0

    # ---- per step ----------------------------------------------------------------

    @_step_timed
    def begin_step(self, meta: StepPlan) -> None:
        """Issue this step's saves. Idempotent per step (vLLM may call us twice)."""
        begun = self._step.plan
        self._step.plan = meta
        if begun is not None and meta.step == begun.step:
            return
        self._finish_layered_loads()
        path = self.path
        if path is None:
            raise RuntimeError("kvtier: a step began before register_kv_caches")
        self._gate.check(meta.namespace)
        path.check_size(meta.num_slots)
        self._gate.open_once(path, self.cfg, self.counters)
        self._gate.refuse(meta, self._report, self.counters)
        # The last forward's saves were fenced when it ended (the module's docstring); a
        # step that uses pool slots on the host also settles them all.
        touches_slots = bool(meta.loads or meta.demotes or meta.verifies or meta.prefetches)
        self.saves.settle(path, wait_before=math.inf if touches_slots else self._step.ended)
        # Demoted slots are copied out before this step's saves reuse them.
        for name, tier in path.lower.items():
            tier.write([j for j in meta.demotes if j.tier == name], copy_now=True)
            tier.delete([fid for t, fid in meta.deletes if t == name])
            tier.forget([fid for t, fid in meta.forgets if t == name])
        self.saves.run_final(path, meta.saves, step=self._step.ended)
        self.saves.order_before_compute(path, meta.preempted + meta.freed)
        for pf in meta.prefetches:
            self.prefetches.start(pf, path.lower, self._report)
        if path.verifier is not None:
            for vj in meta.verifies:
                path.verifier.start(vj, path.lower)

    @_step_timed
    def end_step(self) -> None:
        """After the forward (from ``wait_for_save``): save the blocks this step completed,
        then write-through to the lower tiers. Idempotent per step."""
        meta, path = self._step.plan, self.path
        if meta is None or meta.step == self._step.ended or path is None:
            return
        self._step.ended = meta.step
        self._finish_layered_loads()
        self.saves.run(path, meta.saves_after, step=self._step.ended, background=True)
        if meta.saves_after:
            # vLLM may give these blocks to another request before our next call: a finish
            # or a preemption frees them, and a runner may zero or copy into new blocks
            # before any hook of ours (vLLM's V2 runner does). Our copies come first.
            path.engine.fence()
        if path.verifier is not None and meta.verifies:
            path.verifier.capture(meta.verifies)  # the forward computed their blocks
        for name, tier in path.lower.items():
            for job in meta.saves + meta.saves_after:
                tier.clean(job.slots)
            tier.mark_dirty(meta.persist_slots.get(cast(TierName, name), ()))
            self.saves.write_after(path, meta.step, name, [j for j in meta.write_through if j.tier == name])

    @_step_timed
    def start_loads(self) -> None:
        """Verify and issue this step's loads (from ``start_load_kv``). Sync loads are
        ordered before the model reads the KV cache."""
        meta = self._step.plan
        if meta is None or not meta.loads:
            return
        assert self.path is not None
        for job in meta.loads:
            self.loads.start(self.path, job)

    def wait_for_layer(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention (``wait_for_layer_load``): its rows are in place."""
        if self.path is not None:
            self._step.seconds += self.loads.wait_for_layer(self.path, layer_name)

    def _finish_layered_loads(self) -> None:
        """Layers the forward did not ask for (or no forward ran): wait for them now. The
        callers are step-timed, so their timer counts this wait (not added again here)."""
        names = self.loads.unwaited_layers()
        if names:
            self.counters.add(CounterName.LAYER_LOADS_UNWAITED, TIER, len(names))
        if self.path is not None:
            for name in names:
                self.loads.wait_for_layer(self.path, name)

    def transfer_results(self, finished_req_ids: set[str], *, idle_step: bool = False) -> set[str]:
        """Return the requests whose async loads ended (``finished_recving``).

        ``idle_step``: this step ran no forward (vLLM only waits for transfers). Then we
        wait up to 2 ms for lower-tier reads instead of returning at once. So the engine's
        busy loop does not starve the I/O threads of the GIL.

        This is the step's last connector call. It counts the time this rank's calls took
        in a step that ran a forward (``step_seconds``, ``step_calls``). Idle steps delay
        no token."""
        t0 = time.perf_counter()
        try:
            return self._transfer_results(idle_step)
        finally:
            if not idle_step:
                self.counters.add(CounterName.STEP_SECONDS, TIER, self._step.seconds + time.perf_counter() - t0)
                self.counters.add(CounterName.STEP_CALLS, TIER, 1)
            self._step.seconds = 0.0

    def _transfer_results(self, idle_step: bool) -> set[str]:
        path = self.path
        if path is None:
            return set()
        self.saves.settle(path)
        for tier in path.lower.values():
            if idle_step and tier.pending_reads():
                tier.wait_for_reads(0.002)
                idle_step = False  # one wait per step
            for rid, read, ok in tier.poll():
                self._on_read(path, rid, read, ok, tier.took(rid))
        if path.peer is not None:
            self._poll_peer(path)
        recving = self.loads.poll(path)
        self.saves.forget_done()
        return recving

    def _on_read(self, path: DataPath, rid: int, read: ChunkRead, ok: bool, seconds: float = 0.0) -> None:
        """A lower-tier read ended: record what its slots hold.

        Then route it by ``(tier, read id)`` to the verifier, a prefetch or a load."""
        if ok:
            for s, k in zip(read.slots, read.keys, strict=True):
                path.slots.set_key(s, k)
                if self.cfg.cpu.checksum:
                    path.slots.record_crc(s)
        if path.verifier is not None and path.verifier.on_read(read.tier, rid, read, ok):
            return
        ref = (read.tier, rid)
        if not self.prefetches.on_read(ref, ok, self._report):
            self.loads.on_read(ref, read, ok, seconds)

    def _poll_peer(self, path: DataPath) -> None:
        assert path.peer is not None
        self.saves.stamp_finished(path.slots)
        self._report.peer_done |= path.peer.done_requests()
        for prid, res in path.peer.poll():
            for s, k in zip(res.read.slots, res.read.keys, strict=True):
                # the peer link filled and stamped them itself
                path.slots.set_key(s, k if k in res.good else None, "unchanged")
            self.loads.on_peer_read(prid, res)

    def worker_meta(self) -> WorkerReport | None:
        """What this rank tells the scheduler since the last call (None: nothing)."""
        meta, self._report = self._report, WorkerReport()
        meta.load_read_seconds = self.loads.take_read_seconds()
        for tier in self.lower.values():
            tier.take_meta(meta)
        if self.path is not None and self.path.verifier is not None:
            self.path.verifier.take_report(meta)
        return None if meta.is_empty() else meta

    def take_sent(self) -> set[str]:
        """Finished requests whose final saves are done (``finished_sending``): vLLM held
        their blocks for them and frees them now. Never waits."""
        return self.saves.take_sent()

    def take_failed_loads(self) -> set[str]:
        """Requests whose async load failed (``request_level_failures`` only); each is also
        reported in ``finished_recving``, in this pass or an earlier one."""
        return self.loads.take_failed()

    def take_load_errors(self) -> set[int]:
        return self.loads.take_errors()

    def stats(self) -> dict[str, dict[str, float]] | None:
        """This rank's counters since the last call.

        They include the CPU time of the plugin's threads in this process. That is sampled
        at most once a second (:mod:`.thread_cpu`)."""
        if self.path is not None:
            SAMPLER.sample(self.counters)
        return self.counters.drain()

    def shutdown(self) -> None:
        """Every step runs even when one fails; the first failure is raised at the end.

        A tier that cannot close must not keep the others' threads alive."""
        path = self.path
        steps: list[Callable[[], None]] = []
        if path is not None:
            steps.append(path.engine.shutdown)  # the copy thread's saves finish first
            steps.append(lambda: self.saves.settle(path, wait_before=math.inf))  # then the writes they held back
        steps.append(self.saves.log_unwritten)
        steps.extend(tier.close for tier in self.lower.values())
        if path is not None and path.peer is not None:
            steps.append(path.peer.close)
        try:
            run_all(steps)  # (the settling step writes through path.lower)
        finally:
            if path is not None:
                path.lower, path.peer = {}, None
