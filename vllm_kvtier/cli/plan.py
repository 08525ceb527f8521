"""``kvtier plan``: the KV size of a model tier by tier (:mod:`vllm_kvtier.ops.capacity`),
or, with ``--trace``, the tiers replayed on a trace (:mod:`vllm_kvtier.cli.plan_trace`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from vllm_kvtier.cli.options import SIZE_HELP, add_hw_args, add_model_args, common_options, opt, subcommand
from vllm_kvtier.cli.plan_trace import add_trace_args, run_plan_trace
from vllm_kvtier.ops.capacity import PlanInput, gpu_kv_budget, make_plan
from vllm_kvtier.ops.plan_render import plan_to_dict, render_plan
from vllm_kvtier.ops.units import PlanInputError, parse_positive, parse_size


def add_command(sub: Any) -> None:
    plan = subcommand(sub, "plan", "KV size per token and request, and what fits in each tier",
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
    add_model_args(plan)
    add_hw_args(plan)
    g = plan.add_argument_group("tiers")
    g.add_argument("--dram-bytes", help=f"server DRAM, {SIZE_HELP}")
    g.add_argument("--dram-reserved-bytes", default="0", help="DRAM kept by the OS, workers, others (default 0)")
    g.add_argument("--cpu-fraction", default="0.5", help="share of the rest for the CPU tier (default 0.5)")
    g.add_argument("--nvme-bytes", help=f"NVMe space for the tier, {SIZE_HELP}")
    g.add_argument("--nvme-gb-per-s", default="7", help="NVMe read bandwidth, GB/s (default 7)")
    g.add_argument("--s3-gb-per-s", default="1.25", help="object-store bandwidth, GB/s (default 1.25 = 10 Gbit/s)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_trace_args(plan)
    from vllm_kvtier.ops.fleet_cli import add_fleet_args

    add_fleet_args(plan)


def run(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return run_plan_trace(args)
    c = common_options(args, require_model=True)
    gpu_kv = c["gpu_kv_bytes"]
    if gpu_kv is None and c["gpu_memory_bytes"] is not None:
        gpu_kv = gpu_kv_budget(c["gpu_memory_bytes"], c["gpu_util"], c["weights_bytes"] or 0)
        if gpu_kv <= 0:
            raise PlanInputError("--weights-bytes", "leave no GPU memory for KV (--gpu-util x --gpu-memory-bytes)")
    inp = PlanInput(
        model=c["model"], kv_dtype=c["kv_dtype"], context_tokens=c["context_tokens"],
        concurrency=c["concurrency"], gpu_kv_bytes=gpu_kv,
        dram_bytes=opt(parse_size, args.dram_bytes, "--dram-bytes"),
        dram_reserved_bytes=parse_size(args.dram_reserved_bytes, "--dram-reserved-bytes", allow_zero=True),
        cpu_fraction=parse_positive(args.cpu_fraction, "--cpu-fraction", upper=0.9),
        nvme_bytes=opt(parse_size, args.nvme_bytes, "--nvme-bytes"),
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
