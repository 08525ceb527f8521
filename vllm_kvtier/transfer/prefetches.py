"""Prefetches: chunks read from a lower tier into their CPU slots ahead of any load.

Who calls it: :class:`~vllm_kvtier.transfer.worker.WorkerHalf`, from the worker's main
thread (``begin_step`` starts them, ``transfer_results`` routes the reads' completions).
The reads run on the tiers' threads. Nothing here blocks or raises into vLLM: a read that
cannot start, or fails, fails its prefetch. The outcome goes to the scheduler in the
:class:`~vllm_kvtier.jobs.WorkerReport` being built (``prefetched``: this rank read every
chunk; ``prefetch_failed``: some read failed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vllm_kvtier.jobs import PrefetchJob, WorkerReport
from vllm_kvtier.transfer.tier_io import ChunkWorker

#: A lower-tier read: (tier name, the read id that tier gave).
ReadRef = tuple[str, int]


@dataclass(slots=True)
class _Prefetch:
    """A prefetch whose reads are not all done."""

    reads_left: int = 0
    any_failed: bool = False


class Prefetches:
    def __init__(self) -> None:
        #: (tier, read id) -> the prefetch that read is for
        self._by_read: dict[ReadRef, int] = {}
        #: prefetch id -> its reads left
        self._open: dict[int, _Prefetch] = {}

    def start(self, job: PrefetchJob, lower: Mapping[str, ChunkWorker], report: WorkerReport) -> None:
        """Start the reads of ``job``. A prefetch with no read started ends at once."""
        p = _Prefetch()
        for read in job.reads:
            tier = lower.get(read.tier)
            rid = tier.start_read(read, prefetch=True) if tier is not None else None
            if rid is None:
                p.any_failed = True
            else:
                self._by_read[(read.tier, rid)] = job.prefetch_id
                p.reads_left += 1
        self._open[job.prefetch_id] = p
        if p.reads_left == 0:
            self._end(job.prefetch_id, report)

    def on_read(self, ref: ReadRef, ok: bool, report: WorkerReport) -> bool:
        """A lower-tier read ended. Returns whether it was one of a prefetch's."""
        pid = self._by_read.pop(ref, None)
        if pid is None:
            return False
        p = self._open[pid]
        p.reads_left -= 1
        p.any_failed = p.any_failed or not ok
        if p.reads_left == 0:
            self._end(pid, report)
        return True

    def _end(self, pid: int, report: WorkerReport) -> None:
        if self._open.pop(pid).any_failed:
            report.prefetch_failed.add(pid)
        else:
            report.prefetched[pid] = 1
