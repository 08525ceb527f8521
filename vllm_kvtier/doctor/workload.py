"""The checks of the config against what is served: the tiers for the workload, and the
time to load a request from CPU against the TTFT target."""

from __future__ import annotations

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.doctor.base import Check, Status, Target
from vllm_kvtier.doctor.tier_checks import RDMA_SECTIONS
from vllm_kvtier.ops.capacity import RequestKV

#: workload each shipped (or expected) preset is made for
PRESET_WORKLOADS = {
    "interactive": "interactive", "shared-prompt": "interactive", "long-context": "long-context",
    "offline-batch": "batch", "batch": "batch",
}
#: the tiers each workload wants, below the GPU
WORKLOAD_TIERS = {"interactive": ("cpu",), "long-context": ("cpu", "nvme"), "batch": ("cpu", "nvme", "s3")}
_TIER_NAMES = {"cpu": "CPU", "nvme": "NVMe", "s3": "S3", "nixl": "NIXL", "mooncake": "Mooncake"}


def config_tiers(cfg: KVTierConfig) -> list[str]:
    """The tiers below the GPU that ``cfg`` configures (sections later versions add included)."""
    tiers = ["cpu"] + (["nvme"] if cfg.nvme is not None else [])
    return tiers + [t for t in ("s3", *RDMA_SECTIONS) if getattr(cfg, t, None) is not None]


def workload_of(cfg: KVTierConfig, t: Target) -> tuple[str | None, str]:
    if t.workload is not None:
        return t.workload, "--workload"
    if t.ttft_slo_s is not None and t.ttft_slo_s <= 1.0:
        return "interactive", f"--ttft-slo-s {t.ttft_slo_s:g} <= 1 s"
    if cfg.preset in PRESET_WORKLOADS:
        return PRESET_WORKLOADS[cfg.preset], f"preset {cfg.preset}"
    return None, ""


def check_strategy(cfg: KVTierConfig, t: Target) -> Check:
    tiers = config_tiers(cfg)
    layout = "GPU + " + " + ".join(_TIER_NAMES[x] for x in tiers)
    workload, how = workload_of(cfg, t)
    if workload is None:
        return Check("strategy", Status.WARN, f"workload not stated (--workload or --ttft-slo-s); config: {layout}")
    problems = []
    made_for = PRESET_WORKLOADS.get(cfg.preset or "")
    if made_for is not None and made_for != workload:
        problems.append(f"preset {cfg.preset!r} is made for {made_for} serving")
    if workload == "interactive":
        slow = [x for x in tiers if x in ("nvme", "s3")]
        if slow:
            problems.append(f"{' and '.join(slow)} on the path of TTFT < 1 s requests (recommended: GPU + CPU)")
        if cfg.load_mode != "sync":
            problems.append("load_mode async: sync loads give the lowest TTFT")
    else:
        missing = [x for x in WORKLOAD_TIERS[workload] if x not in tiers]
        if missing:
            want = " + ".join(_TIER_NAMES[x] for x in WORKLOAD_TIERS[workload])
            problems.append(f"no {' or '.join(missing)} tier (recommended: GPU + {want}, for capacity and cost)")
    reason = f"{workload} workload ({how}), config: {layout}"
    return Check("strategy", Status.WARN if problems else Status.PASS, "; ".join([reason, *problems]))


def check_bandwidth(t: Target, req: RequestKV | None, workload: str | None) -> Check:
    if req is None:
        return Check("cpu-bandwidth", Status.WARN, "KV size unknown: PCIe load time not compared with the TTFT SLO")
    load = req.stored_bytes / t.pcie_bytes_per_s
    head = f"loading a {req.tokens:,}-token request from CPU over PCIe at {t.pcie_bytes_per_s / 1e9:g} GB/s " \
           f"takes {load:.2f} s"
    recompute = None if t.prefill_tokens_per_s is None else req.tokens / t.prefill_tokens_per_s
    vs = "" if recompute is None else f" (recompute {recompute:.2f} s)"
    if t.ttft_slo_s is None:
        status = Status.PASS if workload == "batch" else Status.WARN
        return Check("cpu-bandwidth", status, f"{head}{vs}; no --ttft-slo-s to compare with")
    if load <= t.ttft_slo_s:
        return Check("cpu-bandwidth", Status.PASS, f"{head}{vs}, within the TTFT SLO {t.ttft_slo_s:g} s")
    if recompute is not None and load >= recompute:
        return Check("cpu-bandwidth", Status.FAIL, f"{head}{vs}: over the TTFT SLO {t.ttft_slo_s:g} s and "
                                                   "slower than recomputing")
    return Check("cpu-bandwidth", Status.WARN, f"{head}{vs}: over the TTFT SLO {t.ttft_slo_s:g} s for a full hit; "
                                               "shorter contexts or FP8 KV halve it")
