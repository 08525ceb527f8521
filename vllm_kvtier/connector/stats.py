"""vLLM's stats plumbing for our counters: ``KVConnectorStats`` and Prometheus metrics.

Workers and the scheduler each return a :class:`KVTierStats` every step; vLLM aggregates
them and ships ``to_dict()`` to the API-server (or ``LLM``) process, where
:class:`KVTierPromMetrics` turns them into ``vllm:kvtier_*`` metrics on vLLM's own
registry (multiprocess-safe metric classes are passed in by vLLM).
"""

from __future__ import annotations

from typing import Any, cast

from prometheus_client import Counter, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_kvtier.metrics import COUNTERS, GAUGES, split_key


class KVTierStats(KVConnectorStats):
    """``data = {"counters": {key: delta}, "gauges": {key: value}}``."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=data or {"counters": {}, "gauges": {}})
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        c = self.data["counters"]
        for k, v in other.data.get("counters", {}).items():
            c[k] = c.get(k, 0) + v
        self.data["gauges"].update(other.data.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data["counters"].items()):
            out[k.replace("|", "_")] = round(v, 6)
        for k, v in sorted(self.data["gauges"].items()):
            out[k.replace("|", "_")] = v
        return out

    def is_empty(self) -> bool:
        return not self.data["counters"] and not self.data["gauges"]


class KVTierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = list(labelnames) + ["tier"]
        counter_cls = cast(type[Counter], self._counter_cls)
        gauge_cls = cast(type[Gauge], self._gauge_cls)
        self._counters = {
            m: counter_cls(name=f"vllm:kvtier_{m}", documentation=doc, labelnames=names)
            for m, doc in COUNTERS.items()
        }
        self._gauges = {
            m: gauge_cls(
                name=f"vllm:kvtier_{m}", documentation=doc, labelnames=names,
                multiprocess_mode="mostrecent",
            )
            for m, doc in GAUGES.items()
        }

    def _labels(self, engine_idx: int, tier: str) -> list[object]:
        return list(self.per_engine_labelvalues.get(engine_idx, [])) + [tier]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.get("counters", {}).items():
            metric, tier = split_key(key)
            if metric in self._counters and value > 0:
                self._counters[metric].labels(*self._labels(engine_idx, tier)).inc(value)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            metric, tier = split_key(key)
            if metric in self._gauges:
                self._gauges[metric].labels(*self._labels(engine_idx, tier)).set(value)
