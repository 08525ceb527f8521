"""``kvtier``: operator commands.

    kvtier presets                         list the shipped presets
    kvtier check-config '<extra json>'     validate kv_connector_extra_config (or --file X.yaml)
    kvtier plan --model-config config.json --context-tokens 128K ...
                                           KV size per token and request, tier by tier
    kvtier doctor '<extra json>' --model-config config.json --context-tokens 128K ...
                                           the pre-deployment checklist: PASS / WARN / FAIL

Exit status: 0 when valid (doctor: no FAIL), 1 when doctor found a FAIL, 2 with the
offending field, option or file named when the input is bad.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

import yaml

from vllm_kvtier.config import KVTierConfig, available_presets, parse_config
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.plan import (
    KV_DTYPE_BYTES,
    KVModel,
    PlanInput,
    PlanInputError,
    gpu_kv_budget,
    make_plan,
    model_from_dims,
    parse_positive,
    parse_size,
    parse_tokens,
    plan_to_dict,
    read_model_config,
    render_plan,
)

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


def _int(text: str, option: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise PlanInputError(option, f"not an integer: {text!r}") from None
    if n <= 0:
        raise PlanInputError(option, f"must be a positive integer, got {n}")
    return n


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
    layers, kv_heads, head_dim = (_int(v, k) for k, v in dims.items() if v is not None)
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
        concurrency=_int(args.concurrency, "--concurrency"),
        gpu_memory_bytes=mem, gpu_util=parse_positive(args.gpu_util, "--gpu-util", upper=1.0),
        weights_bytes=_opt(parse_size, args.weights_bytes, "--weights-bytes", allow_zero=True),
        gpu_kv_bytes=_opt(parse_size, args.gpu_kv_bytes, "--gpu-kv-bytes"),
        pcie_bytes_per_s=parse_positive(args.pcie_gb_per_s, "--pcie-gb-per-s") * 1e9,
        prefill_tokens_per_s=_opt(parse_positive, args.prefill_tokens_per_s, "--prefill-tokens-per-s"),
    )


def _run_plan(args: argparse.Namespace) -> int:
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


def _parse_kvtier_config(args: argparse.Namespace) -> KVTierConfig:
    try:
        extra = json.loads(args.extra) if args.extra else {}
    except json.JSONDecodeError as e:
        raise PlanInputError("kv_connector_extra_config", f"not valid JSON: {e}") from None
    if args.file:
        extra = {**extra, "config_file": args.file}
    if getattr(args, "preset", None):
        extra = {**extra, "preset": args.preset}
    return parse_config(extra)


def _run_doctor(args: argparse.Namespace) -> int:
    from vllm_kvtier.doctor import Status, Target, checks_to_dict, probe_machine, render_checks, run_checks

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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("presets", help="list the shipped presets")
    chk = sub.add_parser("check-config", help="validate kv_connector_extra_config")
    chk.add_argument("extra", nargs="?", help="the JSON of kv_connector_extra_config")
    chk.add_argument("--file", help="a YAML file with the same fields")

    plan = sub.add_parser("plan", help="KV size per token and request, and what fits in each tier",
                          description="The KV-size formula for one model, context length and "
                                      "concurrency, against GPU, CPU DRAM, NVMe and S3; load vs recompute time.")
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

    doc = sub.add_parser("doctor", help="pre-deployment checklist for a config on this machine",
                         description="The pre-deployment checklist against a kvtier config and this machine. Each "
                                     "line is PASS, WARN or FAIL; exit status 1 if any FAIL.")
    doc.add_argument("extra", nargs="?", help="the JSON of kv_connector_extra_config")
    doc.add_argument("--file", help="a YAML file with the same fields")
    doc.add_argument("--preset", help=f"a shipped preset ({', '.join(available_presets())})")
    _add_model_args(doc)
    _add_hw_args(doc)
    doc.add_argument("--ttft-slo-s", help="time-to-first-token target, seconds")
    doc.add_argument("--workload", choices=["interactive", "long-context", "batch"], help="what is served")
    doc.add_argument("--prometheus-rules", metavar="PATH", help="alert rules file (Prometheus or PrometheusRule)")
    doc.add_argument("--json", action="store_true", help="print JSON instead of text")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "presets":
        for p in available_presets():
            print(p)
        return 0
    if args.cmd in ("plan", "doctor"):
        try:
            return _run_plan(args) if args.cmd == "plan" else _run_doctor(args)
        except (PlanInputError, ConfigError) as e:
            print(f"kvtier {args.cmd}: {e}", file=sys.stderr)
            return 2
    try:
        extra = json.loads(args.extra) if args.extra else {}
        if args.file:
            extra = {**extra, "config_file": args.file}
        cfg = parse_config(extra)
    except json.JSONDecodeError as e:
        print(f"kvtier: not valid JSON: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"kvtier: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
