"""Prometheus metrics from the plugin's stats, on vLLM's ``/metrics`` or on a port of their own.

The :class:`PromMetrics` makes one Prometheus metric per member of
:mod:`vllm_kvtier.metrics`' ``CounterName``, ``GaugeName`` and ``HistogramName``. It feeds
them from a stats data dict. That dict is ``KVTierStats.data``: counter deltas, last gauge
values, histogram observations. vLLM's stat logger uses it through
:class:`~vllm_kvtier.connector.stats.KVTierPromMetrics`, with vLLM's metric classes and
names ``vllm:kvtier_...``.

The :class:`StandaloneExporter` is for setups whose metrics do not go through vLLM's
``/metrics`` (offline ``LLM`` use, tools). It serves the same metrics on a registry the
caller passes in (never the process-global one), with prometheus_client's HTTP server. Its
names have no ``vllm:`` prefix (``kvtier_blocks_loaded_total``, ``kvtier_usage_bytes``,
``kvtier_request_load_wait_seconds_bucket``). They are not vLLM's metrics. So a Prometheus
scraping both endpoints sees no clash. This module never imports vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from vllm_kvtier.metrics import CounterName, GaugeName, HistogramName, split_key

#: Name prefix of the standalone exporter's metrics.
STANDALONE_PREFIX = "kvtier_"


class PromMetrics:
    """Every declared metric as a Prometheus metric, labelled ``labelnames`` + ``tier``.

    ``counter_cls``/``gauge_cls``/``histogram_cls``: prometheus_client's classes or
    vLLM's replacements (multiprocess-safe, Ray). ``registry``: passed to each metric when
    given; ``None`` leaves the classes' own default (vLLM's classes register where vLLM
    serves them). Metric objects are thread-safe; :meth:`observe` may be called from any
    thread and does not block on I/O.
    """

    def __init__(
        self, *, prefix: str, labelnames: Sequence[str] = (), registry: CollectorRegistry | None = None,
        counter_cls: Any = Counter, gauge_cls: Any = Gauge, histogram_cls: Any = Histogram,
    ) -> None:
        names = [*labelnames, "tier"]
        reg: dict[str, Any] = {} if registry is None else {"registry": registry}
        # keyed by member: a member equals its name, so the sample keys' plain strings find them
        self.counters: dict[str, Any] = {
            m: counter_cls(name=f"{prefix}{m}", documentation=m.help, labelnames=names, **reg)
            for m in CounterName
        }
        self.gauges: dict[str, Any] = {
            m: gauge_cls(name=f"{prefix}{m}", documentation=m.help, labelnames=names,
                         multiprocess_mode="mostrecent", **reg)
            for m in GaugeName
        }
        self.histograms: dict[str, Any] = {
            m: histogram_cls(name=f"{prefix}{m}", documentation=m.help, labelnames=names,
                             buckets=list(m.buckets), **reg)
            for m in HistogramName
        }

    def zero(self, tiers: Sequence[str], labelvalues: Sequence[object] = ()) -> None:
        """Export every counter and histogram at 0 for ``tiers`` now, before any event.

        So ``rate(...)`` alerts and dashboards read 0, not "no data", on a healthy idle
        server. Gauges get their values with the first stats. A 0 there would be a false
        capacity or estimate."""
        for tier in tiers:
            for counter in self.counters.values():
                counter.labels(*labelvalues, tier)
            for histogram in self.histograms.values():
                histogram.labels(*labelvalues, tier)

    def observe(self, data: Mapping[str, Any], labelvalues: Sequence[object] = ()) -> None:
        """Add one stats data dict: counters grow by their deltas, gauges take their values,
        each histogram value is observed. Undeclared metrics are ignored (a newer worker
        may send some)."""
        for key, value in (data.get("counters") or {}).items():
            metric, tier = split_key(key)
            if metric in self.counters and value > 0:
                self.counters[metric].labels(*labelvalues, tier).inc(value)
        for key, value in (data.get("gauges") or {}).items():
            metric, tier = split_key(key)
            if metric in self.gauges:
                self.gauges[metric].labels(*labelvalues, tier).set(value)
        for key, values in (data.get("histograms") or {}).items():
            metric, tier = split_key(key)
            if metric in self.histograms:
                child = self.histograms[metric].labels(*labelvalues, tier)
                for v in values:
                    child.observe(v)


class StandaloneExporter:
    """The plugin's metrics on ``registry``, named ``kvtier_...``, optionally served over HTTP.

    ``labels``: constant labels on every sample (``{"model_name": ...}``). ``tiers``: the
    configured tiers, whose counters are exported at 0 from the start. Whoever holds the
    stats calls :meth:`observe` with each data dict, from any thread. That is a stat
    logger, or a tool polling ``KVTierStats``. The :meth:`start` call serves ``registry``
    on ``/metrics`` from a daemon thread until :meth:`stop`.
    """

    def __init__(self, registry: CollectorRegistry, *, labels: Mapping[str, str] | None = None,
                 tiers: Sequence[str] = ()) -> None:
        self.registry = registry
        self._labels = dict(labels or {})
        self.metrics = PromMetrics(prefix=STANDALONE_PREFIX, labelnames=list(self._labels), registry=registry)
        self.metrics.zero(tiers, list(self._labels.values()))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def observe(self, stats_data: Mapping[str, Any]) -> None:
        """Add one ``KVTierStats.data`` dict (or :meth:`Counters.drain` output)."""
        self.metrics.observe(stats_data, list(self._labels.values()))

    def start(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (port 0: a free one); returns the bound port.
        Raises ``OSError`` if the port cannot be bound, ``RuntimeError`` if already serving."""
        if self._server is not None:
            raise RuntimeError(f"kvtier exporter already serving on port {self.port}")
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return int(self._server.server_port)

    @property
    def port(self) -> int | None:
        """The bound port while serving, else None."""
        return None if self._server is None else int(self._server.server_port)

    def stop(self) -> None:
        """Stop serving and close the socket (blocks until the server thread exits)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server, self._thread = None, None
