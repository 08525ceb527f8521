"""Metric definitions, in one place.

Every metric is declared once, as a member of :class:`CounterName`, :class:`GaugeName` or
:class:`HistogramName`. A member is its name (a ``StrEnum``: ``CounterName.BLOCKS_LOADED ==
"blocks_loaded"``) and carries its help text (a histogram's buckets too). :class:`Counters`
takes only these members: mypy rejects a plain string. At run time an undeclared name
raises ``ValueError`` at once, instead of vanishing from the exported metrics.

The hot path bumps plain counters in a dict (:class:`Counters`). They cross processes as
plain dicts inside vLLM's ``KVConnectorStats``. They become Prometheus metrics on vLLM's own
``/metrics`` in the API-server process (``vllm_kvtier.connector.stats``).

A sample key is ``"<metric>|<tier>"`` (``"blocks_loaded|cpu"``). The Prometheus name is
``vllm:kvtier_<metric>_total`` for counters and ``vllm:kvtier_<metric>`` for gauges and
histograms, with a ``tier`` label. Counters are summed over TP ranks (bytes are real bytes
moved; blocks count once per rank's shard). Histogram observations travel as lists of
values and are observed one by one where the metrics live. The standalone exporter
(:mod:`vllm_kvtier.exporter`) serves the same metrics named ``kvtier_<metric>...``.
"""

from __future__ import annotations

from collections import defaultdict
from enum import StrEnum
from typing import Any, Self


class _Declared(StrEnum):
    """A declared metric: the member's value is its name, ``help`` its help text."""

    help: str

    def __new__(cls, name: str, doc: str) -> Self:
        member = str.__new__(cls, name)
        member._value_ = name
        member.help = doc
        return member


class CounterName(_Declared):
    """Counters: ``vllm:kvtier_<name>_total``, by tier; :meth:`Counters.add` adds to them."""

    LOOKUP_BLOCKS = "lookup_blocks", "Prompt blocks looked up in the tiers for newly scheduled requests."
    HIT_BLOCKS = "hit_blocks", "Prompt blocks found in a tier (hits), by tier."
    REMOTE_HIT_BLOCKS = (
        "remote_hit_blocks",
        "Hits (hit_blocks) on a shared tier's chunks another instance wrote: what sharing the tier serves.",
    )
    BLOCKS_LOADED = "blocks_loaded", "Blocks copied from a tier into the engine's KV cache (swap in)."
    BYTES_LOADED = "bytes_loaded", "Bytes copied from a tier into the engine's KV cache."
    BLOCKS_STORED = "blocks_stored", "Blocks copied from the engine's KV cache into a tier (swap out)."
    BYTES_STORED = "bytes_stored", "Bytes copied from the engine's KV cache into a tier."
    LOAD_FAILURES = "load_failures", "Blocks that failed to load and were recomputed."
    STORE_FAILURES = "store_failures", "Writes to a tier that failed (disk full, permission, I/O error...)."
    EVICTIONS = "evictions", "Blocks evicted from a tier to make room."
    STORE_SKIPPED = "store_skipped", "Blocks not stored because every slot was in use by transfers."
    FLUSHED_BLOCKS = (
        "flushed_blocks",
        "Write-back blocks written in the background while still in DRAM (aged or the engine idle).",
    )
    STEP_SECONDS = (
        "step_seconds",
        "Seconds the worker's connector calls held up the engine's steps (saves issued, loads started and "
        "waited for, the wait for saves before a forward, polling), tier cpu: the plugin's own cost on the "
        "request path, summed over steps and TP ranks. step_calls counts the steps.",
    )
    STEP_CALLS = "step_calls", "Engine steps whose connector calls step_seconds timed (tier cpu)."
    SCHEDULER_SECONDS = (
        "scheduler_seconds",
        "Seconds vLLM's scheduler thread spent in the plugin's scheduler-side calls (lookups, allocation, "
        "each step's plan, the workers' reports, finished requests), tier cpu: the plugin's cost on the "
        "engine core's loop, which runs between every two forwards.",
    )
    BACKGROUND_CPU_SECONDS = (
        "background_cpu_seconds",
        "CPU seconds (user + system) of the plugin's own threads in the worker processes, by the tier they "
        "work for: cpu = the copy thread (saves into the CPU tier), nvme, s3, mooncake = their I/O "
        "threads. Sampled at most once a second from Linux's per-thread accounting; not the engine "
        "thread's time in the connector (step_seconds), nor threads inside native libraries (NIXL, "
        "Mooncake's transfer engine).",
    )
    LOAD_SECONDS = "load_seconds", "Seconds spent in load transfers (sum)."
    STORE_SECONDS = "store_seconds", "Seconds spent in store transfers (sum)."
    REQUESTS = "requests", "Requests sent to a remote tier's endpoint (S3: every HTTP attempt)."
    RETRIES = "retries", "Requests to a remote tier retried after a transient failure."
    BREAKER_OPENS = "breaker_opens", "Times a tier's circuit breaker opened (the endpoint kept failing)."
    READS = "reads", "Read requests completed by a lower tier (one per chunk read)."
    RECOMPUTE_CHOSEN_BLOCKS = (
        "recompute_chosen_blocks",
        "Blocks found in a tier but recomputed, because loading was estimated slower.",
    )
    PIN_REFUSALS = (
        "pin_refusals",
        "Key pins (kvtier_pin_ttl_s) refused because cpu.max_pinned_fraction of the slots were pinned.",
    )
    LOOKUP_TIMEOUTS = (
        "lookup_timeouts",
        "Lookups in a key-value pool (Mooncake) that did not answer within lookup_timeout_s (a miss).",
    )
    HANDOFF_TIMEOUTS = (
        "handoff_timeouts",
        "P/D decode requests whose prefilled blocks did not all appear in the pool in time.",
    )
    PREFETCH_BLOCKS = (
        "prefetch_blocks",
        "Blocks promoted into the CPU tier ahead of their request (prefetch), by source tier.",
    )
    PREFETCH_USED_BLOCKS = (
        "prefetch_used_blocks",
        "Prefetched blocks that a request then loaded from the CPU tier.",
    )
    PREFETCH_CANCELLED = (
        "prefetch_cancelled",
        "Prefetches cancelled because no CPU slot was free without evicting live data.",
    )
    PREFETCH_DROPPED = (
        "prefetch_dropped",
        "Queued prefetches dropped because they waited longer than prefetch.max_age_s.",
    )
    PREFETCH_FAILURES = (
        "prefetch_failures",
        "Prefetched blocks whose read failed (they stay where they were).",
    )
    PEER_OFFERED_BLOCKS = (
        "peer_offered_blocks",
        "P/D prefill side: blocks offered to a decode instance over NIXL.",
    )
    PEER_HOLD_TIMEOUTS = (
        "peer_hold_timeouts",
        "P/D prefill side: offers no decode instance read in nixl.hold_s (slots reclaimed).",
    )
    PEER_RELEASED_BLOCKS = (
        "peer_released_blocks",
        "P/D prefill side: offered blocks released at once because a decode instance read them.",
    )
    LOAD_PROBES = "load_probes", "Loads let through to re-measure a tier the estimates had stopped using."
    LOAD_WAIT_SECONDS = (
        "load_wait_seconds",
        "Seconds the forward waited for layer-by-layer sync loads (the rest of the copy overlapped).",
    )
    LAYER_LOADS_UNWAITED = (
        "layer_loads_unwaited",
        "Layers of a layer-by-layer load the forward did not wait for (waited at step end).",
    )
    LORA_UNKEYED_REQUESTS = (
        "lora_unkeyed_requests",
        "Requests with a LoRA adapter whose content could not be fingerprinted: they neither load from nor "
        "save to the tiers.",
    )
    NAMESPACE_MISMATCH = (
        "namespace_mismatch",
        "Lower-tier reads and writes a worker refused because the scheduler computed another namespace "
        "(model identity or KV layout seen differently by the two processes; logged as an ERROR): the "
        "blocks are recomputed, nothing is stored.",
    )
    AUTH_FAILURES = (
        "auth_failures",
        "Chunk reads refused by their MAC (forged or altered, unsigned, or signed with another key).",
    )
    UNTRUSTED_CHUNKS = (
        "untrusted_chunks",
        "Chunks forgotten by the scheduler after a read refused them as unauthenticated (unsigned, or "
        "signed with a key no longer accepted, e.g. after a key rotation): their blocks are written again; "
        "the object is not deleted (except a key-named pool object).",
    )
    RECLAIMED_FILES = (
        "reclaimed_files",
        "Files or objects of a tier deleted at start by their owner as debris: partial writes, chunks on "
        "only some TP ranks, misfits.",
    )
    RECLAIMED_BYTES = (
        "reclaimed_bytes",
        "Bytes of other namespaces' directories collected at start (nvme.gc_foreign_namespaces).",
    )
    VERIFY_SAMPLES = (
        "verify_samples",
        "Shadow verification: stored blocks compared with their recomputed KV, by the tier they came from.",
    )
    VERIFY_MISMATCHES = (
        "verify_mismatches",
        "Shadow verification: compared blocks outside the tolerance (the stored KV was wrong), by tier.",
    )
    VERIFY_INEXACT = (
        "verify_inexact",
        "Shadow verification: compared blocks within the tolerance but not bitwise equal, by tier.",
    )
    VERIFY_UNREAD = (
        "verify_unread",
        "Shadow verification: sampled blocks whose read from the tier failed (not compared).",
    )
    NO_BUFFER = (
        "no_buffer",
        "Reads and writes of a tier that got no transfer buffer (the host out of memory, ENOMEM, or a "
        "pool's registered arena full): the read is a miss, the write is skipped for now.",
    )
    VERIFY_FORGOTTEN_CHUNKS = (
        "verify_forgotten_chunks",
        "Shadow verification: chunks of a shared tier (s3, mooncake) found wrong and forgotten by this "
        "instance (never read again by it; not deleted for the others).",
    )
    VERIFY_QUARANTINES = (
        "verify_quarantines",
        "Shadow verification: times a tier was quarantined after a mismatch (verify.quarantine_s).",
    )
    SCAN_CUT_SHORT = (
        "scan_cut_short",
        "S3 start-up scans (per rank) cut short by s3.scan_deadline_s: what they reached was indexed, the "
        "rescans find the rest.",
    )
    RESCAN_RESYNCS = (
        "rescan_resyncs",
        "S3 rescan changes dropped because the engine took none of 262,144 pending chunk changes (an idle "
        "engine); the next rescan sends one delta instead.",
    )
    RESCAN_WRITTEN_DROPPED = (
        "rescan_written_dropped",
        "Chunk ids of our own writes not kept for the next listing because 262,144 were waiting already "
        "(listings failing); such a chunk deleted out of band leaves the index at its first read instead.",
    )
    FORGOTTEN_CHUNKS = (
        "forgotten_chunks",
        "Chunks another writer stored in a shared tier (S3, Mooncake) dropped from this instance's index "
        "after a read of them failed as damaged; not deleted: the failure may be this index's (a forged "
        "manifest entry), not the object's.",
    )
    RESCAN_REMOVED_CHUNKS = (
        "rescan_removed_chunks",
        "Chunks dropped from the index because a rescan no longer listed them (deleted or expired).",
    )
    MANIFESTS_COLLECTED = (
        "manifests_collected",
        "S3 manifests deleted by a rescan: not rewritten for s3.manifest_max_age_s, or covering nothing.",
    )
    MANIFESTS_REFUSED = (
        "manifests_refused",
        "S3 manifests a scan refused: with a key, by a name whose tag does not verify (never fetched); or "
        "for their bytes (a signature that does not verify, a size or format out of bounds). Not read again "
        "while unchanged. With a key, none of them was decoded.",
    )
    REQUEST_PARAMS_IGNORED = (
        "request_params_ignored",
        "Request kv_transfer_params ignored because config does not enable them or they are not allowed "
        "(the request is served, recomputing): tier cpu = kvtier_pin_ttl_s, peer = kvtier_peer (or a "
        "do_remote_decode offer past nixl.max_offered_fraction), mooncake = kvtier_pool_blocks.",
    )
    REQUEST_PARAMS_CAPPED = (
        "request_params_capped",
        "Request kv_transfer_params cut to a configured limit (tier cpu: a kvtier_pin_ttl_s above "
        "cpu.max_pin_ttl_s).",
    )
    PEER_UNPROMOTED_BLOCKS = (
        "peer_unpromoted_blocks",
        "P/D decode side: blocks read from a peer not in nixl.trusted_peers, used by their request only "
        "(not kept in the CPU tier, not written below).",
    )
    PEERS_REMOVED = (
        "peers_removed",
        "P/D decode side: NIXL remote agents disconnected (idle for nixl.hold_s, or for a new one beyond "
        "nixl.max_peers).",
    )
    PEER_REFUSALS = (
        "peer_refusals",
        "P/D decode side: reads not posted because nixl.max_peers peers all had reads in flight, or the "
        "offer's agent is not allowed (recomputed).",
    )
    EVENTS_DROPPED = (
        "events_dropped",
        "KV events (one block stored in or removed from a tier) dropped because events.max_queued_blocks "
        "were queued since the last take_events, by tier.",
    )
    PASSED_OVER = (
        "passed_over",
        "Lookups answered 'not yet' so that a shorter waiting request is admitted first (schedule.order "
        "short-first), tier all: one per request per step passed over.",
    )
    PASSED_OVER_EXPIRED = (
        "passed_over_expired",
        "Requests admitted in vLLM's order although a shorter one waited, because they had been passed "
        "over for schedule.max_wait_s (the fairness bound reached), tier all.",
    )


class GaugeName(_Declared):
    """Gauges: ``vllm:kvtier_<name>``, by tier; :meth:`Counters.set_gauge` sets them."""

    USAGE_BYTES = "usage_bytes", "Bytes of a tier holding blocks."
    CAPACITY_BYTES = "capacity_bytes", "Configured capacity of a tier in bytes."
    PINNED_BLOCKS = "pinned_blocks", "Blocks held by a key pin (kvtier_pin_ttl_s) that has not expired."
    BREAKER_STATE = (
        "breaker_state",
        "Circuit breaker of a remote tier: 0 closed, 1 half-open (probing), 2 open.",
    )
    ESTIMATED_BANDWIDTH_BYTES_PER_SECOND = (
        "estimated_bandwidth_bytes_per_second",
        "Load-or-recompute: estimated read bandwidth of a tier.",
    )
    ESTIMATED_LATENCY_SECONDS = (
        "estimated_latency_seconds",
        "Load-or-recompute: estimated per-load latency of a tier.",
    )
    ESTIMATED_PREFILL_TOKENS_PER_SECOND = (
        "estimated_prefill_tokens_per_second",
        "Load-or-recompute: estimated prefill rate (tier label 'compute').",
    )
    FOREIGN_BYTES = (
        "foreign_bytes",
        "NVMe: bytes under nvme.path in other namespaces' directories at start (after any collection).",
    )
    VERIFY_QUARANTINED = (
        "verify_quarantined",
        "Shadow verification: 1 while a tier is quarantined (serves no hits) after a mismatch, else 0.",
    )
    PARTIAL_CHUNKS = (
        "partial_chunks",
        "Chunks the last rescan listed on only some TP ranks (never indexed: a write in flight or a "
        "crashed one).",
    )


class HistogramName(StrEnum):
    """Histograms: ``vllm:kvtier_<name>``, by tier; :meth:`Counters.observe` feeds them.
    Observed once per request by the scheduler."""

    help: str
    #: Upper bounds of the buckets (``+Inf`` is added by prometheus_client).
    buckets: tuple[float, ...]

    def __new__(cls, name: str, doc: str, buckets: tuple[float, ...]) -> Self:
        member = str.__new__(cls, name)
        member._value_ = name
        member.help = doc
        member.buckets = buckets
        return member

    REQUEST_LOAD_WAIT_SECONDS = (
        "request_load_wait_seconds",
        "Seconds a request waited for its KV to load, from the scheduler issuing the load to the worker "
        "reporting it done, by the slowest tier it read. Async loads only take time here: a sync load runs "
        "inside the step that computes on it and counts 0 (its in-forward wait is "
        "load_wait_seconds_total).",
        (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    )
    REQUEST_LOADED_BLOCKS = (
        "request_loaded_blocks",
        "Blocks one request's load copies from a tier (one observation per tier the load reads).",
        tuple(float(2**i) for i in range(13)),  # 1 .. 4096
    )


#: What :meth:`Counters.drain` returns and ``KVTierStats.data`` holds:
#: ``{"counters": {key: delta}, "gauges": {key: value}, "histograms": {key: [value, ...]}}``.
StatsData = dict[str, dict[str, Any]]


def sample_key(metric: str, tier: str) -> str:
    return f"{metric}|{tier}"


def split_key(key: str) -> tuple[str, str]:
    metric, _, tier = key.partition("|")
    return metric, tier


# A member equals its name, so a plain string that names one is found in these too.
_COUNTERS: frozenset[str] = frozenset(CounterName)
_GAUGES: frozenset[str] = frozenset(GaugeName)
_HISTOGRAMS: frozenset[str] = frozenset(HistogramName)


def _declared(metric: str, declared: frozenset[str], kind: str) -> str:
    """``metric``, if ``declared`` holds it; else ``ValueError``, naming the enum ``kind``."""
    if metric not in declared:
        raise ValueError(f"{metric!r} is not declared in {kind} (vllm_kvtier.metrics)")
    return metric


class Counters:
    """Monotonic counters, last-value gauges and histogram observations, drained as deltas
    each step.

    Each method takes a member of its kind's enum; mypy checks that. At run time a name
    that is not a member raises ``ValueError`` at once: it is a bug, so it fails loudly
    rather than go missing from the metrics. A plain string equal to a declared name is
    accepted (tests write them). The check is one set lookup per call.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._delta: dict[str, float] = defaultdict(float)
        self._gauges: dict[str, float] = {}
        self._observed: dict[str, list[float]] = defaultdict(list)

    def add(self, metric: CounterName, tier: str, value: float = 1) -> None:
        k = sample_key(_declared(metric, _COUNTERS, "CounterName"), tier)
        if value:
            self.totals[k] += value
            self._delta[k] += value

    def set_gauge(self, metric: GaugeName, tier: str, value: float) -> None:
        self._gauges[sample_key(_declared(metric, _GAUGES, "GaugeName"), tier)] = value

    def observe(self, metric: HistogramName, tier: str, value: float) -> None:
        """One observation of histogram ``metric``."""
        self._observed[sample_key(_declared(metric, _HISTOGRAMS, "HistogramName"), tier)].append(value)

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
