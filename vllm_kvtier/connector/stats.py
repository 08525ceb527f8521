"""vLLM's stats plumbing for our counters: ``KVConnectorStats`` and Prometheus metrics.

Workers and the scheduler each return a :class:`KVTierStats` every step. vLLM aggregates
them and ships ``to_dict()`` to the API-server (or ``LLM``) process. There
:class:`KVTierPromMetrics` turns them into ``vllm:kvtier_*`` metrics on vLLM's own
registry. vLLM passes in multiprocess-safe metric classes.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_kvtier.config import parse_config
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.exporter import PromMetrics
from vllm_kvtier.keys import TierName
from vllm_kvtier.tiers.registry import metric_tiers

_SECTIONS = ("counters", "gauges", "histograms")


class KVTierStats(KVConnectorStats):
    """``data = {"counters": {key: delta}, "gauges": {key: value}, "histograms": {key: [value, ...]}}``
    (keys ``"<metric>|<tier>"``, :mod:`vllm_kvtier.metrics`). Aggregating sums counters,
    keeps the latest gauges and concatenates histogram observations."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=data if data is not None else {})
        for section in _SECTIONS:
            self.data.setdefault(section, {})

    def reset(self) -> None:
        self.data = {section: {} for section in _SECTIONS}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        c = self.data["counters"]
        for k, v in other.data.get("counters", {}).items():
            c[k] = c.get(k, 0) + v
        self.data["gauges"].update(other.data.get("gauges", {}))
        h = self.data["histograms"]
        for k, values in other.data.get("histograms", {}).items():
            h[k] = [*h.get(k, ()), *values]  # new lists: other's data is never modified
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data["counters"].items()):
            out[k.replace("|", "_")] = round(v, 6)
        for k, v in sorted(self.data["gauges"].items()):
            out[k.replace("|", "_")] = v
        for k, values in sorted(self.data["histograms"].items()):
            name = k.replace("|", "_")
            out[f"{name}_count"] = len(values)
            out[f"{name}_sum"] = round(sum(values), 6)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[section] for section in _SECTIONS)


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Built once by vLLM's Prometheus stat logger (``build_prom_metrics``), before any
    request: every counter of the configured tiers is exported at 0 from then on. ``observe``
    is called from its thread with each step's aggregated ``KVTierStats.data``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = PromMetrics(
            prefix="vllm:kvtier_", labelnames=list(labelnames), counter_cls=self._counter_cls,
            gauge_cls=self._gauge_cls, histogram_cls=self._histogram_cls,
        )
        try:  # the connector itself refuses a bad config, with the field named
            tiers = metric_tiers(parse_config(vllm_config.kv_transfer_config.kv_connector_extra_config))
        except (ConfigError, AttributeError):
            tiers = [str(TierName.CPU)]
        for labelvalues in self.per_engine_labelvalues.values():
            self._metrics.zero(tiers, list(labelvalues))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._metrics.observe(transfer_stats_data, list(self.per_engine_labelvalues.get(engine_idx, [])))
