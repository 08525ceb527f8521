"""Measuring this machine for ``kvtier doctor``: DRAM, GPUs, the NVMe path's disk and
directory, RDMA devices, the tiers' packages and the S3 endpoint.

Nothing here raises on a bad machine: what cannot be measured is None, and the checks
turn it into a WARN saying so. torch is imported only to find the GPUs."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.sysmem import cgroup_memory_limit, read_meminfo

#: Seconds to wait for the S3 endpoint's TCP handshake.
S3_CONNECT_TIMEOUT_S = 3.0


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
