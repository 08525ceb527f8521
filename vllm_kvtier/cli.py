"""``kvtier``: operator commands.

    kvtier presets                         list the shipped presets
    kvtier check-config '<extra json>'     validate kv_connector_extra_config (or --file X.yaml)
    kvtier plan --model-config config.json --context-tokens 128K ...
                                           KV size per token and request, tier by tier
    kvtier plan --trace FILE --cpu-blocks N [--nvme-blocks N] [--s3-blocks unbounded] [--sweep] ...
                                           replay a request trace through the plugin's tiers
    kvtier doctor '<extra json>' --model-config config.json --context-tokens 128K ...
                                           the pre-deployment checklist: PASS / WARN / FAIL
    kvtier bench [NAMES...] [--quick] [--report-only]
                                           run the benchmarks under bench/ (source checkout),
                                           a table of ratios against targets and a PNG chart

Exit status: 0 when valid (doctor: no FAIL; bench: every run finished and no FAIL), 1 when
doctor or bench found a FAIL, 2 with the offending field, option or file named when the
input is bad.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from vllm_kvtier import __version__
from vllm_kvtier.config import PRESET_DIR, KVTierConfig, available_presets, parse_config
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.ops.capacity import KV_DTYPE_BYTES, PlanInput, gpu_kv_budget, kv_bytes_per_token, make_plan
from vllm_kvtier.ops.model_shape import KVModel, model_from_dims, read_model_config
from vllm_kvtier.ops.plan_render import plan_to_dict, render_plan
from vllm_kvtier.ops.units import PlanInputError, parse_count, parse_positive, parse_size, parse_tokens
from vllm_kvtier.sysmem import budget_overrun
from vllm_kvtier.tiers.auth import check_key_files

_SIZE_HELP = "bytes, or with a unit: 80GB (10^9), 80GiB (2^30)"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a config.json, or the three dimensions)")
    g.add_argument("--model-config", metavar="PATH", help="a local config.json (or its directory); no hub access")
    g.add_argument("--layers", help="number of attention layers")
    g.add_argument("--kv-heads", help="KV heads (num_key_value_heads; 1 for MQA)")
    g.add_argument("--head-dim", help="head dimension")
    g.add_argument("--kv-dtype", default="bf16", help=f"KV cache dtype: {', '.join(KV_DTYPE_BYTES)} (default bf16)")
    g.add_argument("--context-tokens", help="context length per request: 131072, 128K (= 131072) or 1M")
    g.add_argument("--concurrency", default="1", help="concurrent requests of that length (default 1)")


def _add_hw_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("GPU and links")
    g.add_argument("--gpu-memory-bytes", help=f"HBM of the GPUs serving one replica, {_SIZE_HELP}")
    g.add_argument("--gpu-util", default="0.9", help="vLLM --gpu-memory-utilization (default 0.9)")
    g.add_argument("--weights-bytes", help=f"model weights on those GPUs, {_SIZE_HELP}")
    g.add_argument("--gpu-kv-bytes", help="the GPU KV budget itself (vLLM logs it), instead of the three above")
    g.add_argument("--pcie-gb-per-s", default="64", help="GPU<->CPU link, GB/s (default 64: PCIe 5.0 x16)")
    g.add_argument("--prefill-tokens-per-s", help="prefill rate, to compare loading with recomputing")


def _opt(parse: Any, text: str | None, option: str, **kw: Any) -> Any:
    return None if text is None else parse(text, option, **kw)


def _model(args: argparse.Namespace, required: bool) -> KVModel | None:
    dims = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    if args.model_config is not None:
        if any(v is not None for v in dims.values()):
            raise PlanInputError("--model-config", "give it or --layers/--kv-heads/--head-dim, not both")
        return read_model_config(args.model_config)
    missing = [k for k, v in dims.items() if v is None]
    if missing == list(dims) and not required:
        return None
    if missing:
        raise PlanInputError(missing[0], "required (or give --model-config)")
    layers, kv_heads, head_dim = (parse_count(v, k) for k, v in dims.items() if v is not None)
    return model_from_dims(layers, kv_heads, head_dim)


def _common(args: argparse.Namespace, *, require_model: bool) -> dict[str, Any]:
    """The options plan and doctor share, parsed and checked."""
    if args.kv_dtype not in KV_DTYPE_BYTES:
        raise PlanInputError("--kv-dtype", f"must be one of {', '.join(KV_DTYPE_BYTES)}, got {args.kv_dtype!r}")
    model = _model(args, require_model)
    context = _opt(parse_tokens, args.context_tokens, "--context-tokens")
    if model is not None and context is None:
        raise PlanInputError("--context-tokens", "required to size a request")
    mem = _opt(parse_size, args.gpu_memory_bytes, "--gpu-memory-bytes")
    return dict(
        model=model, kv_dtype=args.kv_dtype, context_tokens=context,
        concurrency=parse_count(args.concurrency, "--concurrency"),
        gpu_memory_bytes=mem, gpu_util=parse_positive(args.gpu_util, "--gpu-util", upper=1.0),
        weights_bytes=_opt(parse_size, args.weights_bytes, "--weights-bytes", allow_zero=True),
        gpu_kv_bytes=_opt(parse_size, args.gpu_kv_bytes, "--gpu-kv-bytes"),
        pcie_bytes_per_s=parse_positive(args.pcie_gb_per_s, "--pcie-gb-per-s") * 1e9,
        prefill_tokens_per_s=_opt(parse_positive, args.prefill_tokens_per_s, "--prefill-tokens-per-s"),
    )


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


def _run_plan_trace(args: argparse.Namespace) -> int:
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
    model = _model(args, required=False)
    given_bt = _opt(parse_count, args.trace_block_tokens, "--trace-block-tokens")
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
    cfg = _parse_kvtier_config(args) if (args.extra or args.file or args.preset) else None
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
            cfg, block_bytes, _opt(parse_size, args.dram_bytes, "--dram-bytes"),
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
                                block_bytes=block_bytes or 0, cfg=section))
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
    ssd = _opt(parse_size, args.ssd_bytes, "--ssd-bytes")
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
                          block_bytes=block_bytes or 0, cfg=cfg.nvme if cfg is not None else None)
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


def _run_plan(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return _run_plan_trace(args)
    c = _common(args, require_model=True)
    gpu_kv = c["gpu_kv_bytes"]
    if gpu_kv is None and c["gpu_memory_bytes"] is not None:
        gpu_kv = gpu_kv_budget(c["gpu_memory_bytes"], c["gpu_util"], c["weights_bytes"] or 0)
        if gpu_kv <= 0:
            raise PlanInputError("--weights-bytes", "leave no GPU memory for KV (--gpu-util x --gpu-memory-bytes)")
    inp = PlanInput(
        model=c["model"], kv_dtype=c["kv_dtype"], context_tokens=c["context_tokens"],
        concurrency=c["concurrency"], gpu_kv_bytes=gpu_kv,
        dram_bytes=_opt(parse_size, args.dram_bytes, "--dram-bytes"),
        dram_reserved_bytes=parse_size(args.dram_reserved_bytes, "--dram-reserved-bytes", allow_zero=True),
        cpu_fraction=parse_positive(args.cpu_fraction, "--cpu-fraction", upper=0.9),
        nvme_bytes=_opt(parse_size, args.nvme_bytes, "--nvme-bytes"),
        pcie_bytes_per_s=c["pcie_bytes_per_s"],
        nvme_bytes_per_s=parse_positive(args.nvme_gb_per_s, "--nvme-gb-per-s") * 1e9,
        s3_bytes_per_s=parse_positive(args.s3_gb_per_s, "--s3-gb-per-s") * 1e9,
        prefill_tokens_per_s=c["prefill_tokens_per_s"],
    )
    if inp.dram_bytes is not None and inp.dram_reserved_bytes >= inp.dram_bytes:
        raise PlanInputError("--dram-reserved-bytes", "must be less than --dram-bytes")
    plan = make_plan(inp)
    if inp.gpu_kv_bytes is not None and args.gpu_kv_bytes is None and c["weights_bytes"] is None:
        plan = dataclasses.replace(plan, notes=(*plan.notes, "GPU capacity: weights not subtracted "
                                                              "(give --weights-bytes)"))
    print(json.dumps(plan_to_dict(plan), indent=2) if args.json else render_plan(plan))
    return 0


#: Keys of vLLM's --kv-transfer-config (KVTransferConfig) that mark a JSON as the whole flag.
_TRANSFER_KEYS = ("kv_connector", "kv_connector_extra_config", "kv_role", "kv_load_failure_policy")


def _extra_of_transfer_config(obj: dict[str, Any]) -> dict[str, Any]:
    """``kv_connector_extra_config``, from itself or from the whole ``--kv-transfer-config``
    JSON as pasted from a ``vllm serve`` line; warns where that JSON would trip vLLM."""
    if not any(k in obj for k in _TRANSFER_KEYS):
        return obj
    connector = obj.get("kv_connector")
    if connector not in (None, "KVTierConnector"):
        raise ConfigError("kv_connector", f"must be 'KVTierConnector' for this plugin, got {connector!r}")
    policy = obj.get("kv_load_failure_policy", "fail")
    if policy != "recompute":
        print(f"kvtier: warning: kv_load_failure_policy is {policy!r}: a block that cannot be loaded fails its "
              "request; set \"kv_load_failure_policy\":\"recompute\"", file=sys.stderr)
    extra = obj.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config", f"must be a JSON object, not {type(extra).__name__}")
    return extra


def _parse_kvtier_config(args: argparse.Namespace) -> KVTierConfig:
    try:
        extra = json.loads(args.extra) if args.extra else {}
    except json.JSONDecodeError as e:
        raise PlanInputError("kv_connector_extra_config", f"not valid JSON: {e}") from None
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config", f"must be a JSON object, not {type(extra).__name__}")
    extra = _extra_of_transfer_config(extra)
    if args.file:
        extra = {**extra, "config_file": args.file}
    if getattr(args, "preset", None):
        extra = {**extra, "preset": args.preset}
    return parse_config(extra)


def _run_doctor(args: argparse.Namespace) -> int:
    from vllm_kvtier.doctor import checks_to_dict, render_checks, run_checks
    from vllm_kvtier.doctor.base import Status, Target
    from vllm_kvtier.doctor.probe import probe_machine

    cfg = _parse_kvtier_config(args)
    c = _common(args, require_model=False)
    target = Target(
        model=c["model"], kv_dtype=c["kv_dtype"], context_tokens=c["context_tokens"],
        concurrency=c["concurrency"], gpu_util=c["gpu_util"], weights_bytes=c["weights_bytes"],
        gpu_kv_bytes=c["gpu_kv_bytes"], pcie_bytes_per_s=c["pcie_bytes_per_s"],
        prefill_tokens_per_s=c["prefill_tokens_per_s"],
        ttft_slo_s=_opt(parse_positive, args.ttft_slo_s, "--ttft-slo-s"),
        workload=args.workload, prometheus_rules=args.prometheus_rules,
    )
    # A given KV budget needs no GPU: do not import torch for nothing.
    machine = probe_machine(cfg, c["gpu_memory_bytes"], detect_gpu=c["gpu_kv_bytes"] is None)
    checks = run_checks(cfg, target, machine)
    print(json.dumps(checks_to_dict(checks), indent=2) if args.json else render_checks(checks))
    return 1 if any(ch.status is Status.FAIL for ch in checks) else 0


_DESCRIPTION = """\
Operator commands for vllm_kvtier, the vLLM KV-connector plugin that tiers the KV cache to CPU
DRAM, NVMe, S3 and Mooncake: check a kv_connector_extra_config before deploying it, size the KV
cache of a model tier by tier, run the pre-deployment checklist on this machine, and run the
benchmarks of a source checkout. 'kvtier COMMAND --help' explains each command, with examples."""

_EPILOG = """\
examples:
  kvtier presets
  kvtier check-config '{"preset": "interactive", "cpu": {"capacity_bytes": 34359738368}}'
  kvtier plan --model-config ./Llama-3-70B/config.json --context-tokens 128K --kv-dtype fp8
  kvtier doctor --preset interactive --model-config ./config.json --context-tokens 32K --ttft-slo-s 2
  kvtier bench --quick

exit status: 0 when all is well, 1 when doctor or bench found a FAIL, 2 when the input is bad
(the message names the field, option or file)."""


def _sub(sub: Any, name: str, help_: str, description: str, examples: str) -> argparse.ArgumentParser:
    """A subcommand whose --help shows a paragraph of description and an epilog of examples."""
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=help_, description=description, epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    return p


#: ``kvtier bench``'s report module, in the source checkout beside the package: ``bench/`` holds the
#: scripts and their report and is not in the wheel.
BENCH_REPORT = Path(__file__).resolve().parent.parent / "bench" / "benchreport.py"


def _no_bench() -> str:
    return (f"no source checkout here ({BENCH_REPORT} is missing; bench/ is not in the wheel): kvtier bench "
            "runs the benchmark scripts of a checkout, so clone the repository and pip install -e . there")


def _bench_report() -> ModuleType | None:
    """``bench/benchreport.py`` of the checkout this package runs from, loaded once under the name
    the tests and scripts import it by (``bench.benchreport``); None when there is no checkout."""
    if not BENCH_REPORT.is_file():
        return None
    name = "bench.benchreport"
    mod = sys.modules.get(name)
    if mod is not None and Path(mod.__file__ or "").resolve() == BENCH_REPORT:
        return mod
    spec = importlib.util.spec_from_file_location(name, BENCH_REPORT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


_BENCH_EXAMPLES = (
    "  kvtier bench                             # the fast ones, a minute or two\n"
    "  kvtier bench --quick                     # the same, smaller sizes, a few seconds each\n"
    "  kvtier bench all                         # every benchmark (tens of minutes on CPU)\n"
    "  kvtier bench ttft trace_replay --quick\n"
    "  kvtier bench --report-only               # just the table and chart from bench/results\n"
    "  kvtier bench --report-only --results-dir /tmp/r --png /tmp/r/chart.png")


def _add_bench(sub: Any) -> None:
    br = _bench_report()
    if br is None:  # an installed wheel: the command is listed, and says why it cannot run
        b = _sub(sub, "bench", "run the benchmarks under bench/ (a source checkout's; none here)",
                 _no_bench(), _BENCH_EXAMPLES)
    else:
        listing = "\n".join(f"  {s.name:<20} {s.about}{'' if s.fast else ' (minutes)'}" for s in br.BENCHMARKS)
        b = _sub(sub, "bench", "run the benchmarks under bench/ and chart their ratios against the targets",
                 "Runs the benchmark scripts of a source checkout (bench/ is not in the wheel) one after the\n"
                 "other, each as a subprocess of this Python, with a progress line each (the script's own\n"
                 "output goes to <results-dir>/<name>.log). Then reads their JSONs and prints one row per\n"
                 "headline ratio (ours over the reference) with its target and PASS / FAIL / — (no target,\n"
                 "or not run), and draws the same ratios as a PNG bar chart. Compare ratios of one run: the\n"
                 "absolute figures depend on the machine and its load.\n\n"
                 f"benchmarks (default: {', '.join(br.FAST)};\n'all' runs every one, with those that start vLLM "
                 "engines):\n" + listing,
                 _BENCH_EXAMPLES)
    b.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: the fast ones; 'all')")
    b.add_argument("--quick", action="store_true",
                   help="pass each script its smaller-size options (fewer repeats, fewer MiB or tokens)")
    b.add_argument("--results-dir", metavar="DIR", help="where the JSONs and logs go (default: bench/results)")
    b.add_argument("--png", metavar="FILE", help="the chart (default: <results-dir>/summary.png)")
    b.add_argument("--report-only", action="store_true",
                   help="run nothing: render the table and chart from the JSONs already there (default: all of them)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier", description=_DESCRIPTION, epilog=_EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _sub(sub, "presets", "list the shipped presets",
         "Lists the presets shipped with the plugin (interactive, long-context, offline-batch, ...), one per\n"
         "line with what it is for. A preset fills in every field of kv_connector_extra_config for one kind of workload; fields\n"
         "you set yourself override it. 'kvtier check-config' shows what a preset expands to.",
         "  kvtier presets\n"
         "  kvtier check-config '{\"preset\": \"long-context\"}'")
    chk = _sub(sub, "check-config", "validate kv_connector_extra_config and print it in full",
               "Parses a kv_connector_extra_config exactly as the connector will at start-up, preset and\n"
               "defaults applied, and prints the result as YAML. A bad value exits 2 with the field named\n"
               "and the values it allows, before any engine is started.",
               "  kvtier check-config '{\"preset\": \"interactive\", \"cpu\": {\"capacity_bytes\": 1073741824}}'\n"
               "  kvtier check-config --file configs/long-context.yaml\n"
               "  kvtier check-config --preset long-context '{\"nvme\": {\"capacity_bytes\": \"2TB\"}}'\n"
               "  kvtier check-config '{\"kv_connector\": \"KVTierConnector\", \"kv_role\": \"kv_both\", "
               "\"kv_connector_extra_config\": {\"preset\": \"interactive\"}}'\n"
               "  kvtier check-config '{\"cpu\": {\"capacity_bytes\": 68719476736}}' --file configs/long-context.yaml")
    chk.add_argument("extra", nargs="?", help="the JSON of kv_connector_extra_config, or the whole "
                                              "--kv-transfer-config JSON")
    chk.add_argument("--file", help="a YAML file with the same fields")
    chk.add_argument("--preset", help=f"a shipped preset ({', '.join(available_presets())})")

    plan = _sub(sub, "plan", "KV size per token and request, and what fits in each tier",
                "The KV-size formula for one model (a local config.json, or layers / KV heads / head dim),\n"
                "context length and concurrency: bytes per token and per request, how many requests of that\n"
                "length fit in GPU memory, CPU DRAM and NVMe, the time to load a request's KV from each tier\n"
                "against recomputing it, and the CPU tier budget to configure. Handles GQA, MQA, MLA and\n"
                "sliding-window models, or says which it cannot. Nothing is downloaded.\n\n"
                "With --trace FILE: replays a request trace (Mooncake/Alibaba JSONL, or prompt_token_ids) through\n"
                "the plugin's own index, eviction and admission code for each tier, and prints each tier's hit\n"
                "share with LRU and S3-FIFO, Belady's MIN and the infinite bound, SSD writes, S3 requests and\n"
                "their cost, and the TTFT saved (docs/planning.md).",
                "  kvtier plan --model-config ./Meta-Llama-3-70B/config.json --context-tokens 128K\n"
                "  kvtier plan --layers 32 --kv-heads 8 --head-dim 128 --context-tokens 32K --concurrency 16 \\\n"
                "      --gpu-memory-bytes 80GB --weights-bytes 16GB --dram-bytes 512GiB --kv-dtype fp8\n"
                "  kvtier plan --model-config config.json --context-tokens 1M --prefill-tokens-per-s 8000 --json\n"
                "  kvtier plan --trace conversation_trace.jsonl --cpu-blocks 3000 --nvme-blocks 30000\n"
                "  kvtier plan --trace my_traffic.jsonl --preset long-context --model-config config.json \\\n"
                "      --dram-bytes 512GiB --s3-blocks unbounded --prefill-tokens-per-s 10000\n"
                "  kvtier plan --trace conversation_trace.jsonl --cpu-blocks 1000 --sweep --sweep-nvme-blocks 30000")
    _add_model_args(plan)
    _add_hw_args(plan)
    g = plan.add_argument_group("tiers")
    g.add_argument("--dram-bytes", help=f"server DRAM, {_SIZE_HELP}")
    g.add_argument("--dram-reserved-bytes", default="0", help="DRAM kept by the OS, workers, others (default 0)")
    g.add_argument("--cpu-fraction", default="0.5", help="share of the rest for the CPU tier (default 0.5)")
    g.add_argument("--nvme-bytes", help=f"NVMe space for the tier, {_SIZE_HELP}")
    g.add_argument("--nvme-gb-per-s", default="7", help="NVMe read bandwidth, GB/s (default 7)")
    g.add_argument("--s3-gb-per-s", default="1.25", help="object-store bandwidth, GB/s (default 1.25 = 10 Gbit/s)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of text")
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
    from vllm_kvtier.ops.fleet_cli import add_fleet_args

    add_fleet_args(plan)

    doc = _sub(sub, "doctor", "pre-deployment checklist for a config on this machine",
               "The pre-deployment checklist against a kvtier config (JSON, --file or --preset) and this\n"
               "machine: the model's KV size at the target context, the GPU KV budget, the strategy against\n"
               "the workload, CPU offload bandwidth against the TTFT SLO, RDMA when NIXL or Mooncake RDMA is\n"
               "configured, FP8, and alerting. Each line is PASS, WARN or FAIL with the reason; exit status\n"
               "1 if any FAIL.",
               "  kvtier doctor --preset interactive --model-config ./config.json --context-tokens 32K \\\n"
               "      --ttft-slo-s 2 --workload interactive --prometheus-rules docker/prometheus/kvtier-alerts.yaml\n"
               "  kvtier doctor --file configs/long-context.yaml --layers 80 --kv-heads 8 --head-dim 128 \\\n"
               "      --context-tokens 128K --gpu-kv-bytes 40GB --json")
    doc.add_argument("extra", nargs="?", help="the JSON of kv_connector_extra_config, or the whole "
                                              "--kv-transfer-config JSON")
    doc.add_argument("--file", help="a YAML file with the same fields")
    doc.add_argument("--preset", help=f"a shipped preset ({', '.join(available_presets())})")
    _add_model_args(doc)
    _add_hw_args(doc)
    doc.add_argument("--ttft-slo-s", help="time-to-first-token target, seconds")
    doc.add_argument("--workload", choices=["interactive", "long-context", "batch"], help="what is served")
    doc.add_argument("--prometheus-rules", metavar="PATH", help="alert rules file (Prometheus or PrometheusRule)")
    doc.add_argument("--json", action="store_true", help="print JSON instead of text")
    _add_bench(sub)
    return ap


def _run_bench(args: argparse.Namespace) -> int:
    br = _bench_report()
    if br is None:
        print(f"kvtier bench: {_no_bench()}", file=sys.stderr)
        return 2
    try:
        # A report of what is there covers every benchmark (missing ones read "not run").
        names = br.resolve_names(args.names or (["all"] if args.report_only else []))
    except ValueError as e:
        raise PlanInputError("NAME", str(e)) from None
    bench_dir = br.find_bench_dir()
    if bench_dir is None and not (args.report_only and args.results_dir):
        print(f"kvtier bench: not every benchmark script is in {BENCH_REPORT.parent}: kvtier bench runs them "
              "from a source checkout (bench/ is not in the wheel), or renders JSONs you have with "
              "--report-only --results-dir DIR", file=sys.stderr)
        return 2
    if args.results_dir:
        results_dir = Path(args.results_dir)
    else:
        assert bench_dir is not None
        results_dir = bench_dir / "results"
    if args.report_only and not results_dir.is_dir():
        raise PlanInputError("--results-dir", f"no such directory: {results_dir}")
    try:
        results_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlanInputError("--results-dir", f"cannot create {results_dir}: {e.strerror}") from None
    stale: dict[str, str] = {}
    if not args.report_only:
        assert bench_dir is not None
        live = sys.stdout.isatty()
        for i, name in enumerate(names, 1):
            outcome = br.run_benchmark(br.BY_NAME[name], bench_dir, results_dir, quick=args.quick, index=i,
                                       total=len(names), out=sys.stdout, live=live)
            if outcome.failure:
                stale[name] = outcome.failure
        print()
    report = br.read_report(results_dir, names, stale)
    print(br.render_table(report))
    png = br.render_png(report, Path(args.png) if args.png else results_dir / "summary.png")
    print(f"chart: {png}")
    return 0 if report.ok else 1


def preset_description(name: str) -> str:
    """The first sentence of a preset's header comment (``# Preset "x": ...``)."""
    lines = []
    for line in (PRESET_DIR / f"{name}.yaml").read_text().splitlines():
        if not line.startswith("#") or line.strip() == "#":
            break
        lines.append(line.lstrip("# ").strip())
    text = " ".join(lines).split(":", 1)[-1].strip()
    return re.split(r"[.;](?:\s|$)", text, maxsplit=1)[0]


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`kvtier plan ... --json | head`): stop quietly. Point stdout
        # at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "presets":
        names = available_presets()
        width = max(map(len, names), default=0)
        for p in names:
            print(f"{p:<{width}}  {preset_description(p)}")
        return 0
    if args.cmd in ("plan", "doctor", "bench"):
        run = {"plan": _run_plan, "doctor": _run_doctor, "bench": _run_bench}[args.cmd]
        try:
            return run(args)
        except (PlanInputError, ConfigError) as e:
            print(f"kvtier {args.cmd}: {e}", file=sys.stderr)
            return 2
    try:
        cfg = _parse_kvtier_config(args)
        check_key_files(cfg.auth)  # the engine reads them at start-up: fail here first
    except (PlanInputError, ConfigError) as e:
        print(f"kvtier: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), end="")
    overrun = budget_overrun(cfg.cpu.capacity_bytes)
    if overrun is not None:  # the config may be meant for a bigger machine: a warning
        print(f"kvtier: warning: cpu.capacity_bytes: {overrun}; an engine on this machine would "
              "refuse to start",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
