"""``kvtier doctor``: a pre-deployment checklist, run against a config and a machine.

Two steps, so the checks can be read and tested alone:

- :func:`~vllm_kvtier.doctor.probe.probe_machine` measures this machine. It reads DRAM
  from ``/proc/meminfo`` (and the cgroup memory limit of a container). It checks the NVMe path's disk with
  :func:`shutil.disk_usage` and RDMA devices under ``/sys/class/infiniband``. It reads the
  GPUs through ``torch.cuda`` when no size is given (torch is imported only then; never
  vllm).
- :func:`run_checks` judges a parsed :class:`~vllm_kvtier.config.KVTierConfig`, the
  operator's :class:`Target` and the :class:`Machine`. It reads nothing but the alert
  rules file it is given and the key files the config names. Each check is PASS, WARN
  or FAIL with the reason.

Called from the CLI thread; nothing here raises on a bad machine: what cannot be measured
becomes a WARN saying so.

The checks are grouped by what they check: sizes (:mod:`.sizing`), what turns a tier off
(:mod:`.tier_checks`), the workload (:mod:`.workload`) and alerting (:mod:`.alerting`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.doctor.alerting import check_alerting
from vllm_kvtier.doctor.base import Check, Status, Target
from vllm_kvtier.doctor.probe import Machine
from vllm_kvtier.doctor.sizing import (
    check_cpu_budget,
    check_fp8,
    check_gpu_budget,
    check_kv_size,
    check_nvme_space,
)
from vllm_kvtier.doctor.tier_checks import (
    check_key_files_readable,
    check_nvme_dir,
    check_rdma,
    check_s3_endpoint,
    check_shared_auth,
    check_tier_packages,
    rdma_requirements,
)
from vllm_kvtier.doctor.workload import check_bandwidth, check_strategy, workload_of
from vllm_kvtier.ops.capacity import request_kv


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
        check_bandwidth(t, req, workload_of(cfg, t)[0]),
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
