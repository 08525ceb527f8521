"""Capacity planning: the usual KV-size formula, tier by tier (``kvtier plan``).

    Standard attention (MHA, GQA, MQA):  KV bytes = 2 x L x H_kv x D_head x S x B
    MLA (DeepSeek-V2/V3):                KV bytes = L x (kv_lora_rank + qk_rope_head_dim) x S x B

Here 2 = K and V. L is the layers, H_kv the KV heads, D_head the head dimension. S is
the tokens, B the bytes per value. MLA caches one latent vector per token per layer, so there is no factor 2. Layers
with a sliding window hold at most ``window`` tokens.

Everything here is a pure function of its arguments, called from the CLI thread. No vllm,
no torch, no I/O except :func:`read_model_config`. That reads one local ``config.json``
(never the hub). Sizes are ``int`` bytes, bandwidths bytes per second, times seconds.
1 GB = 10^9 bytes, 1 GiB = 2^30 bytes. Bad input raises :class:`PlanInputError` naming
the config.json field, CLI option or file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.config.files import read_small_file
from vllm_kvtier.config.units import size_bytes
from vllm_kvtier.errors import KVTierError
from vllm_kvtier.tiers.buffers import DEFAULT_IDLE_BYTES

#: bytes per cached value for each ``--kv-dtype`` (vLLM's ``--kv-cache-dtype``)
KV_DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
#: the usual CPU offload budget: 50-70% of the DRAM left after OS and workers
CPU_BUDGET_RANGE = (0.5, 0.7)
#: config.json fields of models whose KV is not (only) attention KV: refused by name
_UNSUPPORTED_FIELDS = {
    "attention_chunk_size": "chunked local attention (Llama-4 style)",
    "layers_block_type": "hybrid attention/SSM layers",
    "hybrid_override_pattern": "hybrid attention/SSM layers",
    "attn_layer_indices": "hybrid attention/SSM layers",
    "ssm_cfg": "state-space (Mamba) layers",
    "mamba_d_state": "state-space (Mamba) layers",
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


class PlanInputError(KVTierError, ValueError):
    """Bad planner input. ``field`` names the config.json field, the CLI option or the file."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class KVModel:
    """The KV cache shape of a model: what one token costs in each layer.

    ``values_per_token_layer`` is the number of cached values per token per layer:
    2 x kv_heads x head_dim for standard attention, kv_lora_rank + qk_rope_head_dim for MLA.
    ``windowed_layers`` of the ``num_layers`` are sliding-window layers holding at most
    ``window_tokens`` tokens; the others hold the whole context.
    """

    name: str
    attention: str  # "MHA", "GQA", "MQA" or "MLA"
    shape: str  # human description, e.g. "80 layers x 8 KV heads x head_dim 128"
    num_layers: int
    values_per_token_layer: int
    window_tokens: int | None = None
    windowed_layers: int = 0
    notes: tuple[str, ...] = ()


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


# -- model shapes -----------------------------------------------------------------------


def _positive_int(cfg: Mapping[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanInputError(f"{where} field '{key}'", f"must be a positive integer, got {value!r}")
    return value


def _first_key(cfg: Mapping[str, Any], *keys: str) -> str | None:
    return next((k for k in keys if cfg.get(k) is not None), None)


def model_from_dims(layers: int, kv_heads: int, head_dim: int, name: str = "explicit dims") -> KVModel:
    """A standard-attention model from ``--layers``, ``--kv-heads`` and ``--head-dim``."""
    for opt, v in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise PlanInputError(opt, f"must be a positive integer, got {v!r}")
    kind = "MQA" if kv_heads == 1 else "MHA/GQA"
    return KVModel(name, kind, f"{layers} layers x {kv_heads} KV heads x head_dim {head_dim}", layers,
                   2 * kv_heads * head_dim)


def _mla(cfg: Mapping[str, Any], name: str, layers: int, where: str) -> KVModel:
    rank = _positive_int(cfg, "kv_lora_rank", where)
    rope = _positive_int(cfg, "qk_rope_head_dim", where)
    shape = f"{layers} layers x (kv_lora_rank {rank} + qk_rope_head_dim {rope}) latent values"
    note = "MLA: one latent vector per token per layer (no separate K and V), as vLLM caches it"
    tp = ("MLA with tensor parallelism: every TP rank caches the whole latent; NVMe, S3 and the Mooncake pool "
          "store it once (the figures here), the CPU tier once per TP rank (a pool per worker process): "
          "divide its fits by the TP size")
    return KVModel(name, "MLA", shape, layers, rank + rope, notes=(note, tp))


def _heads(cfg: Mapping[str, Any], where: str) -> tuple[int, int, int, list[str]]:
    """(query heads, KV heads, head_dim, notes) of a standard-attention config."""
    notes = []
    q_key = _first_key(cfg, "num_attention_heads", "n_head") or "num_attention_heads"
    q_heads = _positive_int(cfg, q_key, where)
    if cfg.get("num_key_value_heads") is not None:
        kv_heads = _positive_int(cfg, "num_key_value_heads", where)
    elif cfg.get("multi_query") is True:
        kv_heads = 1
        notes.append("multi_query: true, so one KV head")
    else:
        kv_heads = q_heads
        notes.append("no num_key_value_heads: multi-head attention, KV heads = query heads")
    if kv_heads > q_heads:
        raise PlanInputError(f"{where} field 'num_key_value_heads'", f"{kv_heads} is more than {q_key} {q_heads}")
    if cfg.get("head_dim") is not None:
        head_dim = _positive_int(cfg, "head_dim", where)
    else:
        hidden = _positive_int(cfg, _first_key(cfg, "hidden_size", "n_embd") or "hidden_size", where)
        if hidden % q_heads:
            raise PlanInputError(f"{where} field 'head_dim'",
                                 f"absent, and hidden_size {hidden} is not a multiple of {q_key} {q_heads}")
        head_dim = hidden // q_heads
        notes.append(f"head_dim = hidden_size / {q_key} = {hidden} / {q_heads}")
    return q_heads, kv_heads, head_dim, notes


def _windowed_layers(cfg: Mapping[str, Any], layers: int, where: str) -> tuple[int | None, int, list[str]]:
    """(window tokens, number of sliding-window layers, notes) of a config."""
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise PlanInputError(f"{where} field 'layer_types'", f"must be a list of {layers} layer types")
        for i, t in enumerate(layer_types):
            if t not in _LAYER_TYPES:
                raise PlanInputError(f"{where} field 'layer_types[{i}]'",
                                     f"layer type {t!r} is not supported (only {', '.join(_LAYER_TYPES)})")
        n = layer_types.count("sliding_attention")
        if n == 0:
            return None, 0, []
        return _positive_int(cfg, "sliding_window", where), n, [f"layer_types: {n} of {layers} layers slide"]
    if cfg.get("sliding_window") is None:
        return None, 0, []
    if cfg.get("use_sliding_window") is False:
        return None, 0, ["sliding_window ignored: use_sliding_window is false"]
    window = _positive_int(cfg, "sliding_window", where)
    if cfg.get("sliding_window_pattern") is not None:
        p = _positive_int(cfg, "sliding_window_pattern", where)
        n = sum(1 for i in range(layers) if (i + 1) % p)
        return window, n, [f"sliding_window_pattern {p}: every {p}th layer is full attention"]
    if cfg.get("model_type") == "gemma2":
        return window, layers - layers // 2, ["gemma2: layers alternate sliding (even) and full (odd)"]
    if cfg.get("use_sliding_window") is True and cfg.get("max_window_layers") is not None:
        first = cfg["max_window_layers"]
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= layers:
            raise PlanInputError(f"{where} field 'max_window_layers'", f"must be in [0, {layers}], got {first!r}")
        return window, layers - first, [f"max_window_layers {first}: layers from {first} on slide"]
    return window, layers, ["sliding_window on every layer"]


def model_from_hf_config(cfg: Mapping[str, Any], where: str = "config.json") -> KVModel:
    """The KV shape of a Hugging Face ``config.json`` (multimodal: its ``text_config``).

    Supported: MHA, GQA, MQA (``num_key_value_heads`` 1 or ``multi_query``), MLA
    (``kv_lora_rank``), sliding windows on all layers or some (``layer_types``,
    ``sliding_window_pattern``, Gemma-2 alternation, Qwen2 ``max_window_layers``).
    Refused with the field named: chunked local attention, hybrid SSM models.
    """
    name = str((cfg.get("architectures") or [cfg.get("model_type") or "model"])[0])
    text = cfg.get("text_config")
    if isinstance(text, Mapping):
        cfg, where = text, f"{where} text_config"
    for key, what in _UNSUPPORTED_FIELDS.items():
        if cfg.get(key) is not None:
            raise PlanInputError(f"{where} field '{key}'", f"{what} is not supported by kvtier plan")
    layers = _positive_int(cfg, _first_key(cfg, "num_hidden_layers", "n_layer", "num_layers") or
                           "num_hidden_layers", where)
    if cfg.get("kv_lora_rank") is not None:
        return _mla(cfg, name, layers, where)
    q_heads, kv_heads, head_dim, notes = _heads(cfg, where)
    kind = "MQA" if kv_heads == 1 else "MHA" if kv_heads == q_heads else "GQA"
    shape = f"{layers} layers x {kv_heads} KV heads x head_dim {head_dim} ({q_heads} query heads)"
    window, windowed, wnotes = _windowed_layers(cfg, layers, where)
    return KVModel(name, kind, shape, layers, 2 * kv_heads * head_dim, window, windowed, tuple(notes + wnotes))


def read_model_config(path: str) -> KVModel:
    """Read a local ``config.json`` (a file, or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(read_small_file(p))
    except json.JSONDecodeError as e:
        raise PlanInputError(f"model config {p}", f"not valid JSON: {e}") from e
    except ValueError as e:  # not a small regular UTF-8 file
        raise PlanInputError(f"model config {p}", str(e)) from e
    if not isinstance(data, dict):
        raise PlanInputError(f"model config {p}", "must hold a JSON object")
    return model_from_hf_config(data, str(p))


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


# -- units ------------------------------------------------------------------------------

def parse_size(text: str, option: str, *, allow_zero: bool = False) -> int:
    """Bytes from ``"42949672960"``, ``"80GB"`` (10^9) or ``"40GiB"`` (2^30)."""
    try:
        n = size_bytes(text)
    except ValueError as e:
        raise PlanInputError(option, str(e)) from None
    if n < 0 or (n == 0 and not allow_zero):
        raise PlanInputError(option, f"must be positive, got {text!r}")
    return n


def parse_tokens(text: str, option: str) -> int:
    """A token count: ``"131072"``, ``"128K"`` (= 131,072) or ``"1M"`` (= 1,048,576)."""
    m = re.fullmatch(r"\s*(\d+)\s*([km]?)\s*", text, re.IGNORECASE)
    if not m:
        raise PlanInputError(option, f"not a token count: {text!r}")
    n = int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[m.group(2).lower()]
    if n <= 0:
        raise PlanInputError(option, f"must be positive, got {text!r}")
    return n


def parse_positive(text: str, option: str, *, upper: float = math.inf) -> float:
    """A number in (0, ``upper``]."""
    try:
        v = float(text)
    except ValueError:
        raise PlanInputError(option, f"not a number: {text!r}") from None
    if not 0 < v <= upper or math.isnan(v):
        raise PlanInputError(option, f"must be > 0{'' if upper == math.inf else f' and <= {upper:g}'}, got {text}")
    return v


def parse_count(text: str, option: str) -> int:
    """A positive integer (a count of blocks, requests, instances)."""
    try:
        n = int(text)
    except ValueError:
        raise PlanInputError(option, f"not an integer: {text!r}") from None
    if n <= 0:
        raise PlanInputError(option, f"must be a positive integer, got {n}")
    return n


def human_bytes(n: int) -> str:
    """``"42.95 GB = 40.00 GiB"``: both a decimal (10^3) and a binary (2^10) unit."""
    def scaled(base: int, units: tuple[str, ...]) -> str:
        i = 0
        while i + 1 < len(units) and abs(n) >= base ** (i + 1):
            i += 1
        return f"{n / base**i:.2f} {units[i]}" if i else f"{n} B"
    return f"{scaled(1000, ('B', 'kB', 'MB', 'GB', 'TB', 'PB'))} = {scaled(1024, ('B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'))}"


def exact_bytes(n: int) -> str:
    """``"42,949,672,960 B = 42.95 GB = 40.00 GiB"``."""
    return f"{n:,} B" if abs(n) < 1000 else f"{n:,} B = {human_bytes(n)}"


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
