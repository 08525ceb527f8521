"""What the commands share: a subcommand with a description and examples, and the
model and GPU options that ``kvtier plan`` and ``kvtier doctor`` both take, parsed."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_kvtier.ops.capacity import KV_DTYPE_BYTES
from vllm_kvtier.ops.model_shape import KVModel, model_from_dims, read_model_config
from vllm_kvtier.ops.units import PlanInputError, parse_count, parse_positive, parse_size, parse_tokens

SIZE_HELP = "bytes, or with a unit: 80GB (10^9), 80GiB (2^30)"


def subcommand(sub: Any, name: str, help_: str, description: str, examples: str) -> argparse.ArgumentParser:
    """A subcommand whose --help shows a paragraph of description and an epilog of examples."""
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=help_, description=description, epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    return p


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a config.json, or the three dimensions)")
    g.add_argument("--model-config", metavar="PATH", help="a local config.json (or its directory); no hub access")
    g.add_argument("--layers", help="number of attention layers")
    g.add_argument("--kv-heads", help="KV heads (num_key_value_heads; 1 for MQA)")
    g.add_argument("--head-dim", help="head dimension")
    g.add_argument("--kv-dtype", default="bf16", help=f"KV cache dtype: {', '.join(KV_DTYPE_BYTES)} (default bf16)")
    g.add_argument("--context-tokens", help="context length per request: 131072, 128K (= 131072) or 1M")
    g.add_argument("--concurrency", default="1", help="concurrent requests of that length (default 1)")


def add_hw_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("GPU and links")
    g.add_argument("--gpu-memory-bytes", help=f"HBM of the GPUs serving one replica, {SIZE_HELP}")
    g.add_argument("--gpu-util", default="0.9", help="vLLM --gpu-memory-utilization (default 0.9)")
    g.add_argument("--weights-bytes", help=f"model weights on those GPUs, {SIZE_HELP}")
    g.add_argument("--gpu-kv-bytes", help="the GPU KV budget itself (vLLM logs it), instead of the three above")
    g.add_argument("--pcie-gb-per-s", default="64", help="GPU<->CPU link, GB/s (default 64: PCIe 5.0 x16)")
    g.add_argument("--prefill-tokens-per-s", help="prefill rate, to compare loading with recomputing")


def opt(parse: Any, text: str | None, option: str, **kw: Any) -> Any:
    return None if text is None else parse(text, option, **kw)


def model_of(args: argparse.Namespace, required: bool) -> KVModel | None:
    dims = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    if args.model_config is not None:
        if any(v is not None for v in dims.values()):
            raise PlanInputError("--model-config", "give it or --layers/--kv-heads/--head-dim, not both")
        return read_model_config(args.model_config)
    missing = [k for k, v in dims.items() if v is None]
    if missing == list(dims) and not required:
        return None
    if missing:
        raise PlanInputError(missing[0], "required (or give --model-config)")
    layers, kv_heads, head_dim = (parse_count(v, k) for k, v in dims.items() if v is not None)
    return model_from_dims(layers, kv_heads, head_dim)


def common_options(args: argparse.Namespace, *, require_model: bool) -> dict[str, Any]:
    """The options plan and doctor share, parsed and checked."""
    if args.kv_dtype not in KV_DTYPE_BYTES:
        raise PlanInputError("--kv-dtype", f"must be one of {', '.join(KV_DTYPE_BYTES)}, got {args.kv_dtype!r}")
    model = model_of(args, require_model)
    context = opt(parse_tokens, args.context_tokens, "--context-tokens")
    if model is not None and context is None:
        raise PlanInputError("--context-tokens", "required to size a request")
    mem = opt(parse_size, args.gpu_memory_bytes, "--gpu-memory-bytes")
    return dict(
        model=model, kv_dtype=args.kv_dtype, context_tokens=context,
        concurrency=parse_count(args.concurrency, "--concurrency"),
        gpu_memory_bytes=mem, gpu_util=parse_positive(args.gpu_util, "--gpu-util", upper=1.0),
        weights_bytes=opt(parse_size, args.weights_bytes, "--weights-bytes", allow_zero=True),
        gpu_kv_bytes=opt(parse_size, args.gpu_kv_bytes, "--gpu-kv-bytes"),
        pcie_bytes_per_s=parse_positive(args.pcie_gb_per_s, "--pcie-gb-per-s") * 1e9,
        prefill_tokens_per_s=opt(parse_positive, args.prefill_tokens_per_s, "--prefill-tokens-per-s"),
    )
