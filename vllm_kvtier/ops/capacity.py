"""Capacity planning: the usual KV-size formula, tier by tier (``kvtier plan``).

    Standard attention (MHA, GQA, MQA):  KV bytes = 2 x L x H_kv x D_head x S x B
    MLA (DeepSeek-V2/V3):                KV bytes = L x (kv_lora_rank + qk_rope_head_dim) x S x B

Here 2 = K and V. L is the layers, H_kv the KV heads, D_head the head dimension. S is
the tokens, B the bytes per value. MLA caches one latent vector per token per layer, so there is no factor 2. Layers
with a sliding window hold at most ``window`` tokens.

Everything here is a pure function of its arguments, called from the CLI thread. No vllm,
no torch, no I/O. Sizes are ``int`` bytes, bandwidths bytes per second, times seconds.
1 GB = 10^9 bytes, 1 GiB = 2^30 bytes. The model's shape comes from
:mod:`vllm_kvtier.ops.model_shape`; the operator's figures are parsed by
:mod:`vllm_kvtier.ops.units`; :mod:`vllm_kvtier.ops.plan_render` prints the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.ops.model_shape import KVModel
from vllm_kvtier.tiers.buffers import DEFAULT_IDLE_BYTES

#: bytes per cached value for each ``--kv-dtype`` (vLLM's ``--kv-cache-dtype``)
KV_DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
#: the usual CPU offload budget: 50-70% of the DRAM left after OS and workers
CPU_BUDGET_RANGE = (0.5, 0.7)


@dataclass(frozen=True)
class RequestKV:
    """Bytes of one request's KV, three ways (equal unless the model has sliding windows).

    ``model_bytes``: what attention needs (windowed layers capped at the window).
    ``gpu_bytes``: what vLLM allocates with kvtier. The connector supports vLLM's hybrid KV
    cache manager, which stays on: a sliding layer holds its window only, as without it.
    ``stored_bytes``: an upper bound on what a tier holds and a load moves: every layer
    at the full context. A sliding layer stores only the windows a later request can use.
    """

    tokens: int
    model_bytes: int
    gpu_bytes: int
    stored_bytes: int


@dataclass(frozen=True)
class PlanInput:
    """Everything ``kvtier plan`` needs. Capacities left ``None`` are not planned for.

    ``gpu_kv_bytes`` is the KV budget of the GPUs serving one replica (after weights);
    ``dram_reserved_bytes`` what the OS, the model workers and other processes keep.
    Loads from NVMe and S3 also cross PCIe, so they run at the slower of the two links.
    """

    model: KVModel
    kv_dtype: str
    context_tokens: int
    concurrency: int = 1
    gpu_kv_bytes: int | None = None
    dram_bytes: int | None = None
    dram_reserved_bytes: int = 0
    cpu_fraction: float = 0.5
    nvme_bytes: int | None = None
    pcie_bytes_per_s: float = 64e9
    nvme_bytes_per_s: float = 7e9
    s3_bytes_per_s: float = 1.25e9
    prefill_tokens_per_s: float | None = None


@dataclass(frozen=True)
class TierRow:
    """One tier of the plan. ``capacity_bytes`` is None when not given, except for S3,
    which is ``unbounded``. ``requests_fit``: whole requests of the context length the
    tier holds. Loads run over ``link_bytes_per_s``; the GPU row has no link and no load.
    """

    tier: str
    capacity_bytes: int | None
    unbounded: bool
    requests_fit: int | None
    link_bytes_per_s: float | None
    load_s: float | None


@dataclass(frozen=True)
class CPUBudget:
    """The CPU tier budget to configure: ``fraction`` of DRAM after the reserved part."""

    available_bytes: int
    fraction: float
    capacity_bytes: int
    low_bytes: int
    high_bytes: int


#: vLLM's default KV block size on GPUs (tokens per block), for the chunk sizes below
DEFAULT_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class HostOverhead:
    """Host memory the plugin may use OUTSIDE the CPU tier's budget, for a whole engine.

    It counts idle page-aligned transfer buffers kept for reuse. There are at most
    ``idle_per_worker_bytes`` of them in each worker process, one per TP rank. It counts,
    per tier below DRAM, the chunks its write queue may hold assembled at once
    (``max_queued_writes`` x ``chunk_blocks`` blocks). Reads in flight are bounded by the
    same chunk size times the tier's ``io_threads``."""

    idle_per_worker_bytes: int
    block_tokens: int
    #: tier -> (max_queued_writes, chunk_blocks, bytes of that many chunks)
    writes_in_flight: dict[str, tuple[int, int, int]]

    def total_bytes(self, workers: int = 1) -> int:
        return self.idle_per_worker_bytes * workers + sum(b for _, _, b in self.writes_in_flight.values())


def host_overhead(bytes_per_token: int, cfg: KVTierConfig | None = None,
                  block_tokens: int = DEFAULT_BLOCK_TOKENS) -> HostOverhead:
    """The :class:`HostOverhead` of ``cfg``'s lower tiers (its queue and chunk sizes), or,
    without a config, of an NVMe and an S3 tier at their defaults."""
    from vllm_kvtier.config.lower import NVMeTierConfig, S3TierConfig
    from vllm_kvtier.config.stores import S3Config

    def default(cls: type, name: str) -> int:
        return int(cls.__dataclass_fields__[name].default)  # type: ignore[attr-defined]

    if cfg is None:
        tiers: dict[str, tuple[int, int]] = {
            "nvme": (default(NVMeTierConfig, "max_queued_writes"), default(NVMeTierConfig, "chunk_blocks")),
            "s3": (default(S3Config, "max_queued_writes"), default(S3TierConfig, "chunk_blocks")),
        }
    else:
        tiers = {}
        if cfg.nvme is not None:
            tiers["nvme"] = (cfg.nvme.max_queued_writes, cfg.nvme.chunk_blocks)
        if cfg.s3 is not None:
            tiers["s3"] = (cfg.s3.store.max_queued_writes, cfg.s3.chunk_blocks)
    chunk_tokens = {t: blocks * block_tokens for t, (_, blocks) in tiers.items()}
    return HostOverhead(DEFAULT_IDLE_BYTES, block_tokens, {
        t: (int(q), int(blocks), int(q) * chunk_tokens[t] * bytes_per_token) for t, (q, blocks) in tiers.items()})


@dataclass(frozen=True)
class Plan:
    inp: PlanInput
    bytes_per_token: int
    request: RequestKV
    tiers: tuple[TierRow, ...]
    recompute_s: float | None
    cpu_budget: CPUBudget | None
    notes: tuple[str, ...] = field(default_factory=tuple)
    host_overhead: HostOverhead | None = None


# -- sizing -----------------------------------------------------------------------------


def kv_bytes_per_token(model: KVModel, kv_dtype: str) -> int:
    """Bytes of KV one token adds in every layer (the per-token figure)."""
    return model.num_layers * model.values_per_token_layer * KV_DTYPE_BYTES[kv_dtype]


def request_kv(model: KVModel, kv_dtype: str, tokens: int) -> RequestKV:
    """One ``tokens``-long request's KV; see :class:`RequestKV` for the three figures."""
    per_layer = model.values_per_token_layer * KV_DTYPE_BYTES[kv_dtype]
    full = kv_bytes_per_token(model, kv_dtype) * tokens
    if not model.windowed_layers or model.window_tokens is None:
        return RequestKV(tokens, full, full, full)
    full_layers = model.num_layers - model.windowed_layers
    capped = per_layer * (full_layers * tokens + model.windowed_layers * min(tokens, model.window_tokens))
    return RequestKV(tokens, capped, capped, full)


def gpu_kv_budget(gpu_memory_bytes: int, gpu_util: float, weights_bytes: int) -> int:
    """vLLM's KV budget: ``gpu_memory_utilization`` of HBM minus the weights (may be <= 0)."""
    return int(gpu_memory_bytes * gpu_util) - weights_bytes


def cpu_budget(dram_bytes: int, reserved_bytes: int, fraction: float) -> CPUBudget:
    """The CPU offload budget: ``fraction`` (usually 50-70%) of DRAM after OS and workers."""
    avail = max(0, dram_bytes - reserved_bytes)
    lo, hi = CPU_BUDGET_RANGE
    return CPUBudget(avail, fraction, int(avail * fraction), int(avail * lo), int(avail * hi))


def _fit(capacity: int | None, per_request: int) -> int | None:
    return None if capacity is None else max(0, capacity) // per_request


def make_plan(inp: PlanInput) -> Plan:
    """Size ``inp.concurrency`` requests of ``inp.context_tokens`` against every tier."""
    req = request_kv(inp.model, inp.kv_dtype, inp.context_tokens)
    budget = None
    if inp.dram_bytes is not None:
        budget = cpu_budget(inp.dram_bytes, inp.dram_reserved_bytes, inp.cpu_fraction)
    caps = [("gpu", inp.gpu_kv_bytes, req.gpu_bytes, None),
            ("cpu", budget.capacity_bytes if budget else None, req.stored_bytes, inp.pcie_bytes_per_s),
            ("nvme", inp.nvme_bytes, req.stored_bytes, min(inp.nvme_bytes_per_s, inp.pcie_bytes_per_s))]
    rows = [TierRow(tier, cap, False, _fit(cap, per_req), link, None if link is None else req.stored_bytes / link)
            for tier, cap, per_req, link in caps]
    s3_link = min(inp.s3_bytes_per_s, inp.pcie_bytes_per_s)
    rows.append(TierRow("s3", None, True, None, s3_link, req.stored_bytes / s3_link))
    recompute = None if inp.prefill_tokens_per_s is None else inp.context_tokens / inp.prefill_tokens_per_s
    notes = list(inp.model.notes)
    if inp.model.windowed_layers and req.stored_bytes != req.model_bytes:
        notes.append("stored figure: an upper bound; sliding layers store only the windows "
                     "a later request can use")
    per_token = kv_bytes_per_token(inp.model, inp.kv_dtype)
    return Plan(inp, per_token, req, tuple(rows), recompute, budget, tuple(notes), host_overhead(per_token))
