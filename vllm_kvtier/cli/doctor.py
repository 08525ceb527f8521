"""``kvtier doctor``: the pre-deployment checklist (:mod:`vllm_kvtier.doctor`) from the
command line."""

from __future__ import annotations

import argparse
import json
from typing import Any

from vllm_kvtier.cli.configs import add_config_args, parse_kvtier_config
from vllm_kvtier.cli.options import add_hw_args, add_model_args, common_options, opt, subcommand
from vllm_kvtier.ops.units import parse_positive


def add_command(sub: Any) -> None:
    doc = subcommand(sub, "doctor", "pre-deployment checklist for a config on this machine",
                     "The pre-deployment checklist against a kvtier config (JSON, --file or --preset) and this\n"
                     "machine: the model's KV size at the target context, the GPU KV budget, the strategy against\n"
                     "the workload, CPU offload bandwidth against the TTFT SLO, RDMA when NIXL or Mooncake RDMA is\n"
                     "configured, FP8, and alerting. Each line is PASS, WARN or FAIL with the reason; exit status\n"
                     "1 if any FAIL.",
                     "  kvtier doctor --preset interactive --model-config ./config.json --context-tokens 32K \\\n"
                     "      --ttft-slo-s 2 --workload interactive --prometheus-rules docker/prometheus/kvtier-alerts.yaml\n"
                     "  kvtier doctor --file configs/long-context.yaml --layers 80 --kv-heads 8 --head-dim 128 \\\n"
                     "      --context-tokens 128K --gpu-kv-bytes 40GB --json")
    add_config_args(doc)
    add_model_args(doc)
    add_hw_args(doc)
    doc.add_argument("--ttft-slo-s", help="time-to-first-token target, seconds")
    doc.add_argument("--workload", choices=["interactive", "long-context", "batch"], help="what is served")
    doc.add_argument("--prometheus-rules", metavar="PATH", help="alert rules file (Prometheus or PrometheusRule)")
    doc.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    from vllm_kvtier.doctor import checks_to_dict, render_checks, run_checks
    from vllm_kvtier.doctor.base import Status, Target
    from vllm_kvtier.doctor.probe import probe_machine

    cfg = parse_kvtier_config(args)
    c = common_options(args, require_model=False)
    target = Target(
        model=c["model"], kv_dtype=c["kv_dtype"], context_tokens=c["context_tokens"],
        concurrency=c["concurrency"], gpu_util=c["gpu_util"], weights_bytes=c["weights_bytes"],
        gpu_kv_bytes=c["gpu_kv_bytes"], pcie_bytes_per_s=c["pcie_bytes_per_s"],
        prefill_tokens_per_s=c["prefill_tokens_per_s"],
        ttft_slo_s=opt(parse_positive, args.ttft_slo_s, "--ttft-slo-s"),
        workload=args.workload, prometheus_rules=args.prometheus_rules,
    )
    # A given KV budget needs no GPU: do not import torch for nothing.
    machine = probe_machine(cfg, c["gpu_memory_bytes"], detect_gpu=c["gpu_kv_bytes"] is None)
    checks = run_checks(cfg, target, machine)
    print(json.dumps(checks_to_dict(checks), indent=2) if args.json else render_checks(checks))
    return 1 if any(ch.status is Status.FAIL for ch in checks) else 0
