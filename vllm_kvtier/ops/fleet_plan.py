"""``kvtier plan --trace --instances N``: the fleet replay's figures per router, a sweep over
the number of instances and the shared tier's size, as a table and a PNG.

Pure functions over :mod:`vllm_kvtier.ops.fleet_sim`'s results, called from the CLI thread;
no I/O but the PNG. Shares are of the trace's prompt tokens; rates per hour of trace time;
money US dollars (S3 request prices; a Mooncake pool bills no request).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_kvtier.ops.fleet_sim import FleetResult, FleetSetup, simulate_fleet
from vllm_kvtier.ops.routers import ROUTERS, make_router
from vllm_kvtier.ops.trace_plan import Prices
from vllm_kvtier.ops.trace_sim import Trace, simulate_infinite, simulate_tiers


@dataclass(frozen=True)
class FleetRow:
    """One router on one fleet."""

    router: str
    instances: int
    shared_blocks: int | None
    has_shared: bool
    #: shares of prompt tokens: per tier ("cpu", local tiers, "shared"), and all tiers
    shares: dict[str, float]
    total: float
    #: all tiers over the infinite cache's share (1.0: every reusable token served)
    of_infinite: float
    #: shared-tier hits on another instance's chunks
    cross: float
    request_imbalance: float
    compute_imbalance: float
    shared_puts_per_h: float
    shared_gets_per_h: float
    shared_usd_per_h: float | None


def fleet_row(r: FleetResult, fleet: FleetSetup, infinite: float, prices: Prices) -> FleetRow:
    per_h = 3600.0 / r.duration_s
    puts, gets = r.shared_write_ops * per_h, r.shared_read_ops * per_h
    usd = None
    if fleet.shared is not None and fleet.shared_kind == "s3":
        usd = (puts * prices.put_usd_per_1000 + gets * prices.get_usd_per_1000) / 1000
    return FleetRow(
        router=r.router, instances=r.instances,
        shared_blocks=fleet.shared.capacity_blocks if fleet.shared is not None else None,
        has_shared=fleet.shared is not None, shares={k: r.share(k) for k in r.hit_tokens}, total=r.total_share,
        of_infinite=r.total_share / infinite if infinite else 0.0, cross=r.cross_share,
        request_imbalance=r.request_imbalance, compute_imbalance=r.compute_imbalance,
        shared_puts_per_h=puts, shared_gets_per_h=gets, shared_usd_per_h=usd)


def reference_shares(trace: Trace, fleet: FleetSetup) -> tuple[float, float]:
    """(one instance's share with the fleet's tiers, the shared one its own; an infinite cache's)."""
    lower = fleet.setup.lower + ((fleet.shared,) if fleet.shared is not None else ())
    single = simulate_tiers(trace, dataclasses.replace(fleet.setup, lower=lower))
    one = single.hit_tokens / single.prompt_tokens if single.prompt_tokens else 0.0
    return one, simulate_infinite(trace).hit_share


def plan_fleet(trace: Trace, fleet: FleetSetup, routers: Sequence[str], prices: Prices, *,
               max_imbalance: float, session_fanout: int) -> tuple[list[FleetRow], float, float]:
    """(a row per router, one instance's share, the infinite cache's share)."""
    one, infinite = reference_shares(trace, fleet)
    rows = []
    for name in routers:
        router = make_router(name, trace.keys, max_imbalance=max_imbalance, session_fanout=session_fanout)
        rows.append(fleet_row(simulate_fleet(trace, fleet, router), fleet, infinite, prices))
    return rows, one, infinite


def sweep_fleet(trace: Trace, fleet: FleetSetup, routers: Sequence[str], prices: Prices, instances: Sequence[int],
                shared_sizes: Sequence[int | None | str], *, max_imbalance: float,
                session_fanout: int) -> list[FleetRow]:
    """A row per (shared size, N, router). A shared size: blocks, None (unbounded), or
    "none" (no shared tier)."""
    infinite = simulate_infinite(trace).hit_share
    rows = []
    for size in shared_sizes:
        if size == "none" or fleet.shared is None:
            shared = None
        else:
            shared = dataclasses.replace(fleet.shared, capacity_blocks=size if isinstance(size, int) else None)
        for n in instances:
            f = dataclasses.replace(fleet, instances=n, shared=shared)
            for name in routers:
                router = make_router(name, trace.keys, max_imbalance=max_imbalance, session_fanout=session_fanout)
                rows.append(fleet_row(simulate_fleet(trace, f, router), f, infinite, prices))
    return rows


def _money(v: float | None) -> str:
    return "-" if v is None else f"${v:,.4f}" if v < 1 else f"${v:,.2f}"


def _size(row: FleetRow) -> str:
    if not row.has_shared:
        return "none"
    return "unbounded" if row.shared_blocks is None else f"{row.shared_blocks:,}"


def render_fleet(rows: Sequence[FleetRow], fleet: FleetSetup, single: float, infinite: float) -> str:
    local = [t.name for t in fleet.setup.lower]
    shared = "none" if fleet.shared is None else (
        f"{fleet.shared_kind} ({'unbounded' if fleet.shared.capacity_blocks is None else f'{fleet.shared.capacity_blocks:,} blocks'}"
        + (f", listed every {fleet.rescan_interval_s:g} s" if fleet.shared_kind == "s3" else ", seen at once") + ")")
    lines = [f"fleet: {fleet.instances} instances, each cpu {fleet.setup.cpu_blocks:,} blocks"
             + "".join(f", {t.name} {t.capacity_blocks:,} blocks" for t in fleet.setup.lower
                       if t.capacity_blocks is not None) + f"; shared tier: {shared}",
             f"one instance with the same tiers serves {single:.3f} of the prompt tokens; "
             f"an infinite cache {infinite:.3f}", ""]
    tiers = ["cpu", *local, "shared"]
    head = f"{'router':<12}" + "".join(f"{t:>8}" for t in tiers) + \
        f"{'all':>8}{'of inf':>8}{'cross':>8}{'imbal':>7}{'PUT/h':>10}{'GET/h':>10}{'cost/h':>10}"
    lines.append(head)
    for r in rows:
        lines.append(f"{r.router:<12}" + "".join(f"{r.shares.get(t, 0.0):>8.3f}" for t in tiers)
                     + f"{r.total:>8.3f}{r.of_infinite:>8.2f}{r.cross:>8.3f}{r.request_imbalance:>7.2f}"
                     + f"{r.shared_puts_per_h:>10,.0f}{r.shared_gets_per_h:>10,.0f}{_money(r.shared_usd_per_h):>10}")
    lines += ["", "shares of prompt tokens served from each tier (cpu and local tiers: the instance's own); "
                  "cross: shared-tier hits on chunks another instance wrote; imbal: busiest instance's "
                  "requests over the mean; rates per hour of trace time"]
    return "\n".join(lines)


def render_fleet_sweep(rows: Sequence[FleetRow], single: float, infinite: float) -> str:
    lines = [f"fleet sweep: share of prompt tokens served by all tiers (one instance {single:.3f}, "
             f"infinite cache {infinite:.3f})",
             f"{'shared':>10}  {'N':>4}  {'router':<12}{'all':>7}{'local':>7}{'shared':>7}{'cross':>7}{'imbal':>7}"
             f"{'cost/h':>10}"]
    for r in rows:
        lines.append(f"{_size(r):>10}  {r.instances:>4}  {r.router:<12}{r.total:>7.3f}"
                     f"{r.total - r.shares.get('shared', 0.0):>7.3f}{r.shares.get('shared', 0.0):>7.3f}"
                     f"{r.cross:>7.3f}{r.request_imbalance:>7.2f}{_money(r.shared_usd_per_h):>10}")
    return "\n".join(lines)


def fleet_to_dict(rows: Sequence[FleetRow], single: float, infinite: float) -> dict[str, Any]:
    return {"single_instance": single, "infinite": infinite, "rows": [dataclasses.asdict(r) for r in rows],
            "units": {"rates": "per hour of trace time", "money": "USD", "shares": "of prompt tokens"}}


def fleet_csv(rows: Sequence[FleetRow], single: float, infinite: float) -> str:
    """The rows as CSV, one line per (shared size, N, router), for any plotting tool. Shares
    of prompt tokens; ``shared_blocks``: blocks, ``unbounded`` or ``none``; the last two
    columns repeat the header's references (one instance, the infinite cache)."""
    tiers = list(dict.fromkeys(t for r in rows for t in r.shares))
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["shared_blocks", "instances", "router", "all", "of_infinite", *tiers, "cross", "request_imbalance",
                "compute_imbalance", "shared_puts_per_h", "shared_gets_per_h", "shared_usd_per_h",
                "single_instance", "infinite"])
    for r in rows:
        w.writerow([_size(r).replace(",", ""), r.instances, r.router, f"{r.total:.6f}", f"{r.of_infinite:.6f}",
                    *(f"{r.shares.get(t, 0.0):.6f}" for t in tiers), f"{r.cross:.6f}", f"{r.request_imbalance:.4f}",
                    f"{r.compute_imbalance:.4f}", f"{r.shared_puts_per_h:.1f}", f"{r.shared_gets_per_h:.1f}",
                    "" if r.shared_usd_per_h is None else f"{r.shared_usd_per_h:.6f}", f"{single:.6f}",
                    f"{infinite:.6f}"])
    return out.getvalue()


def render_fleet_png(rows: Sequence[FleetRow], single: float, infinite: float, path: str) -> str | None:
    """The sweep as a PNG (share served against N, one line per router and shared size);
    None when matplotlib is not installed (the table has the same figures)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = dict(zip(ROUTERS, ("-", "--", ":"), strict=True))
    for size in dict.fromkeys(_size(r) for r in rows):
        for name in dict.fromkeys(r.router for r in rows):
            sub = [r for r in rows if _size(r) == size and r.router == name]
            ax.plot([r.instances for r in sub], [r.total for r in sub], styles.get(name, "-"), marker="o",
                    label=f"{name}, shared {size}")
    ax.axhline(single, color="k", lw=0.8, label=f"one instance {single:.3f}")
    ax.axhline(infinite, color="grey", lw=0.8, label=f"infinite cache {infinite:.3f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("instances")
    ax.set_ylabel("share of prompt tokens served from the tiers")
    ax.set_ylim(0, max(0.05, math.ceil(infinite * 20 + 1) / 20))
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
