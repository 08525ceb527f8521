"""``kvtier plan --trace``: the tiers of a kvtier config replayed on an operator's own
trace.

Capacities in blocks work too. It reports the bounds, the writes, the requests, their
cost and the TTFT they save.

Pure functions over :mod:`vllm_kvtier.ops.trace_sim`'s results, called from the CLI
thread. No vLLM, no torch, no I/O. Sizes are bytes and times seconds. Rates are per hour
of trace time: the trace's span from its first request to its last. Money is US dollars.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.config.lower import NVMeTierConfig, S3TierConfig
from vllm_kvtier.keys import EvictionName
from vllm_kvtier.ops.trace_sim import (
    CacheResult,
    LowerTier,
    TierSetup,
    TiersResult,
    TraceSource,
    simulate_belady,
    simulate_infinite,
    simulate_policy,
    simulate_tiers,
)
from vllm_kvtier.ops.units import PlanInputError, human_bytes

#: Eviction policies the CPU tier can run (``cpu.eviction``), all replayed.
POLICIES = ("lru", "s3fifo", "arc", "kvaware")
#: S3 Standard request prices, us-east-1, per 1,000 requests (PUT/COPY/POST/LIST; GET).
DEFAULT_PUT_USD_PER_1000 = 0.005
DEFAULT_GET_USD_PER_1000 = 0.0004
#: A policy is recommended over the configured one only when it serves this much more.
RECOMMEND_MARGIN = 0.005


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def lower_tier(name: str, capacity_blocks: int | None, *, trace_block_tokens: int, engine_block_tokens: int,
               block_bytes: int, cfg: NVMeTierConfig | S3TierConfig | None = None,
               eviction: EvictionName | None = None) -> LowerTier:
    """A tier below CPU for the replay, with its chunks converted to trace blocks.

    It takes ``cfg``'s policy (mode, admission, chunk size, flush interval, NVMe's
    eviction), or the section's defaults. ``eviction`` overrides NVMe's (S3 is LRU). A
    chunk of ``chunk_blocks`` engine blocks is ``chunk_blocks x engine_block_tokens``
    tokens."""
    cls = NVMeTierConfig if name == "nvme" else S3TierConfig
    get = (lambda n: getattr(cfg, n)) if cfg is not None else (lambda n: _default(cls, n))
    chunk_tokens = get("chunk_blocks") * engine_block_tokens
    if trace_block_tokens >= chunk_tokens:
        chunk_blocks, objects = 1, -(-trace_block_tokens // chunk_tokens)
    else:
        chunk_blocks, objects = chunk_tokens // trace_block_tokens, 1
    flush = get("flush_interval_s") if get("mode") == "write-back" else 0.0
    if name != "nvme":
        eviction = "lru"
    elif eviction is None:
        eviction = get("eviction")
    return LowerTier(name, capacity_blocks, get("mode"), get("admit_min_seen"), chunk_blocks, flush, objects,
                     block_bytes, eviction)


@dataclass(frozen=True)
class Prices:
    put_usd_per_1000: float = DEFAULT_PUT_USD_PER_1000
    get_usd_per_1000: float = DEFAULT_GET_USD_PER_1000


@dataclass(frozen=True)
class Hardware:
    """Prefill rate and each tier's read bandwidth to the GPU (bytes/s).

    A lower tier's loads cross PCIe too, so give the slower of the two."""

    prefill_tokens_per_s: float
    read_bytes_per_s: dict[str, float]


@dataclass(frozen=True)
class TracePlanInput:
    trace: TraceSource
    setup: TierSetup
    trace_path: str = ""
    #: KV bytes of one token (None: the model is not known; no byte figures)
    bytes_per_token: int | None = None
    model_name: str = ""
    ssd_bytes: int | None = None
    prices: Prices = field(default_factory=Prices)
    hardware: Hardware | None = None


@dataclass(frozen=True)
class TierBounds:
    """A single cache of one tier's capacity: each online policy, Belady's MIN, infinite."""

    tier: str
    capacity_blocks: int | None
    lru: float
    s3fifo: float
    belady: float
    infinite: float
    arc: float = 0.0
    kvaware: float = 0.0


@dataclass(frozen=True)
class TierFigures:
    """One tier in the replay with the configured CPU policy."""

    tier: str
    capacity_blocks: int | None
    capacity_bytes: int | None
    hit_share: float
    #: hit share of this tier with each CPU policy (``lru``, ``s3fifo``)
    by_policy: dict[str, float]
    cumulative_share: float
    hit_tokens: int
    written_bytes_per_h: float | None = None
    written_blocks_per_h: float = 0.0
    drive_writes_per_day: float | None = None
    write_ops_per_h: float = 0.0
    read_ops_per_h: float = 0.0
    put_usd_per_h: float | None = None
    get_usd_per_h: float | None = None


@dataclass(frozen=True)
class TracePlan:
    requests: int
    prompt_tokens: int
    duration_s: float
    block_tokens: int
    block_tokens_source: str
    trace_path: str
    model_name: str
    block_bytes: int | None
    cpu_eviction: str
    tiers: list[TierFigures]
    bounds: list[TierBounds]
    #: whole hierarchy: share of prompt tokens served with each CPU policy
    total_by_policy: dict[str, float]
    tokens_to_compute: int
    recommended_eviction: str
    recommendation: str
    ssd_bytes: int | None
    ttft_saved_per_request_s: float | None = None
    recompute_s_per_request: float | None = None
    load_s_per_request: float | None = None
    #: TTFT saved per request with each CPU policy (with a hardware profile)
    ttft_saved_by_policy: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: with an NVMe tier: nvme.admit_min_seen -> (share of all tiers, NVMe blocks written per hour)
    admission_frontier: dict[int, tuple[float, float]] = field(default_factory=dict)
    recommended_admit_min_seen: int | None = None
    admission_recommendation: str = ""
    #: the NVMe tier's eviction replayed (``nvme.eviction``); None without NVMe
    nvme_eviction: str | None = None


def bounds_for(trace: TraceSource, tier: str, capacity_blocks: int | None, infinite: CacheResult,
               step_blocks: int | None = None) -> TierBounds:
    if capacity_blocks is None:
        s = infinite.hit_share
        return TierBounds(tier, None, s, s, s, s, s, s)
    share = {p: simulate_policy(trace, capacity_blocks, p, step_blocks).hit_share for p in POLICIES}
    return TierBounds(tier, capacity_blocks, share["lru"], share["s3fifo"], simulate_belady(trace, capacity_blocks).hit_share,
                      infinite.hit_share, share["arc"], share["kvaware"])


def make_trace_plan(inp: TracePlanInput) -> TracePlan:
    trace, setup = inp.trace, inp.setup
    runs: dict[str, TiersResult] = {p: simulate_tiers(trace, dataclasses.replace(setup, cpu_eviction=p))
                                    for p in POLICIES}
    main = runs[setup.cpu_eviction]
    per_h = 3600.0 / main.duration_s
    block_bytes = None if inp.bytes_per_token is None else inp.bytes_per_token * trace.block_tokens
    infinite = simulate_infinite(trace)
    tiers: list[TierFigures] = []
    cum = 0.0
    for j, t in enumerate(main.tiers):
        share = main.share(t)
        cum += share
        lower = setup.lower[j - 1] if j else None
        written_bph = None if block_bytes is None else t.written_bytes * per_h
        dwpd = None
        if written_bph is not None and t.name == "nvme" and inp.ssd_bytes:
            dwpd = written_bph * 24 / inp.ssd_bytes
        is_s3 = t.name == "s3"
        tiers.append(TierFigures(
            tier=t.name, capacity_blocks=t.capacity_blocks,
            capacity_bytes=None if block_bytes is None or t.capacity_blocks is None else t.capacity_blocks * block_bytes,
            hit_share=share, by_policy={p: r.share(r.tiers[j]) for p, r in runs.items()}, cumulative_share=cum,
            hit_tokens=t.hit_tokens, written_bytes_per_h=written_bph if lower else None,
            written_blocks_per_h=t.written_blocks * per_h, drive_writes_per_day=dwpd,
            write_ops_per_h=t.write_ops * per_h, read_ops_per_h=t.read_ops * per_h,
            put_usd_per_h=t.write_ops * per_h * inp.prices.put_usd_per_1000 / 1000 if is_s3 else None,
            get_usd_per_h=t.read_ops * per_h * inp.prices.get_usd_per_1000 / 1000 if is_s3 else None,
        ))
    bounds = [bounds_for(trace, t.name, t.capacity_blocks, infinite, setup.step_blocks) for t in main.tiers]
    totals = {p: r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0 for p, r in runs.items()}
    # more tokens served; on a tie, more of them from DRAM (the fastest tier); then the configured one
    ttft_by: dict[str, tuple[float, float, float]] = {}  # policy -> (saved, recompute, load) per request
    notes: list[str] = []
    if inp.hardware is not None:
        if inp.bytes_per_token is None:
            notes.append("TTFT: give the model (--model-config or --layers/--kv-heads/--head-dim) to size loads")
        else:
            hw, bpt = inp.hardware, inp.bytes_per_token
            for p, r in runs.items():
                rc = r.hit_tokens / hw.prefill_tokens_per_s / r.requests
                ld = sum(t.hit_tokens * bpt / hw.read_bytes_per_s[t.name] for t in r.tiers) / r.requests
                ttft_by[p] = (rc - ld, rc, ld)
    best, rec = recommend(setup.cpu_eviction, runs, {p: v[0] for p, v in ttft_by.items()})
    ttft, recompute, load = ttft_by.get(setup.cpu_eviction, (None, None, None))
    frontier = admission_frontier(trace, setup, main)
    admit, admit_rec = recommend_admission(setup, frontier)
    return TracePlan(
        requests=main.requests, prompt_tokens=main.prompt_tokens, duration_s=main.duration_s,
        block_tokens=trace.block_tokens, block_tokens_source=trace.block_tokens_source,
        trace_path=inp.trace_path, model_name=inp.model_name, block_bytes=block_bytes,
        cpu_eviction=setup.cpu_eviction, tiers=tiers, bounds=bounds, total_by_policy=totals,
        tokens_to_compute=main.tokens_to_compute, recommended_eviction=best, recommendation=rec,
        ssd_bytes=inp.ssd_bytes, ttft_saved_per_request_s=ttft, recompute_s_per_request=recompute,
        load_s_per_request=load, ttft_saved_by_policy={p: v[0] for p, v in ttft_by.items()}, notes=notes,
        admission_frontier=frontier, recommended_admit_min_seen=admit, admission_recommendation=admit_rec,
        nvme_eviction=next((t.eviction for t in setup.lower if t.name == "nvme"), None),
    )


#: ``nvme.admit_min_seen`` values replayed for the admission frontier.
ADMISSIONS = (1, 2)


def admission_frontier(trace: TraceSource, setup: TierSetup, configured: TiersResult) -> dict[int, tuple[float, float]]:
    """Each of :data:`ADMISSIONS` on the NVMe tier, the rest as configured.

    Each gives (share of prompt tokens served by all tiers, NVMe blocks written per hour).
    Empty without NVMe."""
    j = next((j for j, t in enumerate(setup.lower) if t.name == "nvme"), None)
    if j is None:
        return {}
    out = {}
    for n in ADMISSIONS:
        if n == setup.lower[j].admit_min_seen:
            r = configured
        else:
            lower = list(setup.lower)
            lower[j] = dataclasses.replace(lower[j], admit_min_seen=n)
            r = simulate_tiers(trace, dataclasses.replace(setup, lower=tuple(lower)))
        share = r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        out[n] = (share, r.tiers[j + 1].written_blocks * 3600.0 / r.duration_s)
    return out


def recommend_admission(setup: TierSetup, frontier: dict[int, tuple[float, float]]) -> tuple[int | None, str]:
    """(admit_min_seen, why): the value that serves the most.

    Another value wins if it serves within :data:`RECOMMEND_MARGIN` of it with fewer SSD
    writes. The configured one wins a tie. (None, "") without NVMe."""
    if not frontier:
        return None, ""
    configured = next(t.admit_min_seen for t in setup.lower if t.name == "nvme")
    top = max(v[0] for v in frontier.values())
    best = min((n for n, v in frontier.items() if v[0] >= top - RECOMMEND_MARGIN),
               key=lambda n: (frontier[n][1], n != configured))
    shown = ", ".join(f"{n}: {v[0]:.3f} served, {v[1]:,.0f} blocks/h written" for n, v in sorted(frontier.items()))
    verb = "keep" if best == configured else "set"
    return best, f"nvme.admit_min_seen: {verb} {best} ({shown})"


def recommend(configured: str, runs: dict[str, TiersResult], ttft_saved: dict[str, float]) -> tuple[str, str]:
    """(policy, why): the CPU policy that saves the most TTFT (with a hardware profile).

    Without a profile it is the one whose tiers serve the most prompt tokens. Ties go to
    the one serving more from the faster tiers (the share through each tier, from the
    slowest up). Another policy than ``configured`` is picked only when it wins by
    :data:`RECOMMEND_MARGIN` of the prompt tokens (or 5% of the TTFT saved)."""
    def cums(p: str) -> list[float]:
        r, out, c = runs[p], [], 0.0
        for t in r.tiers:
            c += r.share(t)
            out.append(c)
        return out[::-1]  # all tiers first, then without the slowest, ... then DRAM alone

    def key(p: str) -> tuple[float, ...]:
        return (round(ttft_saved.get(p, 0.0), 4), *(round(x, 4) for x in cums(p)))

    best = max(POLICIES, key=lambda p: (key(p), p == configured))
    if ttft_saved:
        a, b = ttft_saved[best], ttft_saved[configured]
        wins = a - b >= 0.05 * abs(b) and a > b
        why = f"{a:.3f} s of TTFT saved per request against {b:.3f} s with {configured}"
    else:
        diff = next((x - y for x, y in zip(cums(best), cums(configured), strict=True) if round(x - y, 4)), 0.0)
        wins = diff >= RECOMMEND_MARGIN
        names = [t.name for t in runs[best].tiers][::-1]
        why = ", ".join(f"through {n}: {x:.3f} against {y:.3f}"
                        for n, x, y in zip(names, cums(best), cums(configured), strict=True))
    if best == configured or not wins:
        others = ", ".join(f"{p}: " + " / ".join(f"{x:.3f}" for x in cums(p)[::-1]) for p in POLICIES)
        return configured, f"cpu.eviction: keep {configured} (share through each tier, fastest first: {others})"
    return best, f"cpu.eviction: {best} at these capacities ({why} with {configured})" if not ttft_saved else \
        f"cpu.eviction: {best} at these capacities ({why})"


def trace_plan_to_dict(plan: TracePlan) -> dict[str, Any]:
    out: dict[str, Any] = dataclasses.asdict(plan)
    out["units"] = {"rates": "per hour of trace time", "money": "USD", "shares": "of prompt tokens"}
    return out


def _blocks(n: int | None) -> str:
    return "unbounded" if n is None else f"{n:,}"


def _money(v: float | None) -> str:
    return "-" if v is None else f"${v:,.4f}" if v < 1 else f"${v:,.2f}"


def render_trace_plan(plan: TracePlan) -> str:
    minutes = plan.duration_s / 60
    how = plan.block_tokens_source
    lines = [
        f"Trace      {plan.trace_path}: {plan.requests:,} requests over {minutes:,.1f} min, "
        f"{plan.prompt_tokens:,} prompt tokens, {plan.block_tokens}-token blocks ({how})",
    ]
    if plan.block_bytes is not None:
        lines.append(f"Model      {plan.model_name}: one {plan.block_tokens}-token block = {plan.block_bytes:,} B "
                     f"= {human_bytes(plan.block_bytes)}")
    lines += ["Shares     of the trace's prompt tokens; rates per hour of trace time", ""]
    nvme = f", nvme.eviction {plan.nvme_eviction}" if plan.nvme_eviction else ""
    lines.append(f"tiers replayed (cpu.eviction {plan.cpu_eviction}{nvme}; the CPU tier under each policy alongside)")
    head = f"{'tier':<5} {'capacity (blocks)':>17}  {'hit share':>9}  {'through here':>12}  " + \
        "  ".join(f"{'cpu ' + p:>10}" for p in POLICIES)
    lines.append(head)
    for t in plan.tiers:
        lines.append(f"{t.tier:<5} {_blocks(t.capacity_blocks):>17}  {t.hit_share:>9.3f}  {t.cumulative_share:>12.3f}  "
                     + "  ".join(f"{t.by_policy[p]:>10.3f}" for p in POLICIES))
    lines.append(f"{'all':<5} {'':>17}  {plan.tiers[-1].cumulative_share:>9.3f}  {'':>12}  "
                 + "  ".join(f"{plan.total_by_policy[p]:>10.3f}" for p in POLICIES))
    lines += ["", "one cache of the tier's capacity (reference and bounds)",
              f"{'tier':<5} {'capacity (blocks)':>17}  {'LRU':>6}  {'S3-FIFO':>7}  {'ARC':>6}  {'kvaware':>7}  "
              f"{'Belady MIN':>10}  {'infinite':>8}"]
    for b in plan.bounds:
        lines.append(f"{b.tier:<5} {_blocks(b.capacity_blocks):>17}  {b.lru:>6.3f}  {b.s3fifo:>7.3f}  {b.arc:>6.3f}  "
                     f"{b.kvaware:>7.3f}  {b.belady:>10.3f}  {b.infinite:>8.3f}")
    lower = [t for t in plan.tiers if t.tier != "cpu"]
    if lower:
        lines += ["", "writes and requests (per hour)"]
        for t in lower:
            w = (f"{human_bytes(int(t.written_bytes_per_h))}/h written" if t.written_bytes_per_h is not None
                 else f"{t.written_blocks_per_h:,.0f} blocks/h written")
            if t.tier == "nvme":
                dw = (f", {t.drive_writes_per_day:.2f} drive writes per day of a {human_bytes(plan.ssd_bytes)} SSD"
                      if t.drive_writes_per_day is not None and plan.ssd_bytes else "")
                lines.append(f"{t.tier:<5} {w}{dw}; {t.write_ops_per_h:,.0f} chunk files/h written, "
                             f"{t.read_ops_per_h:,.0f} reads/h")
            else:
                lines.append(f"{t.tier:<5} {w}; {t.write_ops_per_h:,.0f} PUT/h ({_money(t.put_usd_per_h)}/h), "
                             f"{t.read_ops_per_h:,.0f} GET/h ({_money(t.get_usd_per_h)}/h)")
    left = plan.tokens_to_compute
    lines += ["", f"prompt tokens left to compute: {left:,} of {plan.prompt_tokens:,} "
              f"({left / plan.prompt_tokens if plan.prompt_tokens else 0:.1%})"]
    if plan.ttft_saved_per_request_s is not None:
        lines.append(f"TTFT saved per request: {plan.ttft_saved_per_request_s:.3f} s on average "
                     f"(prefill of the hit tokens {plan.recompute_s_per_request:.3f} s, their load "
                     f"{plan.load_s_per_request:.3f} s)")
    lines.append(f"recommendation: {plan.recommendation}")
    if plan.admission_recommendation:
        lines.append(f"recommendation: {plan.admission_recommendation}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def blocks_of(nbytes: int, block_bytes: int, option: str) -> int:
    """Whole trace blocks in ``nbytes``; at least one, or :class:`PlanInputError`."""
    n = nbytes // block_bytes
    if n < 1:
        raise PlanInputError(option, f"{nbytes:,} B hold no {block_bytes:,}-byte block of the trace")
    return n


def cpu_blocks_from_config(cfg: KVTierConfig, block_bytes: int, dram_bytes: int | None, reserved: int) -> int:
    """The CPU tier's slots in trace blocks.

    It is ``cpu.capacity_bytes``, or its fraction of ``dram_bytes`` less ``reserved``.
    ``reserved`` is what the connector takes of the DRAM available."""
    if cfg.cpu.capacity_bytes is not None:
        return blocks_of(cfg.cpu.capacity_bytes, block_bytes, "cpu.capacity_bytes")
    if dram_bytes is None:
        raise PlanInputError("--dram-bytes", "the config sizes the CPU tier by cpu.capacity_fraction: give the DRAM "
                                             "(or cpu.capacity_bytes, or --cpu-blocks)")
    return blocks_of(int((dram_bytes - reserved) * cfg.cpu.capacity_fraction), block_bytes, "--dram-bytes")


def sweep(trace: TraceSource, setup: TierSetup, cpu_sizes: Sequence[int], nvme_sizes: Sequence[int | None],
          nvme_base: LowerTier | None = None) -> list[dict[str, Any]]:
    """The hierarchy's hit shares over a grid of CPU and NVMe sizes (blocks; NVMe None: no
    NVMe tier), each CPU policy. One row per (cpu, nvme) pair. The NVMe tier is the setup's,
    else ``nvme_base`` (the section's defaults), resized."""
    rows = []
    nvme_cfg = next((t for t in setup.lower if t.name == "nvme"), nvme_base)
    others = tuple(t for t in setup.lower if t.name != "nvme")
    for nv in nvme_sizes:
        for c in cpu_sizes:
            lower = others
            if nv is not None:
                if nvme_cfg is None:
                    raise ValueError("sweep: NVMe sizes need an NVMe tier to resize (nvme_base)")
                lower = (dataclasses.replace(nvme_cfg, capacity_blocks=nv), *others)
            row: dict[str, Any] = {"cpu_blocks": c, "nvme_blocks": nv}
            for p in POLICIES:
                r = simulate_tiers(trace, dataclasses.replace(setup, cpu_blocks=c, cpu_eviction=p, lower=lower))
                row[p] = {t.name: r.share(t) for t in r.tiers}
                row[p]["all"] = r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
            row["belady_cpu"] = simulate_belady(trace, c).hit_share
            rows.append(row)
    return rows


def render_sweep(rows: list[dict[str, Any]], infinite: float) -> str:
    lines = [f"sweep: share of prompt tokens served by all tiers (infinite cache: {infinite:.3f})",
             f"{'cpu blocks':>10}  {'nvme blocks':>11}  " + "  ".join(f"{p:>7}" for p in POLICIES)
             + f"  {'best':>7}  {'cpu-only Belady':>15}"]
    for r in rows:
        best = max(POLICIES, key=lambda p: r[p]["all"])
        if all(abs(r[p]["all"] - r[best]["all"]) < 0.0005 for p in POLICIES):
            best = "tie"
        lines.append(f"{r['cpu_blocks']:>10,}  {_blocks(r['nvme_blocks']) if r['nvme_blocks'] is not None else '-':>11}"
                     "  " + "  ".join(f"{r[p]['all']:>7.3f}" for p in POLICIES) + f"  {best:>7}  {r['belady_cpu']:>15.3f}")
    return "\n".join(lines)


def render_sweep_png(rows: list[dict[str, Any]], infinite: float, path: str) -> str | None:
    """The sweep as a PNG: hit share against CPU size, one line per NVMe size and policy.

    None when matplotlib is not installed (the table has the same figures)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for nv in dict.fromkeys(r["nvme_blocks"] for r in rows):
        sub = [r for r in rows if r["nvme_blocks"] == nv]
        xs = [r["cpu_blocks"] for r in sub]
        label = "no NVMe" if nv is None else f"NVMe {nv:,} blocks"
        for p, style in zip(POLICIES, ("-", "--", "-.", ":"), strict=True):
            ax.plot(xs, [r[p]["all"] for r in sub], style, marker="o", label=f"{label}, cpu {p}")
    first = [r for r in rows if r["nvme_blocks"] == rows[0]["nvme_blocks"]]
    ax.plot([r["cpu_blocks"] for r in first], [r["belady_cpu"] for r in first], ":", color="k",
            label="CPU only, Belady MIN")
    ax.axhline(infinite, color="grey", lw=0.8, label=f"infinite cache {infinite:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("CPU tier size (trace blocks)")
    ax.set_ylabel("share of prompt tokens served from the tiers")
    ax.set_ylim(0, max(0.05, math.ceil(infinite * 20 + 1) / 20))
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
