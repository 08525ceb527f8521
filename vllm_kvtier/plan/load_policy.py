"""Load-or-recompute at the scheduler.

It makes decisions per request. It takes the samples that keep the estimates of
:class:`~vllm_kvtier.index.cost.CostModel` current.

Who calls it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`, from vLLM's
scheduler thread. Nothing blocks.

Samples: a load's time is measured per request (``observe_load``): its slowest lower-tier
read, from issue to done on the tier's I/O threads, as the workers timed it (queueing
behind other reads included). Not the request's whole wait: vLLM starts an async load
after a step's forward and hears it is done after a later step's, so the wait holds
engine steps, seconds each on a CPU engine. Where no read time comes, the wait is used.
The prefill rate is timed here. It is the prompt tokens a
step scheduled over the time until the next step is scheduled. An idle gap between steps
would look like a slow prefill. So one sample may lower the estimate by at most half.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm_kvtier.index.cost import CostModel, Decision
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters, GaugeName

logger = logging.getLogger(__name__)

_MIN_PREFILL_SAMPLE_TOKENS = 32


class LoadPolicy:
    def __init__(self, cost: CostModel, counters: Counters, *, block_bytes: int, block_size: int,
                 lower_tiers: list[str], measure_prefill: bool = True) -> None:
        """``block_bytes``: of one block on one rank (what one worker reads).
        ``measure_prefill``: False keeps ``cost.prefill_tokens_per_s`` as given."""
        self.cost = cost
        self.measure_prefill = measure_prefill
        self.counters = counters
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.lower_tiers = lower_tiers
        self._pending: dict[str, Decision] = {}
        self._last_step: tuple[float, int] | None = None

    def decide(self, req_id: str, block_tiers: list[str]) -> int:
        """How many blocks of the matched run to load (the rest is recomputed)."""
        if all(t == TierName.CPU for t in block_tiers):
            self._pending.pop(req_id, None)
            return len(block_tiers)
        now = time.monotonic()
        # A probe granted to a request that vLLM then did not admit (no KV space, or a
        # shorter request went first) stays with it: the tier was marked fresh when the
        # probe was granted, so no other request would probe it until the next interval.
        prev = self._pending.get(req_id)
        d = self.cost.decide(block_tiers, self.block_bytes, self.block_size, now,
                             reprobe=prev is not None and prev.probe)
        self._pending[req_id] = d
        if d.changed:  # once per change of a tier's verdict, with the inputs behind it
            for t in d.changed:
                est = self.cost.tier(t)
                logger.info(
                    "kvtier: load or recompute: %s now %s (estimate %.1f ms + %.0f MB/s from %d loads; "
                    "prefill %.0f tokens/s; this request: load %.3f s vs recompute %.3f s, %d of %d blocks loaded)",
                    t, "recomputes" if t in d.recomputed else "loads", est.latency_s * 1e3,
                    est.bandwidth_Bps / 1e6, est.samples, self.cost.prefill_tokens_per_s, d.load_s,
                    d.recompute_s, d.load_blocks, len(block_tiers))
        return d.load_blocks

    def observe_load(self, tier: str, blocks: int, seconds: float) -> None:
        """A request's async load of ``blocks`` blocks, the slowest from ``tier``, took
        ``seconds`` until done."""
        if tier in self.lower_tiers and blocks > 0:
            self.cost.observe_load(tier, blocks * self.block_bytes, seconds, time.monotonic())

    def commit(self, req_id: str) -> None:
        """The request was admitted with the last decision: count it."""
        d = self._pending.pop(req_id, None)
        if d is None:
            return
        for tier, n in d.recomputed.items():
            self.counters.add(CounterName.RECOMPUTE_CHOSEN_BLOCKS, tier, n)
        if d.probe:
            self.counters.add(CounterName.LOAD_PROBES, TierName.ALL)

    def forget(self, req_id: str) -> None:
        """The request ended (it may have been looked up and never admitted)."""
        self._pending.pop(req_id, None)

    # ---- samples -----------------------------------------------------------------------

    def observe_step(self, prefill_tokens: int) -> None:
        """Called once per scheduled step with the prompt tokens it computes."""
        now = time.monotonic()
        if self._last_step is not None and self.measure_prefill:
            t0, tokens = self._last_step
            if tokens >= _MIN_PREFILL_SAMPLE_TOKENS:
                rate = tokens / max(now - t0, 1e-6)
                self.cost.observe_prefill(tokens, tokens / max(rate, 0.5 * self.cost.prefill_tokens_per_s))
        self._last_step = (now, prefill_tokens)
        estimate = self.cost.prefill_tokens_per_s
        self.counters.set_gauge(GaugeName.ESTIMATED_PREFILL_TOKENS_PER_SECOND, "compute", estimate)

    def observe_stats(self, stats: Any) -> None:
        """Worker counters of one step (``KVTierStats.data``), summed over ranks."""
        for tier in self.lower_tiers:
            est = self.cost.tier(tier)
            self.counters.set_gauge(GaugeName.ESTIMATED_BANDWIDTH_BYTES_PER_SECOND, tier, est.bandwidth_Bps)
            self.counters.set_gauge(GaugeName.ESTIMATED_LATENCY_SECONDS, tier, est.latency_s)
