"""``kvtier doctor``: a pre-deployment checklist, run against a config and a machine.

Two steps, so the checks can be read and tested alone:

- :func:`probe_machine` measures this machine. It reads DRAM from ``/proc/meminfo`` (and
  the cgroup memory limit of a container). It checks the NVMe path's disk with
  :func:`shutil.disk_usage` and RDMA devices under ``/sys/class/infiniband``. It reads the
  GPUs through ``torch.cuda`` when no size is given (torch is imported only then; never
  vllm).
- :func:`run_checks` judges a parsed :class:`~vllm_kvtier.config.KVTierConfig`, the
  operator's :class:`Target` and the :class:`Machine`. It reads nothing but the alert
  rules file it is given and the key files the config names. Each check is PASS, WARN
  or FAIL with the reason.

Called from the CLI thread; nothing here raises on a bad machine: what cannot be measured
becomes a WARN saying so.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import os
import shutil
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.config.files import read_small_file
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.ops.capacity import CPU_BUDGET_RANGE, RequestKV, gpu_kv_budget, host_overhead, request_kv
from vllm_kvtier.ops.model_shape import KVModel
from vllm_kvtier.ops.units import human_bytes
from vllm_kvtier.sysmem import available_memory, cgroup_memory_limit, read_meminfo
from vllm_kvtier.tiers.auth import check_key_files

#: workload each shipped (or expected) preset is made for
PRESET_WORKLOADS = {
    "interactive": "interactive", "shared-prompt": "interactive", "long-context": "long-context",
    "offline-batch": "batch", "batch": "batch",
}
#: the tiers each workload wants, below the GPU
WORKLOAD_TIERS = {"interactive": ("cpu",), "long-context": ("cpu", "nvme"), "batch": ("cpu", "nvme", "s3")}
#: above this share of the GPU KV budget, usage is dangerous
GPU_USAGE_LIMIT = 0.9
#: what an alert rule must watch, and substrings of the metrics that show it
ALERT_SIGNALS = {
    "GPU KV usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "swapping": ("kvtier_blocks_loaded", "kvtier_blocks_stored", "swap_in", "swap_out", "num_preemptions"),
}
RDMA_SECTIONS = ("nixl", "mooncake")
#: An alert rules file is a few KiB; a cluster's whole PrometheusRule set, a few MiB.
MAX_RULES_BYTES = 16 << 20
_TIER_NAMES = {"cpu": "CPU", "nvme": "NVMe", "s3": "S3", "nixl": "NIXL", "mooncake": "Mooncake"}


class Status(enum.Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    reason: str


@dataclass(frozen=True)
class Disk:
    path: str  # the directory measured: the NVMe path or its nearest existing parent
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class NVMeDir:
    """The NVMe path as the tier will see it: the path, or its nearest existing parent."""

    path: str
    exists: bool
    mode: int
    uid: int
    fstype: str | None  # from /proc/mounts; None: not found


@dataclass(frozen=True)
class TierProbe:
    """What the configured tiers need from this machine, measured."""

    nvme_dir: NVMeDir | None = None
    #: tier -> install hint, for every configured tier whose package does not import here
    missing_packages: tuple[tuple[str, str], ...] = ()
    #: the S3 endpoint tried ("host:port") and the error, "" when it answered
    s3_endpoint: str | None = None
    s3_error: str = ""
    #: an auth key is configured where this process can see it (env var set or key_file set)
    auth_key_configured: bool = False


@dataclass(frozen=True)
class Machine:
    """What :func:`probe_machine` measured. None: could not be measured here."""

    dram_total_bytes: int | None
    dram_available_bytes: int | None
    cgroup_limit_bytes: int | None
    gpu_memory_bytes: int | None
    gpu_source: str
    rdma_devices: tuple[str, ...]
    nvme_disk: Disk | None
    tiers: TierProbe = TierProbe()


@dataclass(frozen=True)
class Target:
    """What the operator plans to serve (doctor's command-line inputs)."""

    model: KVModel | None = None
    kv_dtype: str = "bf16"
    context_tokens: int | None = None
    concurrency: int = 1
    gpu_util: float = 0.9
    weights_bytes: int | None = None
    gpu_kv_bytes: int | None = None
    pcie_bytes_per_s: float = 64e9
    prefill_tokens_per_s: float | None = None
    ttft_slo_s: float | None = None
    workload: str | None = None
    prometheus_rules: str | None = None


# -- measuring --------------------------------------------------------------------------


def _detect_gpus() -> tuple[int | None, str]:
    try:
        import torch
    except ImportError:
        return None, "no GPU detected (torch is not installed)"
    if not torch.cuda.is_available():
        return None, "no GPU detected (torch.cuda is not available)"
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return sum(p.total_memory for p in props), f"torch.cuda: {len(props)} x {props[0].name}"


def _disk(path: str) -> Disk | None:
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        du = shutil.disk_usage(p)
    except OSError:
        return None
    return Disk(str(p), du.total, du.free)


#: Filesystems that are memory, not a drive: an NVMe tier there takes DRAM a second time.
MEMORY_FS = ("tmpfs", "ramfs")
#: Filesystems that are not a local drive: slow, shared or the container's own layer.
NOT_LOCAL_FS = ("nfs", "nfs4", "cifs", "smb3", "9p", "overlay", "fuse")
#: Seconds to wait for the S3 endpoint's TCP handshake.
S3_CONNECT_TIMEOUT_S = 3.0


def _fstype(path: Path, mounts: str = "/proc/mounts") -> str | None:
    """The filesystem type of the mount holding ``path`` (the longest mount point prefix)."""
    best, fstype = -1, None
    try:
        with open(mounts) as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) > best:
            best, fstype = len(mnt), parts[2]
    return fstype


def _nvme_dir(path: str) -> NVMeDir | None:
    p = Path(path).expanduser().absolute()
    exists = p.exists()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.stat(p)
    except OSError:
        return None
    return NVMeDir(str(p), exists, stat.S_IMODE(st.st_mode) | (st.st_mode & stat.S_ISVTX), st.st_uid,
                   _fstype(p.resolve()))


def _importable(*names: str) -> bool:
    return any(importlib.util.find_spec(n) is not None for n in names)


def _missing_packages(cfg: KVTierConfig) -> tuple[tuple[str, str], ...]:
    from vllm_kvtier.tiers.registry import install_hint

    missing = []
    if cfg.s3 is not None and not _importable("boto3"):
        missing.append(("s3", install_hint("s3")))
    if cfg.mooncake is not None and not _importable("mooncake"):
        missing.append(("mooncake", install_hint("mooncake")))
    uses_nixl = cfg.nixl is not None or (cfg.nvme is not None and cfg.nvme.io_engine != "posix") or (
        cfg.s3 is not None and cfg.s3.store.io_engine == "nixl")
    if uses_nixl and not _importable("nixl_cu12", "nixl_cu13", "nixl"):
        missing.append(("nixl", "NIXL transfers need the nixl package: pip install nixl-cu12 and "
                                "pip install --no-deps nixl"))
    return tuple(missing)


def _s3_endpoint(cfg: KVTierConfig) -> tuple[str | None, str]:
    """Connect to the S3 endpoint once; ("host:port", "") when it answered."""
    if cfg.s3 is None:
        return None, ""
    store = cfg.s3.store
    url = store.endpoint_url or f"https://s3.{store.region or 'us-east-1'}.amazonaws.com"
    u = urlsplit(url)
    host, port = u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=S3_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        return f"{host}:{port}", str(e) or type(e).__name__
    return f"{host}:{port}", ""


def probe_tiers(cfg: KVTierConfig, *, connect: bool = True) -> TierProbe:
    """Measure what the configured tiers need. ``connect``: try the S3 endpoint (a TCP
    handshake, at most :data:`S3_CONNECT_TIMEOUT_S`)."""
    endpoint, error = _s3_endpoint(cfg) if connect else (None, "")
    key = bool(cfg.auth.key_file) or bool(os.environ.get(cfg.auth.key_env))
    return TierProbe(_nvme_dir(cfg.nvme.path) if cfg.nvme is not None else None, _missing_packages(cfg),
                     endpoint, error, key)


def probe_machine(cfg: KVTierConfig, gpu_memory_bytes: int | None = None, *, detect_gpu: bool = True) -> Machine:
    """Measure this machine for ``cfg``.

    ``gpu_memory_bytes`` given, or ``detect_gpu`` false: torch is not imported.
    """
    mem = read_meminfo()
    gpu: int | None
    if gpu_memory_bytes is not None:
        gpu, source = gpu_memory_bytes, "--gpu-memory-bytes"
    elif detect_gpu:
        gpu, source = _detect_gpus()
    else:
        gpu, source = None, "GPU not probed"
    ib = Path("/sys/class/infiniband")
    rdma = tuple(sorted(os.listdir(ib))) if ib.is_dir() else ()
    disk = _disk(cfg.nvme.path) if cfg.nvme is not None else None
    return Machine(mem.get("MemTotal"), mem.get("MemAvailable"), cgroup_memory_limit(), gpu, source, rdma, disk,
                   probe_tiers(cfg))


# -- checks -----------------------------------------------------------------------------


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


def check_nvme_dir(cfg: KVTierConfig, m: Machine) -> Check:
    """What turns the NVMe tier off at start (the tier refuses an unsafe directory), or makes
    it no SSD at all."""
    d = m.tiers.nvme_dir
    if cfg.nvme is None:
        return Check("nvme-dir", Status.PASS, "no NVMe tier configured")
    if d is None:
        return Check("nvme-dir", Status.WARN, f"cannot stat nvme.path {cfg.nvme.path} or a parent")
    where = f"nvme.path {cfg.nvme.path}" + ("" if d.exists else f" (to be created under {d.path})")
    if d.exists and d.uid not in (os.geteuid(), 0):
        return Check("nvme-dir", Status.FAIL, f"{where} is owned by uid {d.uid}: the NVMe tier turns itself off")
    if d.exists and d.mode & 0o022 and not d.mode & stat.S_ISVTX:
        return Check("nvme-dir", Status.FAIL, f"{where} has mode {d.mode & 0o777:o}, writable by group or others: "
                                              "the NVMe tier turns itself off (chmod 700 it)")
    if d.fstype in MEMORY_FS:
        return Check("nvme-dir", Status.FAIL, f"{where} is on {d.fstype}, which is memory: the NVMe tier would "
                                              "take DRAM a second time (use a directory on the SSD)")
    if d.fstype is not None and d.fstype.split(".")[0] in NOT_LOCAL_FS:
        return Check("nvme-dir", Status.WARN, f"{where} is on {d.fstype}, not a local drive (mount the SSD there)")
    return Check("nvme-dir", Status.PASS, f"{where} on {d.fstype or 'an unknown filesystem'}")


def check_tier_packages(m: Machine) -> Check:
    if not m.tiers.missing_packages:
        return Check("tier-packages", Status.PASS, "every configured tier's package imports")
    return Check("tier-packages", Status.FAIL, "; ".join(f"{t}: {hint}" for t, hint in m.tiers.missing_packages))


def check_s3_endpoint(cfg: KVTierConfig, m: Machine) -> Check:
    if cfg.s3 is None:
        return Check("s3-endpoint", Status.PASS, "no S3 tier configured")
    if m.tiers.s3_endpoint is None:
        return Check("s3-endpoint", Status.WARN, "S3 endpoint not tried")
    if m.tiers.s3_error:
        return Check("s3-endpoint", Status.FAIL, f"{m.tiers.s3_endpoint} does not answer ({m.tiers.s3_error}): "
                                                 "every S3 read and write would fail")
    return Check("s3-endpoint", Status.PASS, f"{m.tiers.s3_endpoint} answers")


def check_shared_auth(cfg: KVTierConfig, m: Machine) -> Check:
    shared = [t for t in ("s3", "mooncake") if getattr(cfg, t, None) is not None]
    if not shared:
        return Check("shared-auth", Status.PASS, "no shared tier (s3, mooncake)")
    if m.tiers.auth_key_configured:
        return Check("shared-auth", Status.PASS, f"{' and '.join(shared)} chunks carry a MAC (auth key configured)")
    return Check("shared-auth", Status.FAIL if cfg.auth.required else Status.WARN,
                 f"{' and '.join(shared)} without an auth key (${cfg.auth.key_env} unset, no auth.key_file): "
                 "whoever can write to it controls every reader's output")


def config_tiers(cfg: KVTierConfig) -> list[str]:
    """The tiers below the GPU that ``cfg`` configures (sections later versions add included)."""
    tiers = ["cpu"] + (["nvme"] if cfg.nvme is not None else [])
    return tiers + [t for t in ("s3", *RDMA_SECTIONS) if getattr(cfg, t, None) is not None]


def _workload(cfg: KVTierConfig, t: Target) -> tuple[str | None, str]:
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
    workload, how = _workload(cfg, t)
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


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path, value


def rdma_requirements(config: dict[str, Any]) -> list[str]:
    """Fields of a config (as a dict) that need an RDMA network: NIXL/Mooncake sections, rdma:// URLs."""
    found = [s for s in RDMA_SECTIONS if config.get(s) is not None]
    return found + [p for p, v in _strings(config) if v.startswith("rdma://")]


def check_rdma(needs: list[str], m: Machine) -> Check:
    """``needs``: the config fields that need RDMA (:func:`rdma_requirements`)."""
    if not needs:
        return Check("rdma", Status.PASS, "no NIXL/Mooncake RDMA configured")
    if not m.rdma_devices:
        return Check("rdma", Status.FAIL, f"{', '.join(needs)} need InfiniBand/RoCE, and /sys/class/infiniband "
                                          "lists no device")
    return Check("rdma", Status.PASS, f"{', '.join(needs)}: RDMA devices {', '.join(m.rdma_devices)}")


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


def _alert_exprs(value: Any) -> Iterator[str]:
    """The ``expr`` of every mapping with an ``alert`` key. Each node is visited once, so
    YAML aliases that repeat a node many times cost no more than the node itself."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if not isinstance(v, dict | list) or id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            if "alert" in v and isinstance(v.get("expr"), str):
                yield v["expr"]
            stack.extend(reversed(list(v.values())))
        else:
            stack.extend(reversed(v))


def check_alerting(rules_path: str | None) -> Check:
    if rules_path is None:
        return Check("alerting", Status.WARN, "no --prometheus-rules file: swap and GPU KV usage alerts not verified")
    try:
        docs = list(yaml.safe_load_all(read_small_file(rules_path, MAX_RULES_BYTES)))
    except ValueError as e:  # not a small regular UTF-8 file
        return Check("alerting", Status.FAIL, f"--prometheus-rules: {e}")
    except (yaml.YAMLError, RecursionError) as e:  # RecursionError: nested thousands deep
        why = " ".join(str(e).split()) or "nested too deeply"
        return Check("alerting", Status.FAIL, f"--prometheus-rules {rules_path}: not valid YAML: {why}")
    exprs = [e for d in docs for e in _alert_exprs(d)]
    if not exprs:
        return Check("alerting", Status.FAIL, f"{rules_path} holds no alert rule (alert + expr)")
    missing = [sig for sig, metrics in ALERT_SIGNALS.items() if not any(n in e for e in exprs for n in metrics)]
    if missing:
        return Check("alerting", Status.WARN, f"{len(exprs)} alert rules, none on {' or '.join(missing)}")
    return Check("alerting", Status.PASS, f"{len(exprs)} alert rules in {rules_path}, on GPU KV usage and swapping")


def check_key_files_readable(cfg: KVTierConfig) -> Check | None:
    """The key files the config names, read as the engine will; None when it names none."""
    files = ([cfg.auth.key_file] if cfg.auth.key_file is not None else []) + list(cfg.auth.verify_key_files)
    if not files:
        return None
    try:
        check_key_files(cfg.auth)
    except ConfigError as e:
        return Check("auth-keys", Status.FAIL, f"{e}: the engine would refuse to start")
    return Check("auth-keys", Status.PASS, f"{len(files)} key file(s) hold a key: {', '.join(files)}")


def run_checks(cfg: KVTierConfig, t: Target, m: Machine) -> list[Check]:
    """The checklist, in order (plus the machine's DRAM and disk, and the key
    files when the config names any)."""
    req = None
    if t.model is not None and t.context_tokens is not None:
        req = request_kv(t.model, t.kv_dtype, t.context_tokens)
    return [
        check_kv_size(t, req),
        check_gpu_budget(t, m, req),
        check_cpu_budget(cfg, m, req),
        check_nvme_space(cfg, m),
        check_nvme_dir(cfg, m),
        check_tier_packages(m),
        check_s3_endpoint(cfg, m),
        check_shared_auth(cfg, m),
        check_strategy(cfg, t),
        check_bandwidth(t, req, _workload(cfg, t)[0]),
        check_rdma(rdma_requirements(dataclasses.asdict(cfg)), m),
        check_fp8(t, m),
        check_alerting(t.prometheus_rules),
    ] + [c for c in (check_key_files_readable(cfg),) if c is not None]


def render_checks(checks: list[Check]) -> str:
    """One line per check, ``STATUS name  reason``, then a summary line."""
    width = max(len(c.name) for c in checks)
    lines = [f"{c.status.value}  {c.name:<{width}}  {c.reason}" for c in checks]
    counts = {s: sum(c.status is s for c in checks) for s in Status}
    lines.append(", ".join(f"{n} {s.value}" for s, n in counts.items()))
    return "\n".join(lines)


def checks_to_dict(checks: list[Check]) -> dict[str, Any]:
    return {"checks": [{"name": c.name, "status": c.status.value, "reason": c.reason} for c in checks],
            "failed": any(c.status is Status.FAIL for c in checks)}
