"""The options of ``kvtier plan --trace --instances N`` and their run (called by
:mod:`vllm_kvtier.cli` once the trace and one instance's tiers are read and checked)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from vllm_kvtier.ops.units import parse_count, parse_positive

_ROUTER_NAMES = ("round-robin", "session", "prefix")


def add_fleet_args(parser: argparse.ArgumentParser | Any) -> None:
    """The fleet options, on ``parser`` (an argument group of ``kvtier plan``)."""
    g = parser.add_argument_group(
        "fleet (--trace with --instances N): N instances with their own CPU and NVMe tiers, one shared tier "
        "(the S3 tier, or a Mooncake pool) and a router; see docs/planning.md")
    g.add_argument("--instances", help="instances in the fleet (the S3 tier becomes the shared tier)")
    g.add_argument("--router", default="all", choices=[*_ROUTER_NAMES, "all"],
                   help="which instance serves a request (default: all three, side by side)")
    g.add_argument("--shared-tier", default="s3", choices=["s3", "mooncake"],
                   help="the shared tier: S3 (others find a chunk at their next rescan) or a Mooncake pool "
                        "(found at once); default s3")
    g.add_argument("--shared-blocks", help="shared tier size in trace blocks, or 'unbounded' (default: the S3 "
                                           "tier's, --s3-blocks or the config; none: no shared tier)")
    g.add_argument("--rescan-interval-s", help="S3: seconds between listings (default: s3.rescan_interval_s, 60)")
    g.add_argument("--max-imbalance", default="4",
                   help="prefix router: pass over an instance with this many requests in flight above the "
                        "fleet's mean (default 4)")
    g.add_argument("--session-fanout", default="8",
                   help="session router: a block followed by this many different blocks is a shared prefix, "
                        "not a conversation's start (default 8)")
    g.add_argument("--prefill-s-per-token", default="0.0001",
                   help="seconds of prefill per prompt token computed: time in flight (default 0.0001)")
    g.add_argument("--decode-s-per-token", default="0.02",
                   help="seconds of decode per output token: time in flight (default 0.02)")
    g.add_argument("--sweep-instances", default="1,2,4,8,16", help="fleet sizes of the sweep (default 1,2,4,8,16)")
    g.add_argument("--sweep-shared-blocks", default="none,unbounded",
                   help="shared tier sizes of the sweep: blocks, 'unbounded', 'none' (default none,unbounded)")
    g.add_argument("--csv", metavar="FILE",
                   help="also write the fleet's rows (with --sweep: every shared size, N and router) as CSV, "
                        "for any plotting tool")


def _shared_size(text: str, option: str) -> int | None | str:
    t = text.strip()
    return t if t in ("none", "unbounded") else parse_count(t, option)


def _write_csv(path: str | None, text: str) -> None:
    """Write ``text`` to ``path`` (None: nothing); a file that cannot be written is an
    error naming it (before any figure is printed)."""
    if path is None:
        return
    from vllm_kvtier.ops.units import PlanInputError

    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise PlanInputError("--csv", f"cannot write {path}: {e.strerror or e}") from None


def run_fleet(args: argparse.Namespace, trace: Any, setup: Any, prices: Any, *, engine_block_tokens: int,
              rescan_interval_s: float) -> int:
    """Print the fleet's table (or its sweep and PNG); ``setup``: one instance's tiers,
    its S3 tier (if any) the shared one."""
    from vllm_kvtier.ops.fleet_plan import (
        fleet_csv,
        fleet_to_dict,
        plan_fleet,
        reference_shares,
        render_fleet,
        render_fleet_png,
        render_fleet_sweep,
        sweep_fleet,
    )
    from vllm_kvtier.ops.fleet_sim import FleetSetup
    from vllm_kvtier.ops.trace_plan import lower_tier
    from vllm_kvtier.ops.trace_sim import LowerTier

    n = parse_count(args.instances, "--instances")
    s3 = next((t for t in setup.lower if t.name == "s3"), None)
    local = tuple(t for t in setup.lower if t.name != "s3")
    size: int | None | str = "none" if s3 is None else s3.capacity_blocks
    if args.shared_blocks is not None:
        size = _shared_size(args.shared_blocks, "--shared-blocks")
    shared = None
    if size != "none":
        cap = size if isinstance(size, int) else None
        if args.shared_tier == "mooncake":  # one object per engine block, put at once
            shared = LowerTier("mooncake", cap, "write-through", 1, 1, 0.0,
                               max(1, -(-trace.block_tokens // engine_block_tokens)), setup.block_bytes)
        else:
            base = s3 or lower_tier("s3", None, trace_block_tokens=trace.block_tokens,
                                    engine_block_tokens=engine_block_tokens, block_bytes=setup.block_bytes)
            shared = dataclasses.replace(base, capacity_blocks=cap)
    rescan = rescan_interval_s if args.rescan_interval_s is None else \
        parse_positive(args.rescan_interval_s, "--rescan-interval-s")
    fleet = FleetSetup(n, dataclasses.replace(setup, lower=local), shared, args.shared_tier, rescan,
                       parse_positive(args.prefill_s_per_token, "--prefill-s-per-token"),
                       parse_positive(args.decode_s_per_token, "--decode-s-per-token"))
    routers = _ROUTER_NAMES if args.router == "all" else (args.router,)
    kw: dict[str, Any] = {"max_imbalance": parse_positive(args.max_imbalance, "--max-imbalance"),
                          "session_fanout": parse_count(args.session_fanout, "--session-fanout")}
    if args.sweep:
        sizes = [_shared_size(v, "--sweep-shared-blocks") for v in args.sweep_shared_blocks.split(",") if v.strip()]
        if shared is None and any(s != "none" for s in sizes):
            shared = lower_tier("s3", None, trace_block_tokens=trace.block_tokens,
                                engine_block_tokens=engine_block_tokens, block_bytes=setup.block_bytes)
            fleet = dataclasses.replace(fleet, shared=shared)
        single, infinite = reference_shares(trace, fleet)
        ns = [parse_count(v, "--sweep-instances") for v in args.sweep_instances.split(",") if v.strip()]
        rows = sweep_fleet(trace, fleet, routers, prices, ns,
                           [None if s == "unbounded" else s for s in sizes], **kw)
        _write_csv(args.csv, fleet_csv(rows, single, infinite))
        if args.json:
            print(json.dumps(fleet_to_dict(rows, single, infinite), indent=2))
            return 0
        print(render_fleet_sweep(rows, single, infinite))
        png = render_fleet_png(rows, single, infinite, args.png)
        print(f"chart: {png}" if png else
              "chart: not drawn (matplotlib is not installed: pip install 'vllm-kvtier[plot]'); the table "
              "has the figures" + (", and the CSV" if args.csv else "; --csv FILE writes them for any plotting tool"))
        return 0
    rows, single, infinite = plan_fleet(trace, fleet, routers, prices, **kw)
    _write_csv(args.csv, fleet_csv(rows, single, infinite))
    print(json.dumps(fleet_to_dict(rows, single, infinite), indent=2) if args.json
          else render_fleet(rows, fleet, single, infinite))
    return 0
