"""What every check of ``kvtier doctor`` shares: its outcome (:class:`Check`) and what the
operator plans to serve (:class:`Target`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm_kvtier.ops.model_shape import KVModel


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
