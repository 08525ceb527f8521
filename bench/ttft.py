"""TTFT benchmark: a long prompt, cold vs warm, with and without the KVTier connector.

Every configuration gets its own vLLM engine, created and destroyed one after the other
in this process, on the locally built random-weight "bench" model (bf16):

* ``none``          no connector: the baseline cold prefill;
* ``kvtier``        KVTierConnector (CPU tier, load_mode sync): cold (first time, nothing
                    hits; blocks are saved) and warm (same prompt again, loaded back);
* ``kvtier-async``  the same with load_mode async;
* ``example``       vLLM's in-tree ExampleConnector (per-prompt safetensors files in a
                    temporary directory): cold and warm.

TTFT is the wall-clock time of one ``LLM.generate()`` of a single request with
``max_tokens=1``. Each configuration runs ``--repeats`` distinct prompts (so every cold is
really cold) after one warm-up request, and reports medians. The script also asserts that
every warm KVTier run loaded blocks (``vllm:kvtier_blocks_loaded`` went up) and that the
greedy tokens of warm runs (``max_tokens=4``) equal those of a cold no-connector run.

    python bench/ttft.py        # ~1.5 min on 2 quiet CPU cores, ~3 min under other load
    python bench/ttft.py --prompt-tokens 2048 --repeats 5 --json out.json

The machine is shared and noisy: compare ratios measured in the same run, not absolute
seconds across runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Unless the caller chose otherwise: an in-process engine (fast start), quiet vLLM logs
# (the plugin's own warnings still print), and no vLLM usage-stats thread: on a small
# machine its one-off system survey, run in the background of the first engine, stole
# hundreds of ms from requests timed there.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_kvtier.tinymodel import SIZES, VOCAB, build_model  # noqa: E402

WARM_COLD_TARGET = 0.2
OVERHEAD_TARGET = 1.05


def kvtier_counters(llm) -> dict[str, float]:
    """``{"blocks_loaded|cpu": value, ...}`` summed over engines, from vLLM's metrics."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:kvtier_"):
            continue
        value = getattr(m, "value", None)
        if value is None:
            continue
        key = f"{m.name.removeprefix('vllm:kvtier_')}|{m.labels.get('tier', '')}"
        out[key] = out.get(key, 0) + value
    return out


def delta(after: dict[str, float], before: dict[str, float], metric: str) -> dict[str, float]:
    """Per-tier increase of one counter."""
    res = {}
    for key, v in after.items():
        name, tier = key.split("|", 1)
        if name == metric and v - before.get(key, 0) > 0:
            res[tier] = v - before.get(key, 0)
    return res


def make_prompts(n_prompts: int, n_tokens: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, VOCAB) for _ in range(n_tokens)] for _ in range(n_prompts)]


def run_config(name: str, model_dir: Path, kv_transfer_config: dict | None, args,
               warmup_prompt: list[int], prompts: list[list[int]], check_prompt: list[int],
               with_warm: bool) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
        max_model_len=args.prompt_tokens + 64, enforce_eager=True,
        enable_prefix_caching=False, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_bytes, kv_transfer_config=kv_transfer_config,
        disable_log_stats=False, seed=0,
    )
    start_s = time.perf_counter() - t0
    sp1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    sp4 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)

    cpu_s = [0.0]

    def gen(p: list[int], sp) -> tuple[float, list[int]]:
        # Wall clock is the TTFT; the process CPU time (all threads) is kept beside it, to
        # tell waiting (e.g. for other jobs on a shared machine) from work.
        c, t = time.process_time(), time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        wall = time.perf_counter() - t
        cpu_s[0] = time.process_time() - c
        return wall, list(out[0].outputs[0].token_ids)

    gen(warmup_prompt, sp1)  # first-request costs (allocator, kernels) out of the timings
    runs = []
    for i, p in enumerate(prompts):
        rec: dict = {"prompt": i}
        before = kvtier_counters(llm)
        rec["cold_s"], rec["cold_tokens"] = gen(p, sp1)
        rec["cold_cpu_s"] = cpu_s[0]
        mid = kvtier_counters(llm)
        rec["cold_loaded"] = delta(mid, before, "blocks_loaded")
        if with_warm:
            rec["warm_s"], rec["warm_tokens"] = gen(p, sp1)
            rec["warm_cpu_s"] = cpu_s[0]
            rec["warm_loaded"] = delta(kvtier_counters(llm), mid, "blocks_loaded")
        runs.append(rec)
        print(f"  {name:13s} prompt {i}: cold {rec['cold_s']:.3f}s"
              + (f"  warm {rec['warm_s']:.3f}s  loaded {rec['warm_loaded']}" if with_warm else ""),
              flush=True)
    # Correctness: 4 greedy tokens. For connectors the prompt was seen above, so this is
    # a warm run; for "none" it is the cold reference.
    before = kvtier_counters(llm)
    _, check_tokens = gen(check_prompt, sp4)
    check_loaded = delta(kvtier_counters(llm), before, "blocks_loaded")
    counters = kvtier_counters(llm)

    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        cleanup_dist_env_and_memory()
    except Exception:  # pragma: no cover - best effort
        pass

    res = {
        "config": name, "engine_start_s": start_s, "runs": runs,
        "cold_median_s": statistics.median(r["cold_s"] for r in runs),
        "cold_cpu_median_s": statistics.median(r["cold_cpu_s"] for r in runs),
        "cold_min_s": min(r["cold_s"] for r in runs),
        "check_tokens": check_tokens, "check_loaded": check_loaded, "counters": counters,
    }
    if with_warm:
        res["warm_median_s"] = statistics.median(r["warm_s"] for r in runs)
        res["warm_over_cold"] = res["warm_median_s"] / res["cold_median_s"]
        res["warm_min_s"] = min(r["warm_s"] for r in runs)
        res["warm_over_cold_min"] = res["warm_min_s"] / res["cold_min_s"]
        res["warm_cpu_median_s"] = statistics.median(r["warm_cpu_s"] for r in runs)
        res["warm_over_cold_cpu"] = res["warm_cpu_median_s"] / res["cold_cpu_median_s"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/vllm_kvtier/bench-model"))
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=64, help="multiple of 32 on CPU")
    ap.add_argument("--kv-cache-bytes", type=int, default=512 * 2**20)
    ap.add_argument("--cpu-tier-bytes", type=int, default=2 * 2**30)
    ap.add_argument("--configs", default="none,kvtier,kvtier-async,example",
                    help="comma-separated subset of none,kvtier,kvtier-async,example")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "ttft.json"))
    args = ap.parse_args()

    import torch
    import vllm

    t_all = time.perf_counter()
    t = time.perf_counter()
    model_dir = build_model(args.model_dir, "bench", dtype="bfloat16",
                            max_position_embeddings=max(8192, args.prompt_tokens + 64))
    print(f"model: {model_dir} (bench {SIZES['bench']}, bf16; ready in {time.perf_counter() - t:.1f}s)")
    print(f"prompt {args.prompt_tokens} tokens, {args.repeats} prompts per config, "
          f"block_size {args.block_size}, load avg {os.getloadavg()[0]:.2f}", flush=True)

    warmup, *prompts = make_prompts(args.repeats + 1, args.prompt_tokens, args.seed)
    check_prompt = prompts[0]

    def kvtier(mode: str) -> dict:
        return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "vllm_kvtier.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"cpu": {"capacity_bytes": args.cpu_tier_bytes},
                                              "load_mode": mode}}

    storage = tempfile.mkdtemp(prefix="kvtier-bench-example-")
    plan = {
        "none": (None, False),
        "kvtier": (kvtier("sync"), True),
        "kvtier-async": (kvtier("async"), True),
        "example": ({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": storage}}, True),
    }
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    if "none" not in wanted:
        wanted.insert(0, "none")  # the baseline and the reference tokens
    results: dict[str, dict] = {}
    try:
        for name in wanted:
            cfg, with_warm = plan[name]
            results[name] = run_config(name, model_dir, cfg, args, warmup, prompts,
                                       check_prompt, with_warm)
    finally:
        shutil.rmtree(storage, ignore_errors=True)

    # ---- checks ------------------------------------------------------------------
    failures = []
    ref = results["none"]
    for name, res in results.items():
        if name == "none":
            continue
        for r in res["runs"]:
            if r["warm_tokens"] != ref["runs"][r["prompt"]]["cold_tokens"] or \
                    r["cold_tokens"] != ref["runs"][r["prompt"]]["cold_tokens"]:
                failures.append(f"{name} prompt {r['prompt']}: first token differs from no-connector cold")
            if name.startswith("kvtier") and not sum(r["warm_loaded"].values()) > 0:
                failures.append(f"{name} prompt {r['prompt']}: warm run loaded no blocks")
            if name.startswith("kvtier") and sum(r["cold_loaded"].values()) > 0:
                failures.append(f"{name} prompt {r['prompt']}: cold run loaded blocks (not cold)")
        if res["check_tokens"] != ref["check_tokens"]:
            failures.append(f"{name}: 4 greedy tokens {res['check_tokens']} != cold {ref['check_tokens']}")
        if name.startswith("kvtier") and not sum(res["check_loaded"].values()) > 0:
            failures.append(f"{name}: the 4-token warm check loaded no blocks")

    # ---- table -------------------------------------------------------------------
    base = ref["cold_median_s"]
    print()
    print(f"TTFT, {args.prompt_tokens}-token prompt, median of {args.repeats} (wall clock, s)")
    hdr = f"{'config':14s} {'cold':>8s} {'warm':>8s} {'warm/cold':>10s} {'cold/cold(none)':>16s} {'blocks loaded/warm':>19s}"
    print(hdr)
    print("-" * len(hdr))
    for name, res in results.items():
        warm = res.get("warm_median_s")
        res["cold_over_none"] = res["cold_median_s"] / base
        loaded = "-"
        if warm is not None and name.startswith("kvtier"):
            loaded = str(int(statistics.median(sum(r["warm_loaded"].values()) for r in res["runs"])))
        warm_s = f"{warm:8.3f}" if warm is not None else f"{'-':>8s}"
        ratio = f"{res['warm_over_cold']:10.3f}" if warm is not None else f"{'-':>10s}"
        print(f"{name:14s} {res['cold_median_s']:8.3f} {warm_s} {ratio} "
              f"{res['cold_over_none']:16.3f} {loaded:>19s}")
    print()
    print("same, best of the repeats (wall clock, s; the least disturbed by other load)")
    for name, res in results.items():
        res["cold_over_none_min"] = res["cold_min_s"] / ref["cold_min_s"]
        w = res.get("warm_min_s")
        warm_s = f"{w:8.3f}" if w is not None else f"{'-':>8s}"
        ratio = f"{res['warm_over_cold_min']:10.3f}" if w is not None else f"{'-':>10s}"
        print(f"{name:14s} {res['cold_min_s']:8.3f} {warm_s} {ratio} {res['cold_over_none_min']:16.3f}")
    print()
    print("same, process CPU time (s; all threads; idle-waiting OpenMP threads spin, so it too rises under other load)")
    for name, res in results.items():
        res["cold_over_none_cpu"] = res["cold_cpu_median_s"] / ref["cold_cpu_median_s"]
        w = res.get("warm_cpu_median_s")
        warm_s = f"{w:8.3f}" if w is not None else f"{'-':>8s}"
        ratio = f"{res['warm_over_cold_cpu']:10.3f}" if w is not None else f"{'-':>10s}"
        print(f"{name:14s} {res['cold_cpu_median_s']:8.3f} {warm_s} {ratio} {res['cold_over_none_cpu']:16.3f}")
    print()
    summary = {}
    if "kvtier" in results:
        wc = results["kvtier"]["warm_over_cold"]
        ov = results["kvtier"]["cold_over_none"]
        summary = {"warm_over_cold": wc, "cold_overhead": ov,
                   "warm_over_cold_ok": wc <= WARM_COLD_TARGET, "cold_overhead_ok": ov <= OVERHEAD_TARGET,
                   "warm_over_cold_min": results["kvtier"]["warm_over_cold_min"],
                   "cold_overhead_min": results["kvtier"]["cold_over_none_min"],
                   "warm_over_cold_cpu": results["kvtier"]["warm_over_cold_cpu"],
                   "cold_overhead_cpu": results["kvtier"]["cold_over_none_cpu"]}
        print(f"warm/cold target <= {WARM_COLD_TARGET}: kvtier {wc:.3f} "
              f"{'PASS' if wc <= WARM_COLD_TARGET else 'MISS'}")
        print(f"cold overhead target <= {OVERHEAD_TARGET}: kvtier cold/cold(none) {ov:.3f} "
              f"{'PASS' if ov <= OVERHEAD_TARGET else 'MISS'}")
        if "kvtier-async" in results:
            summary["async_warm_over_cold"] = results["kvtier-async"]["warm_over_cold"]
            print(f"  (kvtier-async warm/cold {results['kvtier-async']['warm_over_cold']:.3f}, "
                  f"cold/cold(none) {results['kvtier-async']['cold_over_none']:.3f})")
    print(f"greedy tokens warm == cold: {'yes' if not failures else 'NO'}  "
          f"(4-token reference {ref['check_tokens']})")
    for f in failures:
        print("FAIL:", f)
    total = time.perf_counter() - t_all
    print(f"total {total:.0f}s, load avg {os.getloadavg()[0]:.2f}")

    out = {
        "prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "block_size": args.block_size,
        "model": {"size": "bench", "dtype": "bfloat16", **SIZES["bench"]},
        "targets": {"warm_over_cold": WARM_COLD_TARGET, "cold_overhead": OVERHEAD_TARGET},
        "summary": summary, "failures": failures, "results": results,
        "env": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
                "cpus": os.cpu_count(), "machine": platform.machine(), "total_s": total,
                "loadavg_end": os.getloadavg()},
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
