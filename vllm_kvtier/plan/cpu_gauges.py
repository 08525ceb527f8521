"""The CPU tier's numbers, published once a step.

Who calls it: :meth:`~vllm_kvtier.plan.scheduler.SchedulerPlanner.plan_step`, from vLLM's
scheduler thread only. It reads the slot index and sets plain counters.
"""

from __future__ import annotations

from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters, GaugeName

TIER = TierName.CPU


class CpuGauges:
    """Publishes the CPU tier's evictions and pin refusals since the last step, and its
    pinned blocks, usage and capacity. Owns the totals already published."""

    def __init__(self, index: SlotIndex, counters: Counters, *, slot_bytes_total: int) -> None:
        """``slot_bytes_total``: bytes of one block over all TP ranks."""
        self.index = index
        self.counters = counters
        self.slot_bytes_total = slot_bytes_total
        self._evictions = 0
        self._pin_refusals = 0

    def publish(self) -> None:
        index = self.index
        self.counters.add(CounterName.EVICTIONS, TIER, index.evictions - self._evictions)
        self._evictions = index.evictions
        self.counters.add(CounterName.PIN_REFUSALS, TIER, index.pin_refusals - self._pin_refusals)
        self._pin_refusals = index.pin_refusals
        self.counters.set_gauge(GaugeName.PINNED_BLOCKS, TIER, index.pinned_keys)
        self.counters.set_gauge(GaugeName.USAGE_BYTES, TIER, len(index) * self.slot_bytes_total)
        self.counters.set_gauge(GaugeName.CAPACITY_BYTES, TIER, index.num_slots * self.slot_bytes_total)
