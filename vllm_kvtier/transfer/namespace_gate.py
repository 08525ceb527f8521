"""The gate of a worker's lower tiers: they open only under the scheduler's namespace.

Who calls it: :class:`~vllm_kvtier.transfer.worker.WorkerHalf`, from the worker's main
thread, at each ``begin_step``. The scheduler sends its namespace in every plan. The two
processes compute it apart: the scheduler cannot see this worker's tensors or
environment. If they differ, the scheduler's index and this worker's stored headers would
name different things. Either one may be wrong. So no lower tier is opened, and every
lower-tier job is refused and counted. Nothing here raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.jobs import StepPlan, WorkerReport
from vllm_kvtier.metrics import CounterName, Counters
from vllm_kvtier.transfer.datapath import DataPath, open_lower

logger = logging.getLogger(__name__)


class NamespaceGate:
    def __init__(self, namespace: str, rank: int, make_tiers: Callable[..., dict[str, Any]] | None) -> None:
        """``namespace``: this rank's. ``make_tiers``: opens the lower tiers at the first
        plan (see :func:`~vllm_kvtier.transfer.datapath.open_lower`; None: none)."""
        self.namespace = namespace
        self.rank = rank
        #: None once used (or none given)
        self._make_tiers = make_tiers
        #: The scheduler's namespace when it is not ours; "" while they agree.
        self.conflict = ""

    def check(self, theirs: str) -> None:
        """Compare the scheduler's namespace (sent in every plan) with ours, before the
        lower tiers open. A conflict is logged once, and kept."""
        if not theirs or theirs == self.namespace or self.conflict:
            return
        self.conflict = theirs
        logger.error("kvtier: rank %d computed namespace %s but the scheduler computed %s (model files, config or "
                     "KV layout seen differently by the two processes): this rank refuses every NVMe/S3/pool read "
                     "and write (blocks recomputed, nothing stored); the scheduler's and this worker's namespace "
                     "log lines show the inputs", self.rank, self.namespace, theirs)

    def open_once(self, path: DataPath, cfg: KVTierConfig, counters: Counters) -> None:
        """At the first plan: open the lower tiers on ``path``, unless in conflict."""
        if self._make_tiers is None:
            return
        make, self._make_tiers = self._make_tiers, None
        if not self.conflict:
            open_lower(path, cfg, make, namespace=self.namespace, rank=self.rank, counters=counters)

    def refuse(self, meta: StepPlan, report: WorkerReport, counters: Counters) -> None:
        """Under a conflict: the step's lower-tier writes are reported failed.

        Each write and read is counted. The scheduler drops those chunks; its breaker
        pauses the tier. The reads fail on their own: no such tier here."""
        if not self.conflict:
            return
        for job in meta.demotes + meta.write_through:
            report.failed.add((job.tier, job.chunk_id))
            counters.add(CounterName.NAMESPACE_MISMATCH, job.tier)
        for read in [r for load in meta.loads for r in load.reads] + [r for pf in meta.prefetches for r in pf.reads]:
            counters.add(CounterName.NAMESPACE_MISMATCH, read.tier)
