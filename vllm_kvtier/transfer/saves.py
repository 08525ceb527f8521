"""Saves: engine blocks copied into CPU slots, tracked until their copies are done.

Who calls it: :class:`~vllm_kvtier.transfer.worker.WorkerHalf`, from the worker's main
thread, in vLLM's call order; the copies themselves may run on the copy engine's thread.
Every method takes the :class:`~.datapath.DataPath` it works on. No method raises into
vLLM: a save that fails is logged, counted (``store_failures``) and its slots hold nothing
(a future miss). Only :meth:`Saves.settle` with a finite bound, and shutdown, may wait.

What it tracks, and why:

- **Host saves** (:class:`HostSave`): copies on the copy thread, with the step that issued
  them. They are settled (a failed one's slots emptied) before any step uses pool slots on
  the host, so a failed save's slots are never read.
- **Held writes** (:class:`HeldWrite`): lower-tier writes of slots those saves fill. They
  copy the slots' bytes out, so they are queued only once every save issued up to their
  step is settled, in the order they were held.
- **Unstamped saves** (:class:`Unstamped`): with a peer link, a slot gets its stamp only
  once its copy is done, so a peer never reads half a block.
- **Final saves** of finished requests: vLLM holds their blocks until :meth:`Saves.take_sent`
  reports the copies done (``finished_sending``).
- **In-flight saves per request**: when vLLM frees or preempts a request, its copies are
  ordered before the next forward. The worker's fence after each step's saves has ordered
  them already (:mod:`vllm_kvtier.transfer.worker`); this is the second line.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

from vllm_kvtier.errors import run_all
from vllm_kvtier.jobs import ChunkWriteJob, SaveJob
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters
from vllm_kvtier.transfer.copier import Transfer, _HostSave
from vllm_kvtier.transfer.datapath import DataPath
from vllm_kvtier.transfer.slots import SlotTable

logger = logging.getLogger(__name__)

TIER = TierName.CPU


@dataclass(frozen=True, slots=True)
class HostSave:
    """A save on the copy thread, not settled yet."""

    transfer: Transfer
    job: SaveJob
    #: The last step whose forward had ended when it was issued.
    step: int


@dataclass(frozen=True, slots=True)
class HeldWrite:
    """Lower-tier writes held back until the saves issued up to ``step`` are settled."""

    step: int
    tier: str
    jobs: list[ChunkWriteJob]


@dataclass(frozen=True, slots=True)
class Unstamped:
    """A save whose slots get their peer stamp once its copy is done."""

    transfer: Transfer
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]


class Saves:
    def __init__(self, counters: Counters, *, checksum: bool) -> None:
        """``checksum``: record each saved slot's CRC (``cpu.checksum``); the save is then
        waited for at once."""
        self.counters = counters
        self.checksum = checksum
        #: Wait for each save's copy before the step ends (hybrid models: vLLM frees a
        #: sliding-window group's blocks as the window passes, without waiting for us).
        self.wait = False
        self._host: list[HostSave] = []
        self._held: list[HeldWrite] = []
        self._unstamped: list[Unstamped] = []
        self._by_request: dict[str, list[Transfer]] = {}
        #: Finished requests whose blocks vLLM holds until their final saves are done.
        self._sending: dict[str, list[Transfer]] = {}

    def in_flight(self) -> list[HostSave]:
        """The host saves not settled yet, oldest first."""
        return list(self._host)

    def held_writes(self) -> list[HeldWrite]:
        """The lower-tier writes held back behind them, in the order they were held."""
        return list(self._held)

    def run(self, path: DataPath, jobs: list[SaveJob], *, step: int,
            background: bool = False) -> list[tuple[str, Transfer]]:
        """Issue ``jobs``; return each issued copy with its request.

        ``step``: the last step whose forward ended. ``background``: the copy may run on
        the engine's copy thread (host KV cache). Its slots stay busy until :meth:`settle`
        has seen it done."""
        slots = path.slots
        issued: list[tuple[str, Transfer]] = []
        for job in jobs:
            # before the first byte changes: a peer may be reading them, a lower-tier copy out may run
            slots.claim(job.slots)
            try:
                t = path.engine.submit("save", list(job.block_ids), list(job.slots), background=background)
                if self.wait:
                    t.wait()
                if isinstance(t, _HostSave):
                    self._host.append(HostSave(t, job, step))
            except Exception:  # a failed save is a future miss, never a failed step
                logger.exception("kvtier: save of %d blocks failed", len(job.block_ids))
                for s in job.slots:
                    slots.set_key(s, None)
                continue
            # A peer may read these slots: stamp them only once their bytes are complete.
            done = t.done()
            for s, k in zip(job.slots, job.keys, strict=True):
                slots.set_key(s, k, "now" if done else "later")
            if not done and path.peer is not None:
                self._unstamped.append(Unstamped(t, job.slots, job.keys))
            self._by_request.setdefault(job.req_id, []).append(t)
            issued.append((job.req_id, t))
            slots.mark_busy(job.slots, t)
            self.counters.add(CounterName.BLOCKS_STORED, TIER, len(job.block_ids))
            self.counters.add(CounterName.BYTES_STORED, TIER, t.nbytes)
            if self.checksum:
                t.wait()
                for s in job.slots:
                    slots.record_crc(s)
        return issued

    def run_final(self, path: DataPath, jobs: list[SaveJob], *, step: int) -> None:
        """Issue the saves of finished requests whose blocks vLLM holds for them. Each
        request is reported by :meth:`take_sent` once all its copies are done (or failed)."""
        for job in jobs:
            self._sending.setdefault(job.req_id, [])
        for req_id, t in self.run(path, jobs, step=step):
            self._sending[req_id].append(t)

    def take_sent(self) -> set[str]:
        """The held requests whose final saves are done: vLLM may free their blocks now
        (``finished_sending``). Never waits."""
        sent = {r for r, ts in self._sending.items() if all(t.done() for t in ts)}
        for r in sent:
            del self._sending[r]
        return sent

    def order_before_compute(self, path: DataPath, req_ids: list[str]) -> None:
        """``req_ids`` were freed or preempted: their blocks went back to vLLM's pool. This
        step's forward must not overwrite them before our copies out of them complete."""
        for req_id in req_ids:
            for t in self._by_request.pop(req_id, []):
                path.engine.order_before_compute(t)

    def write_after(self, path: DataPath, step: int, tier: str, jobs: list[ChunkWriteJob]) -> None:
        """Write ``jobs`` to ``tier`` now, or hold them while host saves are in flight.

        Those saves copy slots still being filled. The writes go once they are done."""
        if self._host:
            self._held.append(HeldWrite(step, tier, jobs))
        else:
            path.lower[tier].write(jobs)

    def settle(self, path: DataPath, *, wait_before: float = -math.inf) -> None:
        """Account the host saves that finished.

        It first waits for those issued by a step before ``wait_before`` (``math.inf``: all
        of them). A failed one's slots hold nothing (a future miss). Then it queues the held
        writes whose saves are all settled, in the order they were held. Every tier's
        writes are queued even when another tier's raise. The first failure is raised at
        the end."""
        if self._host:
            for h in self._host:
                if h.step < wait_before:
                    h.transfer.wait()  # the copy thread runs them in order: mostly one real wait
            left = []
            for h in self._host:
                if not h.transfer.done():
                    left.append(h)
                    continue
                error = getattr(h.transfer, "error", None)
                if error is not None:
                    self._fail(path.slots, h.job, error)
            self._host = left
        if self._held:
            oldest = min((h.step for h in self._host), default=math.inf)
            ready = 0
            while ready < len(self._held) and self._held[ready].step < oldest:
                ready += 1
            writes, self._held = self._held[:ready], self._held[ready:]
            run_all(functools.partial(path.lower[w.tier].write, w.jobs) for w in writes)

    def _fail(self, slots: SlotTable, job: SaveJob, error: BaseException) -> None:
        logger.error("kvtier: save of %d blocks failed: %r", len(job.block_ids), error)
        self.counters.add(CounterName.STORE_FAILURES, TIER, len(job.block_ids))
        for s, k in zip(job.slots, job.keys, strict=True):
            if slots.holds(s, k):  # not saved over since by a later save
                slots.set_key(s, None)

    def stamp_finished(self, slots: SlotTable) -> None:
        """Stamp the slots of the saves whose copies are done (peer link only). A failed
        one was settled as failed: its slots hold nothing, so nothing is stamped."""
        left = []
        for u in self._unstamped:
            if not u.transfer.done():
                left.append(u)
                continue
            if getattr(u.transfer, "error", None) is not None:
                continue
            for s, k in zip(u.slots, u.keys, strict=True):
                if slots.holds(s, k):
                    slots.stamp(s)
        self._unstamped = left

    def forget_done(self) -> None:
        """Drop the finished copies from the per-request lists (each step)."""
        for req_id, transfers in list(self._by_request.items()):
            transfers[:] = [t for t in transfers if not t.done()]
            if not transfers:
                del self._by_request[req_id]

    def log_unwritten(self) -> None:
        """At shutdown, after the settling: count the writes still held back.

        Their saves never finished: the copy engine failed to shut down. They are lost, as
        a cache loses them. Say how many."""
        if self._held or self._host:
            n = sum(len(j.keys) for w in self._held for j in w.jobs)
            logger.error("kvtier: shutdown: %d host save(s) unfinished; %d block(s) not written to the tiers "
                         "below DRAM", len(self._host), n)
