"""``kvtier plan --trace``: the plugin's tiers replayed on a request trace
(:mod:`vllm_kvtier.ops.trace_plan`), a sweep of sizes, or a fleet of instances."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from vllm_kvtier.cli.configs import parse_kvtier_config
from vllm_kvtier.cli.options import model_of, opt
from vllm_kvtier.config import available_presets
from vllm_kvtier.index.policy import EVICTION_NAMES
from vllm_kvtier.ops.capacity import KV_DTYPE_BYTES, kv_bytes_per_token
from vllm_kvtier.ops.units import PlanInputError, parse_count, parse_positive, parse_size


def add_trace_args(plan: argparse.ArgumentParser) -> None:
    """The options of a replay, in their own group of ``kvtier plan --help``."""
    t = plan.add_argument_group(
        "trace replay (--trace): the tiers replayed on your own traffic, through the plugin's index, eviction "
        "and admission code; see docs/planning.md")
    t.add_argument("--trace", metavar="FILE", help="JSONL trace: timestamp (ms), input_length, output_length, "
                                                  "hash_ids (Mooncake, Alibaba, vLLM timed_trace)")
    t.add_argument("--trace-block-tokens", help="tokens per hash id (default: inferred, 512 for Mooncake; 512 "
                                                "for a trace of prompt_token_ids)")
    t.add_argument("--sample", metavar="FRACTION",
                   help="keep this fraction of the conversations, whole (with --save-trace: a smaller trace)")
    t.add_argument("--save-trace", metavar="FILE", help="write the trace as hash ids (no tokens: shareable)")
    t.add_argument("--engine-block-tokens", default="16", help="vLLM's block size, for chunk sizes (default 16)")
    t.add_argument("--file", help="a kvtier config (YAML): tiers, capacities, modes, admission, eviction")
    t.add_argument("--preset", help=f"a shipped preset ({', '.join(available_presets())})")
    t.add_argument("--extra-config", dest="extra", metavar="JSON", help="kv_connector_extra_config as JSON")
    t.add_argument("--cpu-blocks", help="CPU tier size: trace blocks, or bytes with a unit (needs the model)")
    t.add_argument("--nvme-blocks", help="NVMe tier size (write-back, admit_min_seen 1 unless the config says)")
    t.add_argument("--nvme-eviction", choices=EVICTION_NAMES,
                   help="the NVMe tier's eviction to replay (default: the config's nvme.eviction, or its default)")
    t.add_argument("--s3-blocks", help="S3 tier size, or 'unbounded' (write-through, admit 1 unless the config says)")
    t.add_argument("--step-tokens", default="8192",
                   help="prompt tokens computed (and saved) per engine step: vLLM's max_num_batched_tokens "
                        "(default 8192)")
    t.add_argument("--cpu-eviction", choices=["lru", "s3fifo", "arc", "kvaware"], help="the CPU policy to report (default: config's)")
    t.add_argument("--ssd-bytes", help="drive size for drive writes per day (default: the NVMe tier's size)")
    t.add_argument("--s3-put-usd-per-1000", default=str(0.005), help="S3 PUT price per 1,000 (default 0.005)")
    t.add_argument("--s3-get-usd-per-1000", default=str(0.0004), help="S3 GET price per 1,000 (default 0.0004)")
    t.add_argument("--sweep", action="store_true", help="hit share over a grid of CPU and NVMe sizes, and a PNG")
    t.add_argument("--sweep-cpu-blocks", default="1000,3000,10000,30000,100000", help="CPU sizes of the sweep")
    t.add_argument("--sweep-nvme-blocks", default="", help="NVMe sizes of the sweep (default: none)")
    t.add_argument("--png", default="plan-trace-sweep.png", help="the sweep's chart (default plan-trace-sweep.png)")


def _int_list(text: str, option: str) -> list[int]:
    return [parse_count(v.strip(), option) for v in text.split(",") if v.strip()] or [parse_count("", option)]


def _blocks_opt(text: str | None, option: str, block_bytes: int | None) -> int | None:
    """A tier size: blocks (``30000``), or bytes with a unit (``80GB``) when the model is known."""
    if text is None:
        return None
    if text.strip().isdigit():
        return parse_count(text, option)
    if block_bytes is None:
        raise PlanInputError(option, f"{text!r}: a size in bytes needs the model (--model-config or --layers/"
                                     "--kv-heads/--head-dim); or give blocks")
    from vllm_kvtier.ops.trace_plan import blocks_of

    return blocks_of(parse_size(text, option), block_bytes, option)


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (a link, another spelling)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet)
        return os.path.realpath(a) == os.path.realpath(b)


def run_plan_trace(args: argparse.Namespace) -> int:
    """``kvtier plan --trace``: the tiers replayed on a trace (vllm_kvtier/ops/trace_plan.py)."""
    from vllm_kvtier.ops.trace_plan import (
        Hardware,
        Prices,
        TracePlanInput,
        cpu_blocks_from_config,
        lower_tier,
        make_trace_plan,
        render_sweep,
        render_sweep_png,
        render_trace_plan,
        sweep,
        trace_plan_to_dict,
    )
    from vllm_kvtier.ops.trace_sim import (
        TierSetup,
        Trace,
        TraceError,
        TraceSource,
        read_trace,
        simulate_infinite,
    )
    from vllm_kvtier.ops.trace_stream import open_trace

    if args.kv_dtype not in KV_DTYPE_BYTES:
        raise PlanInputError("--kv-dtype", f"must be one of {', '.join(KV_DTYPE_BYTES)}, got {args.kv_dtype!r}")
    model = model_of(args, required=False)
    given_bt = opt(parse_count, args.trace_block_tokens, "--trace-block-tokens")
    engine_bt = parse_count(args.engine_block_tokens, "--engine-block-tokens")
    if args.save_trace and _same_file(args.save_trace, args.trace):
        raise PlanInputError("--save-trace", f"{args.save_trace} is the input trace: writing it would replace "
                                             "the input; give another file")
    # Sampling, saving and fleets take the trace in memory; a replay reads it at each pass.
    whole = args.sample is not None or bool(args.save_trace) or args.instances is not None
    trace: TraceSource
    try:
        trace = read_trace(args.trace, given_bt) if whole else open_trace(args.trace, given_bt)
    except TraceError as e:
        raise PlanInputError("--trace", str(e)) from None
    if args.sample is not None:
        assert isinstance(trace, Trace)
        from vllm_kvtier.ops.trace_sim import make_trace, sample_conversations, trace_records

        frac = parse_positive(args.sample, "--sample", upper=1.0)
        kept = sample_conversations(trace_records(trace), frac)
        if not kept:
            raise PlanInputError("--sample", f"{args.sample} of the conversations keeps no request")
        trace = dataclasses.replace(make_trace(kept, trace.block_tokens), block_tokens_source=trace.block_tokens_source)
    if args.save_trace:
        from vllm_kvtier.ops.trace_sim import trace_records

        assert isinstance(trace, Trace)
        try:
            with open(args.save_trace, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in trace_records(trace))
        except OSError as e:
            raise PlanInputError("--save-trace", f"cannot write {args.save_trace}: {e.strerror}") from None
        print(f"trace: {len(trace):,} requests written to {args.save_trace} ({trace.block_tokens}-token blocks)",
              file=sys.stderr)
    bpt = None if model is None else kv_bytes_per_token(model, args.kv_dtype)
    block_bytes = None if bpt is None else bpt * trace.block_tokens
    cfg = parse_kvtier_config(args) if (args.extra or args.file or args.preset) else None
    cpu_blocks = _blocks_opt(args.cpu_blocks, "--cpu-blocks", block_bytes)
    if cpu_blocks is None and args.sweep and cfg is None:
        cpu_blocks = _int_list(args.sweep_cpu_blocks, "--sweep-cpu-blocks")[0]  # the sweep sets it
    if cpu_blocks is None:
        if cfg is None:
            raise PlanInputError("--cpu-blocks", "required without a kvtier config (--file, --preset or "
                                                 "--extra-config with the model)")
        if block_bytes is None:
            raise PlanInputError("--model-config", "the config's capacities are bytes: give the model, or --cpu-blocks")
        cpu_blocks = cpu_blocks_from_config(
            cfg, block_bytes, opt(parse_size, args.dram_bytes, "--dram-bytes"),
            parse_size(args.dram_reserved_bytes, "--dram-reserved-bytes", allow_zero=True))
    lower = []
    for name in ("nvme", "s3"):
        section = getattr(cfg, name) if cfg is not None else None
        raw = getattr(args, f"{name}_blocks")
        if raw == "unbounded" and name != "s3":
            raise PlanInputError("--nvme-blocks", "an NVMe tier has a size")
        size = None if raw == "unbounded" else _blocks_opt(raw, f"--{name}-blocks", block_bytes)
        if size is None and section is not None and section.capacity_bytes is not None:
            if block_bytes is None:
                raise PlanInputError("--model-config", f"{name}.capacity_bytes is bytes: give the model, or "
                                                       f"--{name}-blocks")
            size = section.capacity_bytes // block_bytes
        unbounded = name == "s3" and (raw == "unbounded" or (section is not None and size is None))
        if size is None and not unbounded:
            continue
        lower.append(lower_tier(name, size, trace_block_tokens=trace.block_tokens, engine_block_tokens=engine_bt,
                                block_bytes=block_bytes or 0, cfg=section, eviction=args.nvme_eviction))
    if args.nvme_eviction and not any(t.name == "nvme" for t in lower) and not (args.sweep and args.sweep_nvme_blocks):
        raise PlanInputError("--nvme-eviction", "no NVMe tier to replay: give --nvme-blocks or a config with nvme")
    eviction = args.cpu_eviction or (cfg.cpu.eviction if cfg is not None else "kvaware")
    step_blocks = max(1, parse_count(args.step_tokens, "--step-tokens") // trace.block_tokens)
    setup = TierSetup(cpu_blocks=cpu_blocks, cpu_eviction=eviction, lower=tuple(lower), block_bytes=block_bytes or 0,
                      step_blocks=step_blocks, save_partial_blocks=trace.block_tokens > engine_bt)
    pcie = parse_positive(args.pcie_gb_per_s, "--pcie-gb-per-s") * 1e9
    hardware = None
    if args.prefill_tokens_per_s is not None:
        hardware = Hardware(parse_positive(args.prefill_tokens_per_s, "--prefill-tokens-per-s"), {
            "cpu": pcie,
            "nvme": min(pcie, parse_positive(args.nvme_gb_per_s, "--nvme-gb-per-s") * 1e9),
            "s3": min(pcie, parse_positive(args.s3_gb_per_s, "--s3-gb-per-s") * 1e9)})
    # The drive: --ssd-bytes, else the NVMe tier as planned (--nvme-blocks overrides a preset).
    ssd = opt(parse_size, args.ssd_bytes, "--ssd-bytes")
    if ssd is None and block_bytes is not None:
        ssd = next((t.capacity_blocks * block_bytes for t in lower if t.name == "nvme" and t.capacity_blocks), None)
    if ssd is None and cfg is not None and cfg.nvme is not None:
        ssd = cfg.nvme.capacity_bytes
    prices = Prices(parse_positive(args.s3_put_usd_per_1000, "--s3-put-usd-per-1000"),
                    parse_positive(args.s3_get_usd_per_1000, "--s3-get-usd-per-1000"))
    if args.instances is not None:  # a fleet of these instances (vllm_kvtier/ops/fleet_sim.py)
        from vllm_kvtier.ops.fleet_cli import run_fleet

        assert isinstance(trace, Trace)
        return run_fleet(args, trace, setup, prices, engine_block_tokens=engine_bt,
                         rescan_interval_s=cfg.s3.rescan_interval_s if cfg is not None and cfg.s3 is not None else 60.0)
    if args.sweep:
        cpu_sizes = _int_list(args.sweep_cpu_blocks, "--sweep-cpu-blocks")
        nvme_sizes: list[int | None] = [None, *_int_list(args.sweep_nvme_blocks, "--sweep-nvme-blocks")] \
            if args.sweep_nvme_blocks else [None]
        base = lower_tier("nvme", None, trace_block_tokens=trace.block_tokens, engine_block_tokens=engine_bt,
                          block_bytes=block_bytes or 0, cfg=cfg.nvme if cfg is not None else None,
                          eviction=args.nvme_eviction)
        rows = sweep(trace, setup, cpu_sizes, nvme_sizes, base)
        infinite = simulate_infinite(trace).hit_share
        png = None if args.json else render_sweep_png(rows, infinite, args.png)
        if args.json:
            print(json.dumps({"infinite": infinite, "rows": rows}, indent=2))
        else:
            print(render_sweep(rows, infinite))
            print(f"chart: {png}" if png else
                  "chart: not drawn (matplotlib is not installed: pip install 'vllm-kvtier[plot]'); the table has "
                  "the figures")
        return 0
    plan = make_trace_plan(TracePlanInput(
        trace=trace, setup=setup, trace_path=args.trace,
        bytes_per_token=bpt, model_name=model.name if model is not None else "", ssd_bytes=ssd, prices=prices,
        hardware=hardware))
    print(json.dumps(trace_plan_to_dict(plan), indent=2) if args.json else render_trace_plan(plan))
    return 0
