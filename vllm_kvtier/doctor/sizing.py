"""The checks of sizes: the KV of one request, and what holds it (the GPU's KV budget, the
CPU tier's DRAM, the NVMe tier's disk), with FP8 as the way to fit more."""

from __future__ import annotations

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.doctor.base import Check, Status, Target
from vllm_kvtier.doctor.probe import Machine
from vllm_kvtier.ops.capacity import CPU_BUDGET_RANGE, RequestKV, gpu_kv_budget, host_overhead, request_kv
from vllm_kvtier.ops.units import human_bytes
from vllm_kvtier.sysmem import available_memory

#: above this share of the GPU KV budget, usage is dangerous
GPU_USAGE_LIMIT = 0.9


def _pct(part: float, whole: float) -> str:
    if whole <= 0:
        return "n/a"
    return f"{part / whole:.0%}" if part < 10 * whole else f"{part / whole:,.0f}x"


def check_kv_size(t: Target, req: RequestKV | None) -> Check:
    if t.model is None or req is None:
        return Check("kv-size", Status.WARN, "no model given (--model-config or --layers/--kv-heads/--head-dim "
                                             "and --context-tokens): KV size not computed")
    extra = "" if req.gpu_bytes == req.model_bytes else f" (vLLM allocates {human_bytes(req.gpu_bytes)})"
    return Check("kv-size", Status.PASS,
                 f"{t.model.name} {t.kv_dtype}: {req.tokens:,}-token request = {req.model_bytes:,} B "
                 f"({human_bytes(req.model_bytes)}){extra}; x{t.concurrency} = "
                 f"{human_bytes(t.concurrency * req.gpu_bytes)}")


def _gpu_budget(t: Target, m: Machine) -> tuple[int | None, str]:
    if t.gpu_kv_bytes is not None:
        return t.gpu_kv_bytes, "--gpu-kv-bytes"
    if m.gpu_memory_bytes is None:
        return None, m.gpu_source
    weights = t.weights_bytes or 0
    how = f"{t.gpu_util:g} x {human_bytes(m.gpu_memory_bytes)} ({m.gpu_source})"
    how += f" - weights {human_bytes(weights)}" if t.weights_bytes is not None else ", weights not subtracted"
    return gpu_kv_budget(m.gpu_memory_bytes, t.gpu_util, weights), how


def check_gpu_budget(t: Target, m: Machine, req: RequestKV | None) -> Check:
    budget, how = _gpu_budget(t, m)
    if budget is None:
        return Check("gpu-kv-budget", Status.WARN, f"{how}: give --gpu-memory-bytes or --gpu-kv-bytes")
    if budget <= 0:
        return Check("gpu-kv-budget", Status.FAIL, f"no room for KV: budget {how} = {budget:,} B")
    if req is None:
        return Check("gpu-kv-budget", Status.WARN, f"KV budget {human_bytes(budget)} ({how}); KV size unknown")
    need = t.concurrency * req.gpu_bytes
    fits = budget // req.gpu_bytes
    head = f"{t.concurrency} x {req.tokens:,} tokens need {human_bytes(need)} = {_pct(need, budget)} of the " \
           f"GPU KV budget {human_bytes(budget)} ({how})"
    if fits == 0:
        return Check("gpu-kv-budget", Status.FAIL, f"{head}: not even one request fits (vLLM refuses to start)")
    if need > GPU_USAGE_LIMIT * budget:
        return Check("gpu-kv-budget", Status.WARN, f"{head}: above {GPU_USAGE_LIMIT:.0%} is dangerous; "
                                                   f"{fits} fit at once, the rest wait or swap")
    if t.gpu_kv_bytes is None and t.weights_bytes is None:
        return Check("gpu-kv-budget", Status.WARN, f"{head}; give --weights-bytes for a real budget")
    return Check("gpu-kv-budget", Status.PASS, head)


def check_cpu_budget(cfg: KVTierConfig, m: Machine, req: RequestKV | None) -> Check:
    if m.dram_available_bytes is None or m.dram_total_bytes is None:
        return Check("cpu-budget", Status.WARN, "cannot read MemTotal/MemAvailable from /proc/meminfo")
    avail, where = m.dram_available_bytes, "MemAvailable"
    if m.cgroup_limit_bytes is not None and m.cgroup_limit_bytes < avail:
        avail, where = m.cgroup_limit_bytes, "the container's cgroup memory limit"
    if cfg.cpu.capacity_bytes is not None:
        budget, how = cfg.cpu.capacity_bytes, "cpu.capacity_bytes"
    else:
        # As the connector sizes it: of the available memory, capped by the cgroup.
        base, _ = available_memory()
        budget = int(cfg.cpu.capacity_fraction * min(base, avail))
        how = f"cpu.capacity_fraction {cfg.cpu.capacity_fraction:g} x available memory"
    head = f"CPU budget {human_bytes(budget)} ({how}) = {_pct(budget, avail)} of {human_bytes(avail)} ({where})"
    if budget > avail:
        return Check("cpu-budget", Status.FAIL, f"{head}: more DRAM than is available")
    if req is not None and req.tokens:
        extra = host_overhead(-(-req.stored_bytes // req.tokens), cfg).total_bytes()
        head += f"; plus up to {human_bytes(extra)} outside it (transfer buffers, queued writes)"
        if budget + extra > avail:
            return Check("cpu-budget", Status.WARN, f"{head}: together more than is available")
    hi = CPU_BUDGET_RANGE[1]
    if budget > hi * avail:
        return Check("cpu-budget", Status.WARN, f"{head}: above the 50-70% rule's {hi:.0%}, little headroom left")
    if req is not None and budget < req.stored_bytes:
        return Check("cpu-budget", Status.WARN, f"{head}: holds no whole {req.tokens:,}-token request "
                                                f"({human_bytes(req.stored_bytes)})")
    return Check("cpu-budget", Status.PASS, head)


def check_nvme_space(cfg: KVTierConfig, m: Machine) -> Check:
    if cfg.nvme is None:
        return Check("nvme-space", Status.PASS, "no NVMe tier configured")
    cap, d = cfg.nvme.capacity_bytes, m.nvme_disk
    if d is None:
        return Check("nvme-space", Status.WARN, f"cannot measure the disk of nvme.path {cfg.nvme.path}")
    head = f"nvme.capacity_bytes {human_bytes(cap)} on {d.path}: {human_bytes(d.free_bytes)} free of " \
           f"{human_bytes(d.total_bytes)}"
    if cap > d.total_bytes:
        return Check("nvme-space", Status.FAIL, f"{head}: larger than the disk")
    if cap > d.free_bytes:
        return Check("nvme-space", Status.WARN, f"{head}: more than is free (fine only if the store already "
                                                "holds the difference)")
    return Check("nvme-space", Status.PASS, head)


def check_fp8(t: Target, m: Machine) -> Check:
    if t.kv_dtype == "fp8":
        return Check("fp8", Status.PASS, "FP8 KV cache: twice the context of BF16 in every tier")
    if t.model is None or t.context_tokens is None:
        return Check("fp8", Status.WARN, f"{t.kv_dtype} KV, model unknown: FP8 (--kv-cache-dtype fp8) not evaluated")
    budget, _ = _gpu_budget(t, m)
    now, fp8 = request_kv(t.model, t.kv_dtype, t.context_tokens), request_kv(t.model, "fp8", t.context_tokens)
    if budget is None or budget <= 0:
        return Check("fp8", Status.WARN, f"FP8 would make a request {human_bytes(fp8.gpu_bytes)} instead of "
                                         f"{human_bytes(now.gpu_bytes)}; GPU budget unknown")
    fit_now, fit_fp8 = budget // now.gpu_bytes, budget // fp8.gpu_bytes
    head = f"{t.kv_dtype} KV: {fit_now} request(s) fit on the GPU, FP8 (--kv-cache-dtype fp8) would fit {fit_fp8}"
    ok = t.kv_dtype != "fp32" and fit_now >= t.concurrency
    return Check("fp8", Status.PASS if ok else Status.WARN, head + ("" if ok else f" (need {t.concurrency})"))
