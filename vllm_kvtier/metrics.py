"""Metric definitions, in one place.

The hot path bumps plain counters in a dict (:class:`Counters`); they cross processes as
plain dicts inside vLLM's ``KVConnectorStats`` and become Prometheus metrics on vLLM's own
``/metrics`` in the API-server process (``vllm_kvtier.connector.stats``).

A sample key is ``"<metric>|<tier>"`` (``"blocks_loaded|cpu"``); the Prometheus name is
``vllm:kvtier_<metric>_total`` for counters and ``vllm:kvtier_<metric>`` for gauges and
histograms, with a ``tier`` label. Counters are summed over TP ranks (bytes are real bytes
moved; blocks count once per rank's shard). Histogram observations travel as lists of
values and are observed one by one where the metrics live. The standalone exporter
(:mod:`vllm_kvtier.exporter`) serves the same metrics named ``kvtier_<metric>...``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

#: counter metric -> help text
COUNTERS: dict[str, str] = {
    "lookup_blocks": "Prompt blocks looked up in the tiers for newly scheduled requests.",
    "hit_blocks": "Prompt blocks found in a tier (hits), by tier.",
    "blocks_loaded": "Blocks copied from a tier into the engine's KV cache (swap in).",
    "bytes_loaded": "Bytes copied from a tier into the engine's KV cache.",
    "blocks_stored": "Blocks copied from the engine's KV cache into a tier (swap out).",
    "bytes_stored": "Bytes copied from the engine's KV cache into a tier.",
    "load_failures": "Blocks that failed to load and were recomputed.",
    "store_failures": "Writes to a tier that failed (disk full, permission, I/O error...).",
    "evictions": "Blocks evicted from a tier to make room.",
    "store_skipped": "Blocks not stored because every slot was in use by transfers.",
    "flushed_blocks": "Write-back blocks written in the background while still in DRAM (aged or the engine idle).",
    "step_seconds": "Seconds the worker's connector calls held up the engine's steps (saves issued, loads started "
                    "and waited for, the wait for saves before a forward, polling), tier cpu: the plugin's own cost "
                    "on the request path, summed over steps and TP ranks. step_calls counts the steps.",
    "step_calls": "Engine steps whose connector calls step_seconds timed (tier cpu).",
    "scheduler_seconds": "Seconds vLLM's scheduler thread spent in the plugin's scheduler-side calls (lookups, "
                         "allocation, each step's plan, the workers' reports, finished requests), tier cpu: the "
                         "plugin's cost on the engine core's loop, which runs between every two forwards.",
    "background_cpu_seconds": "CPU seconds (user + system) of the plugin's own threads in the worker processes, "
                              "by the tier they work for: cpu = the copy thread (saves into the CPU tier), nvme, "
                              "s3, mooncake = their I/O threads. Sampled at most once a second from Linux's "
                              "per-thread accounting; not the engine thread's time in the connector (step_seconds), "
                              "nor threads inside native libraries (NIXL, Mooncake's transfer engine).",
    "load_seconds": "Seconds spent in load transfers (sum).",
    "store_seconds": "Seconds spent in store transfers (sum).",
    "requests": "Requests sent to a remote tier's endpoint (S3: every HTTP attempt).",
    "retries": "Requests to a remote tier retried after a transient failure.",
    "breaker_opens": "Times a tier's circuit breaker opened (the endpoint kept failing).",
    "reads": "Read requests completed by a lower tier (one per chunk read).",
    "recompute_chosen_blocks": "Blocks found in a tier but recomputed, because loading was estimated slower.",
    "pin_refusals": "Key pins (kvtier_pin_ttl_s) refused because cpu.max_pinned_fraction of the slots were pinned.",
    "lookup_timeouts": "Lookups in a key-value pool (Mooncake) that did not answer within lookup_timeout_s (a miss).",
    "handoff_timeouts": "P/D decode requests whose prefilled blocks did not all appear in the pool in time.",
    "prefetch_blocks": "Blocks promoted into the CPU tier ahead of their request (prefetch), by source tier.",
    "prefetch_used_blocks": "Prefetched blocks that a request then loaded from the CPU tier.",
    "prefetch_cancelled": "Prefetches cancelled because no CPU slot was free without evicting live data.",
    "prefetch_dropped": "Queued prefetches dropped because they waited longer than prefetch.max_age_s.",
    "prefetch_failures": "Prefetched blocks whose read failed (they stay where they were).",
    "peer_offered_blocks": "P/D prefill side: blocks offered to a decode instance over NIXL.",
    "peer_hold_timeouts": "P/D prefill side: offers no decode instance read in nixl.hold_s (slots reclaimed).",
    "peer_released_blocks": "P/D prefill side: offered blocks released at once because a decode instance read them.",
    "load_probes": "Loads let through to re-measure a tier the estimates had stopped using.",
    "load_wait_seconds": "Seconds the forward waited for layer-by-layer sync loads (the rest of the copy overlapped).",
    "layer_loads_unwaited": "Layers of a layer-by-layer load the forward did not wait for (waited at step end).",
    "lora_unkeyed_requests": "Requests with a LoRA adapter whose content could not be fingerprinted: they neither "
                             "load from nor save to the tiers.",
    "namespace_mismatch": "Lower-tier reads and writes a worker refused because the scheduler computed another "
                          "namespace (model identity or KV layout seen differently by the two processes; logged "
                          "as an ERROR): the blocks are recomputed, nothing is stored.",
    "auth_failures": "Chunk reads refused by their MAC (forged or altered, unsigned, or signed with another key).",
    "untrusted_chunks": "Chunks forgotten by the scheduler after a read refused them as unauthenticated (unsigned, "
                        "or signed with a key no longer accepted, e.g. after a key rotation): their blocks are "
                        "written again; the object is not deleted (except a key-named pool object).",
    "reclaimed_files": "Files or objects of a tier deleted at start by their owner as debris: partial writes, chunks "
                       "on only some TP ranks, misfits.",
    "reclaimed_bytes": "Bytes of other namespaces' directories collected at start (nvme.gc_foreign_namespaces).",
    "verify_samples": "Shadow verification: stored blocks compared with their recomputed KV, by the tier they came from.",
    "verify_mismatches": "Shadow verification: compared blocks outside the tolerance (the stored KV was wrong), by tier.",
    "verify_inexact": "Shadow verification: compared blocks within the tolerance but not bitwise equal, by tier.",
    "verify_unread": "Shadow verification: sampled blocks whose read from the tier failed (not compared).",
    "no_buffer": "Reads and writes of a tier that got no transfer buffer (the host out of memory, ENOMEM, or a "
                 "pool's registered arena full): the read is a miss, the write is skipped for now.",
    "verify_forgotten_chunks": "Shadow verification: chunks of a shared tier (s3, mooncake) found wrong and "
                               "forgotten by this instance (never read again by it; not deleted for the others).",
    "verify_quarantines": "Shadow verification: times a tier was quarantined after a mismatch (verify.quarantine_s).",
    "scan_cut_short": "S3 start-up scans (per rank) cut short by s3.scan_deadline_s: what they reached was indexed, "
                      "the rescans find the rest.",
    "rescan_resyncs": "S3 rescan changes dropped because the engine took none of 262,144 pending chunk "
                      "changes (an idle engine); the next rescan sends one delta instead.",
    "rescan_written_dropped": "Chunk ids of our own writes not kept for the next listing because 262,144 were "
                              "waiting already (listings failing); such a chunk deleted out of band leaves the "
                              "index at its first read instead.",
    "forgotten_chunks": "Chunks another writer stored in a shared tier (S3, Mooncake) dropped from this instance's "
                        "index after a read of them failed as damaged; not deleted: the failure may be this "
                        "index's (a forged manifest entry), not the object's.",
    "rescan_removed_chunks": "Chunks dropped from the index because a rescan no longer listed them (deleted or expired).",
    "manifests_collected": "S3 manifests deleted by a rescan: not rewritten for s3.manifest_max_age_s, or covering nothing.",
    "request_params_ignored": "Request kv_transfer_params ignored because config does not enable them or they are "
                              "not allowed (the request is served, recomputing): tier cpu = kvtier_pin_ttl_s, "
                              "peer = kvtier_peer (or a do_remote_decode offer past nixl.max_offered_fraction), "
                              "mooncake = kvtier_pool_blocks.",
    "request_params_capped": "Request kv_transfer_params cut to a configured limit (tier cpu: a kvtier_pin_ttl_s "
                             "above cpu.max_pin_ttl_s).",
    "peer_unpromoted_blocks": "P/D decode side: blocks read from a peer not in nixl.trusted_peers, used by their "
                              "request only (not kept in the CPU tier, not written below).",
    "peers_removed": "P/D decode side: NIXL remote agents disconnected (idle for nixl.hold_s, or for a new one "
                     "beyond nixl.max_peers).",
    "peer_refusals": "P/D decode side: reads not posted because nixl.max_peers peers all had reads in flight, or "
                     "the offer's agent is not allowed (recomputed).",
    "events_dropped": "KV events (one block stored in or removed from a tier) dropped because events.max_queued_blocks "
                      "were queued since the last take_events, by tier.",
}

#: gauge metric -> help text
GAUGES: dict[str, str] = {
    "usage_bytes": "Bytes of a tier holding blocks.",
    "capacity_bytes": "Configured capacity of a tier in bytes.",
    "pinned_blocks": "Blocks held by a key pin (kvtier_pin_ttl_s) that has not expired.",
    "breaker_state": "Circuit breaker of a remote tier: 0 closed, 1 half-open (probing), 2 open.",
    "estimated_bandwidth_bytes_per_s": "Load-or-recompute: estimated read bandwidth of a tier.",
    "estimated_latency_seconds": "Load-or-recompute: estimated per-load latency of a tier.",
    "estimated_prefill_tokens_per_s": "Load-or-recompute: estimated prefill rate (tier label 'compute').",
    "foreign_bytes": "NVMe: bytes under nvme.path in other namespaces' directories at start (after any collection).",
    "verify_quarantined": "Shadow verification: 1 while a tier is quarantined (serves no hits) after a mismatch, else 0.",
    "partial_chunks": "Chunks the last rescan listed on only some TP ranks (never indexed: a write in flight or a crashed one).",
}



@dataclass(frozen=True)
class HistogramSpec:
    help: str
    #: Upper bounds of the buckets (``+Inf`` is added by prometheus_client).
    buckets: tuple[float, ...]


#: histogram metric -> help text and buckets. Observed once per request by the scheduler.
HISTOGRAMS: dict[str, HistogramSpec] = {
    "request_load_wait_seconds": HistogramSpec(
        "Seconds a request waited for its KV to load, from the scheduler issuing the load to the worker "
        "reporting it done, by the slowest tier it read. Async loads only take time here: a sync load runs "
        "inside the step that computes on it and counts 0 (its in-forward wait is load_wait_seconds_total).",
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    ),
    "request_loaded_blocks": HistogramSpec(
        "Blocks one request's load copies from a tier (one observation per tier the load reads).",
        tuple(float(2**i) for i in range(13)),  # 1 .. 4096
    ),
}

#: What :meth:`Counters.drain` returns and ``KVTierStats.data`` holds:
#: ``{"counters": {key: delta}, "gauges": {key: value}, "histograms": {key: [value, ...]}}``.
StatsData = dict[str, dict[str, Any]]


def sample_key(metric: str, tier: str) -> str:
    return f"{metric}|{tier}"


def split_key(key: str) -> tuple[str, str]:
    metric, _, tier = key.partition("|")
    return metric, tier


class Counters:
    """Monotonic counters, last-value gauges and histogram observations, drained as deltas
    each step."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._delta: dict[str, float] = defaultdict(float)
        self._gauges: dict[str, float] = {}
        self._observed: dict[str, list[float]] = defaultdict(list)

    def add(self, metric: str, tier: str, value: float = 1) -> None:
        if value:
            k = sample_key(metric, tier)
            self.totals[k] += value
            self._delta[k] += value

    def set_gauge(self, metric: str, tier: str, value: float) -> None:
        self._gauges[sample_key(metric, tier)] = value

    def observe(self, metric: str, tier: str, value: float) -> None:
        """One observation of histogram ``metric`` (declared in :data:`HISTOGRAMS`)."""
        self._observed[sample_key(metric, tier)].append(value)

    def drain(self) -> StatsData | None:
        """Deltas since the last drain, the current gauges and the observations since the
        last drain (key ``"histograms"``, only when there are some), or None if nothing
        changed."""
        if not self._delta and not self._gauges and not self._observed:
            return None
        out: StatsData = {"counters": dict(self._delta), "gauges": dict(self._gauges)}
        if self._observed:
            out["histograms"] = dict(self._observed)
        self._delta.clear()
        self._gauges.clear()
        self._observed = defaultdict(list)
        return out
