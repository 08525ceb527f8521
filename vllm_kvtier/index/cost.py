"""Load or recompute: is reading a stored prefix faster than computing it again?

Who calls it: the scheduler half, from vLLM's scheduler thread. Pure arithmetic on
estimates that the scheduler keeps up to date from what it observes (no clock reads here
except through the caller's ``now``).

The model, per tier below CPU: loading ``b`` bytes of one request costs ``latency_s +
b / bandwidth_Bps`` (a request's chunks are fetched in parallel, so the latency is paid
about once per tier, the bytes share the tier's bandwidth). Recomputing ``t`` tokens costs
``t / prefill_tokens_per_s``. For a matched run of blocks (each in some tier), the
decision loads the prefix length ``k`` that saves the most time, ``recompute(k) -
load(k)``, and recomputes the rest; the CPU tier costs ``bytes / cpu bandwidth``, so a
DRAM prefix always wins.

Estimates move by an exponentially weighted average (of times per byte and per token)
of observed samples: requests' loads (bytes, seconds from issue to done) and prefill
steps (tokens, seconds), both timed by the scheduler. A tier that is never loaded from
would never be measured again, so when the estimate says "recompute" and the last sample
is older than ``probe_interval_s``, one load is let through to refresh it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Starting points until the first samples arrive (typical figures: a datacenter NVMe
#: drive read through threads; S3 from the same region; host memcpy).
DEFAULT_LATENCY_S = {"cpu": 0.0, "nvme": 0.0005, "s3": 0.03}
DEFAULT_BANDWIDTH_BPS = {"cpu": 10e9, "nvme": 1.5e9, "s3": 0.1e9}
DEFAULT_PREFILL_TOKENS_PER_S = 5000.0
_ALPHA = 0.3  # weight of a new sample


@dataclass
class TierEstimate:
    latency_s: float
    bandwidth_Bps: float
    last_sample_s: float = -math.inf

    def load_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class Decision:
    """How many of the matched blocks to load, and the estimates behind it."""

    load_blocks: int
    #: blocks found below CPU that will be recomputed instead, by tier
    recomputed: dict[str, int]
    load_s: float
    recompute_s: float
    probe: bool = False


class CostModel:
    def __init__(self, prefill_tokens_per_s: float | None = None, probe_interval_s: float = 30.0) -> None:
        self.prefill_tokens_per_s = prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
        self.probe_interval_s = probe_interval_s
        self.tiers: dict[str, TierEstimate] = {}

    def tier(self, name: str) -> TierEstimate:
        est = self.tiers.get(name)
        if est is None:
            est = TierEstimate(DEFAULT_LATENCY_S.get(name, 0.01), DEFAULT_BANDWIDTH_BPS.get(name, 1e9))
            self.tiers[name] = est
        return est

    # ---- samples -----------------------------------------------------------------------

    def observe_load(self, tier: str, nbytes: float, seconds: float, now: float) -> None:
        """One request's blocks from ``tier`` (``nbytes`` per rank) took ``seconds`` from
        the load being issued until it was done: what the decision is about, queueing
        behind other loads included (per-read timings are not: reads of one request run in
        parallel and wait for each other)."""
        if nbytes <= 0 or seconds <= 0:
            return
        est = self.tier(tier)
        s_per_b = max(seconds - est.latency_s, 1e-9) / nbytes
        est.bandwidth_Bps = 1.0 / (1.0 / est.bandwidth_Bps + _ALPHA * (s_per_b - 1.0 / est.bandwidth_Bps))
        est.last_sample_s = now

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that computed ``tokens`` prompt tokens took ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        s_per_token = seconds / tokens
        cur = 1.0 / self.prefill_tokens_per_s
        self.prefill_tokens_per_s = 1.0 / (cur + _ALPHA * (s_per_token - cur))

    # ---- decision ----------------------------------------------------------------------

    def decide(self, block_tiers: list[str], block_bytes: int, block_size: int, now: float) -> Decision:
        """``block_tiers[i]``: the tier block i of the matched run is in (``"cpu"``...)."""
        best_k, best_gain = 0, 0.0
        bytes_by_tier: dict[str, int] = {}
        load_at_best = 0.0
        for k, tier in enumerate(block_tiers, start=1):
            bytes_by_tier[tier] = bytes_by_tier.get(tier, 0) + block_bytes
            load = sum(self.tier(t).load_s(b) for t, b in bytes_by_tier.items())
            gain = k * block_size / self.prefill_tokens_per_s - load
            if gain >= best_gain:
                best_k, best_gain, load_at_best = k, gain, load
        recomputed: dict[str, int] = {}
        for t in block_tiers[best_k:]:
            recomputed[t] = recomputed.get(t, 0) + 1
        n = len(block_tiers)
        probe = False
        if best_k < n and any(now - self.tier(t).last_sample_s > self.probe_interval_s
                              for t in recomputed if t != "cpu"):
            # Stale estimate: load everything once, to measure the tier again (and
            # count it as fresh meanwhile, so one probe goes out, not a storm).
            for t in recomputed:
                self.tier(t).last_sample_s = now
            probe, best_k, recomputed = True, n, {}
            load_at_best = sum(self.tier(t).load_s(b) for t, b in bytes_by_tier.items())
        return Decision(best_k, recomputed, load_at_best, best_k * block_size / self.prefill_tokens_per_s, probe)
