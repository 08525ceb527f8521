"""Load or recompute: is reading a stored prefix faster than computing it again?

Who calls it: the scheduler half, from vLLM's scheduler thread. Pure arithmetic on
estimates that the scheduler keeps up to date from what it observes. There are no clock
reads here except through the caller's ``now``.

The model, per tier below CPU: loading ``b`` bytes of one request costs ``latency_s +
b / bandwidth_Bps``. A request's chunks are fetched in parallel. So the latency is paid
about once per tier, and the bytes share the tier's bandwidth. Recomputing ``t`` tokens
costs ``t / prefill_tokens_per_s``. A matched run of blocks has each block in some tier.
For it, the decision loads the prefix length ``k`` that saves the most time,
``recompute(k) - load(k)``, and recomputes the rest. The CPU tier costs ``bytes / cpu
bandwidth``, so a DRAM prefix always wins.

Each tier's two figures are fitted separately from observed samples. A sample is a
request's load of ``b`` bytes taking ``t`` seconds from issue to done. The fit is a
least-squares line ``t = latency + b / bandwidth`` over the recent samples. Older ones
decay by :data:`DECAY` per sample. A prior worth one sample of each holds the fit towards
the starting figures: a read of no bytes, and one of the typical read size. So a handful
of small reads informs the latency, not the bandwidth. One figure of seconds per byte
would take all of a tier's latency as slowness. S3 would read as ~15 MB/s from a few
small reads, and the policy would recompute what it should load. Reads of one size alone
leave the split near the prior, while still predicting that size's time. Prefill speed
moves by an exponentially weighted average of prefill steps. A tier that is never loaded
from would never be measured again. So when the estimate says "recompute" and the last
sample is older than ``probe_interval_s``, one load is let through to refresh it.

Each decision says whether it flipped a tier between "load" and "recompute"
(:attr:`Decision.changed`). So the caller can log the decision with its inputs once per
change instead of once per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_kvtier.keys import TierName

#: Starting points until the first samples arrive (typical figures: a datacenter NVMe
#: drive read through threads; S3 from the same region; host memcpy).
DEFAULT_LATENCY_S: dict[str, float] = {TierName.CPU: 0.0, TierName.NVME: 0.0005, TierName.S3: 0.03}
DEFAULT_BANDWIDTH_BPS: dict[str, float] = {TierName.CPU: 10e9, TierName.NVME: 1.5e9, TierName.S3: 0.1e9}
DEFAULT_PREFILL_TOKENS_PER_S = 5000.0
_ALPHA = 0.3  # weight of a new sample


#: Weight left to a sample after each newer one: the fit follows about the last 30 loads.
DECAY = 0.97
#: Reads are assumed this large until one is seen (a chunk of a few MiB).
_TYPICAL_READ_BYTES = 4 << 20


class TierEstimate:
    """Latency and bandwidth of one tier, fitted from (bytes, seconds) samples around a
    prior (see the module doc). Read :attr:`latency_s` and :attr:`bandwidth_Bps`;
    :meth:`set_prior` replaces the starting figures (and drops the samples)."""

    def __init__(self, latency_s: float, bandwidth_Bps: float) -> None:
        self.last_sample_s = -math.inf
        self.set_prior(latency_s, bandwidth_Bps)

    def set_prior(self, latency_s: float, bandwidth_Bps: float) -> None:
        self._a0, self._b0 = max(latency_s, 0.0), 1.0 / bandwidth_Bps
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.samples = 0
        self.latency_s, self.bandwidth_Bps = self._a0, bandwidth_Bps

    def observe(self, nbytes: float, seconds: float) -> None:
        d = DECAY
        self._w = d * self._w + 1.0
        self._sx = d * self._sx + nbytes
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + nbytes * nbytes
        self._sxy = d * self._sxy + nbytes * seconds
        self.samples += 1
        self._fit()

    def _fit(self) -> None:
        """Minimise sum w (t - a - b x)^2 + (a - a0)^2 + xr^2 (b - b0)^2, xr the mean read
        size: ridge regression towards the prior, a 2x2 linear system."""
        xr = self._sx / self._w if self._w > 0 else _TYPICAL_READ_BYTES
        la, lb = 1.0, xr * xr
        m11, m12, m22 = self._w + la, self._sx, self._sxx + lb
        r1, r2 = self._sy + la * self._a0, self._sxy + lb * self._b0
        det = m11 * m22 - m12 * m12
        if det <= 0:
            return
        a = (r1 * m22 - m12 * r2) / det
        b = (m11 * r2 - m12 * r1) / det
        if a < 0:  # the data's line crosses below zero: no latency, slope through the mean
            a, b = 0.0, (r2 / m22 if m22 > 0 else self._b0)
        self.latency_s = a
        self.bandwidth_Bps = 1.0 / max(b, 1e-13)  # at most 10 TB/s

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
    #: tiers whose verdict (load all of their blocks, or not) differs from the last
    #: decision that involved them: log the decision when this is not empty
    changed: tuple[str, ...] = ()


class CostModel:
    def __init__(self, prefill_tokens_per_s: float | None = None, probe_interval_s: float = 30.0) -> None:
        self.prefill_tokens_per_s = prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
        self.probe_interval_s = probe_interval_s
        self.tiers: dict[str, TierEstimate] = {}
        self._verdicts: dict[str, bool] = {}  # tier -> whether the last decision loaded all of its blocks

    def tier(self, name: str) -> TierEstimate:
        est = self.tiers.get(name)
        if est is None:
            est = TierEstimate(DEFAULT_LATENCY_S.get(name, 0.01), DEFAULT_BANDWIDTH_BPS.get(name, 1e9))
            self.tiers[name] = est
        return est

    # ---- samples -----------------------------------------------------------------------

    def observe_load(self, tier: str, nbytes: float, seconds: float, now: float) -> None:
        """One request's blocks from ``tier`` (``nbytes`` per rank) took ``seconds``.

        The time runs from the load's reads being issued until the slowest was done:
        queueing behind other reads is included, the engine steps around them are not.
        One figure per request, not per read: reads of one request run in parallel."""
        if nbytes <= 0 or seconds <= 0:
            return
        est = self.tier(tier)
        est.observe(nbytes, seconds)
        est.last_sample_s = now

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that computed ``tokens`` prompt tokens took ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        s_per_token = seconds / tokens
        cur = 1.0 / self.prefill_tokens_per_s
        self.prefill_tokens_per_s = 1.0 / (cur + _ALPHA * (s_per_token - cur))

    # ---- decision ----------------------------------------------------------------------

    def decide(self, block_tiers: list[str], block_bytes: int, block_size: int, now: float,
               reprobe: bool = False) -> Decision:
        """``block_tiers[i]``: the tier block i of the matched run is in (``"cpu"``...).
        ``reprobe``: this request was granted the probe and not admitted (vLLM looks it up
        again next step): it keeps the probe, which the staleness mark already counted."""
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
        if best_k < n and (reprobe or any(now - self.tier(t).last_sample_s > self.probe_interval_s
                                          for t in recomputed if t != TierName.CPU)):
            # Stale estimate: load everything once, to measure the tier again (and
            # count it as fresh meanwhile, so one probe goes out, not a storm).
            for t in recomputed:
                self.tier(t).last_sample_s = now
            probe, best_k, recomputed = True, n, {}
            load_at_best = sum(self.tier(t).load_s(b) for t, b in bytes_by_tier.items())
        changed = []
        for t in dict.fromkeys(block_tiers):
            if t == TierName.CPU:
                continue
            verdict = t not in recomputed
            if self._verdicts.get(t) != verdict:
                self._verdicts[t] = verdict
                changed.append(t)
        return Decision(best_k, recomputed, load_at_best, best_k * block_size / self.prefill_tokens_per_s, probe,
                        tuple(changed))
