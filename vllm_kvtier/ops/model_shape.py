"""The KV shape of a model (:class:`KVModel`): from a local ``config.json``, or from its
three dimensions. See :mod:`vllm_kvtier.ops.capacity` for the formula it feeds.

Pure functions but :func:`read_model_config`, which reads one local file (never the hub).
A shape it cannot size raises :class:`~vllm_kvtier.ops.units.PlanInputError` naming the
config.json field."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kvtier.config.files import read_small_file
from vllm_kvtier.ops.units import PlanInputError

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
