"""A capacity plan (:class:`~vllm_kvtier.ops.capacity.Plan`) as ``kvtier plan`` prints it:
text, or JSON-ready data with the units in the keys."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_kvtier.ops.capacity import CPU_BUDGET_RANGE, KV_DTYPE_BYTES, CPUBudget, HostOverhead, Plan
from vllm_kvtier.ops.units import exact_bytes, human_bytes


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f} s" if s < 100 else f"{s:,.0f} s"


def _rate(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e9:g} GB/s"


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data: bytes, bytes per second and seconds, units in the keys."""
    out: dict[str, Any] = dataclasses.asdict(plan)
    out["concurrent_gpu_bytes"] = plan.inp.concurrency * plan.request.gpu_bytes
    out["units"] = {"GB": 10**9, "GiB": 2**30}
    return out


def _gpu_summary(plan: Plan) -> str:
    gpu, n, per = plan.tiers[0], plan.inp.concurrency, plan.request.gpu_bytes
    if gpu.requests_fit is None or gpu.capacity_bytes is None:
        return "GPU: give --gpu-memory-bytes (and --weights-bytes) or --gpu-kv-bytes to size it"
    if gpu.requests_fit == 0:
        return ("GPU: not one request fits in the KV budget, so vLLM refuses this context length "
                "(more GPUs, a shorter context or FP8 KV)")
    use = f"{n * per / gpu.capacity_bytes:.0%}"
    if gpu.requests_fit < n:
        return (f"GPU: {gpu.requests_fit} of the {n} requests fit at once; the others wait or are preempted "
                "(their KV swapped out to the tiers below)")
    warn = " (above 90% is dangerous)" if n * per > 0.9 * gpu.capacity_bytes else ""
    return f"GPU: all {n} requests fit, {use} of the KV budget{warn}"


def _cpu_lines(b: CPUBudget) -> list[str]:
    lo, hi = CPU_BUDGET_RANGE
    return [
        f"CPU budget  {human_bytes(b.available_bytes)} of DRAM after the reserved part; "
        f"{lo:.0%}-{hi:.0%} of it: {human_bytes(b.low_bytes)} to {human_bytes(b.high_bytes)}",
        f"configure   cpu.capacity_bytes: {b.capacity_bytes}   ({b.fraction:g} of it; or cpu.capacity_fraction: "
        f"{b.fraction:g}, taken of the DRAM available when the engine starts)",
    ]


def render_plan(plan: Plan) -> str:
    """The plan as the text ``kvtier plan`` prints."""
    inp, req, m = plan.inp, plan.request, plan.inp.model
    lines = [
        f"Model      {m.name}: {m.attention}, {m.shape}",
        f"KV dtype   {inp.kv_dtype} ({KV_DTYPE_BYTES[inp.kv_dtype]} B per value); context {inp.context_tokens:,} "
        f"tokens; {inp.concurrency} concurrent request(s)",
        "Units      GB = 10^9 bytes, GiB = 2^30 bytes",
        "",
        f"KV per token           {exact_bytes(plan.bytes_per_token)}",
        f"KV per request         {exact_bytes(req.model_bytes)}",
    ]
    if req.gpu_bytes != req.model_bytes:
        lines.append(f"  as vLLM allocates it {exact_bytes(req.gpu_bytes)}")
    if req.stored_bytes != req.model_bytes:
        lines.append(f"  a tier stores <=     {exact_bytes(req.stored_bytes)}")
    lines.append(f"{f'KV for {inp.concurrency} requests':<22} {exact_bytes(inp.concurrency * req.gpu_bytes)}")
    lines += ["", f"{'tier':<5} {'capacity':<26} {'fits':>6}  {'link':<11} load one request"]
    for r in plan.tiers:
        cap = "unbounded" if r.unbounded else "not given" if r.capacity_bytes is None else human_bytes(
            r.capacity_bytes)
        fits = "-" if r.requests_fit is None else f"{r.requests_fit:,}"
        lines.append(f"{r.tier:<5} {cap:<26} {fits:>6}  {_rate(r.link_bytes_per_s):<11} {_seconds(r.load_s)}")
    if plan.recompute_s is None:
        lines.append("recompute: give --prefill-tokens-per-s to compare loading with recomputing")
    else:
        lines.append(f"recompute {inp.context_tokens:,} tokens at {inp.prefill_tokens_per_s:,.0f} tokens/s: "
                     f"{_seconds(plan.recompute_s)}")
    lines += ["", _gpu_summary(plan)]
    if plan.cpu_budget is None:
        lines.append("CPU budget: give --dram-bytes (and --dram-reserved-bytes) to size it")
    else:
        lines += _cpu_lines(plan.cpu_budget)
    if plan.host_overhead is not None:
        lines += ["", *_overhead_lines(plan.host_overhead)]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _overhead_lines(h: HostOverhead) -> list[str]:
    out = [f"Host memory outside the CPU budget (reserve it with the OS and workers; at block size "
           f"{h.block_tokens}):",
           f"  idle transfer buffers  up to {human_bytes(h.idle_per_worker_bytes)} per worker process "
           "(one per TP rank)"]
    for tier, (queue, blocks, nbytes) in h.writes_in_flight.items():
        out.append(f"  {tier + ' writes queued':<22} up to {human_bytes(nbytes)} ({tier}.max_queued_writes {queue} "
                   f"x chunks of {blocks} blocks)")
    return out
