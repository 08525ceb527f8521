"""The checks of what turns a configured tier off, or leaves it open: the NVMe directory,
the tiers' packages, the S3 endpoint, the auth key and its files, and RDMA."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import Any

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.doctor.base import Check, Status
from vllm_kvtier.doctor.probe import Machine
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.tiers.auth import check_key_files

RDMA_SECTIONS = ("nixl", "mooncake")
#: Filesystems that are memory, not a drive: an NVMe tier there takes DRAM a second time.
MEMORY_FS = ("tmpfs", "ramfs")
#: Filesystems that are not a local drive: slow, shared or the container's own layer.
NOT_LOCAL_FS = ("nfs", "nfs4", "cifs", "smb3", "9p", "overlay", "fuse")


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
