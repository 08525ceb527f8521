"""Load or recompute: TTFT when the tier below CPU is slow, with the decision on (``auto``)
against always loading, and against no plugin (always recomputing), side by side.

What it runs, in one process, one engine at a time (vLLM on this CPU machine, the 6-layer
``bench`` model with random weights, bf16):

1. a moto S3 server on 127.0.0.1 and a fault proxy in front of it that delays every
   request by ``--delay-s`` (a throttled, far-away endpoint);
2. a *store* engine writes the KV of ``--prompts`` long prompts to the bucket
   (write-through, straight to moto), then exits;
3. for each configuration a fresh engine (empty CPU tier; the bucket is listed at
   start) serves a warm-up prompt (not stored: it measures the prefill rate), then each
   stored prompt once (``max_tokens=1``: the time is the TTFT):
   * ``none``: no plugin, every prompt recomputed;
   * ``always-slow`` / ``auto-slow``: the plugin through the slow proxy, with
     ``load_or_recompute.enabled`` false / true;
   * ``always-fast`` / ``auto-fast``: the plugin straight to moto (a fast tier: auto
     must keep loading).

Reported per configuration: TTFT mean/p50/max, blocks loaded from S3, blocks the policy
chose to recompute, and the first token of every prompt against ``none`` (must be equal:
loaded KV is exact). The ratio that matters: ``auto-slow`` over ``always-slow`` mean TTFT.

    python bench/load_or_recompute.py                  # 2048-token prompts, 4 of them, 3 s delay
    python bench/load_or_recompute.py --prompt-tokens 4096 --delay-s 5

Writes bench/results/load_or_recompute.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from bench.ttft import Engine, make_prompts  # noqa: E402
from testkit.s3_server import FaultProxy, MotoServer, aws_test_env  # noqa: E402
from testkit.tinymodel import build_model  # noqa: E402


def kv_config(endpoint: str, bucket: str, args: argparse.Namespace, *, auto: bool) -> dict:
    return {
        "kv_connector": "KVTierConnector", "kv_connector_module_path": "vllm_kvtier.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "cpu": {"capacity_bytes": 256 * 2**20},
            "s3": {"bucket": bucket, "endpoint_url": endpoint, "path_style": True, "rescan_interval_s": 0,
                   "deadline_s": args.delay_s * 4 + 10, "read_timeout_s": args.delay_s * 2 + 5},
            "load_or_recompute": {"enabled": auto},
        },
    }


def run(name: str, model: Path, kv: dict | None, warmup: list[int], prompts: list[list[int]],
        args: argparse.Namespace) -> dict:
    eng = Engine(model, kv, args)
    try:
        eng.gen(warmup, eng.sp1)
        before = eng.counters()
        ttft, first = [], []
        for p in prompts:
            s, toks = eng.gen(p, eng.sp1)
            ttft.append(s)
            first.append(toks[0])
        c = eng.counters()
    finally:
        eng.close()

    def d(k: str) -> float:
        return c.get(k, 0) - before.get(k, 0)

    row = {
        "config": name, "ttft_s": ttft, "mean_s": statistics.mean(ttft), "p50_s": statistics.median(ttft),
        "max_s": max(ttft), "first_tokens": first, "loaded_s3": d("blocks_loaded|s3"),
        "recomputed_by_policy_s3": d("recompute_chosen_blocks|s3"), "probes": d("load_probes|all"),
        "load_failures_s3": d("load_failures|s3"),
        "est_s3_MBps": c.get("estimated_bandwidth_bytes_per_second|s3", 0) / 1e6,
        "est_prefill_tok_s": c.get("estimated_prefill_tokens_per_second|compute", 0),
    }
    print(f"  {name:12s} TTFT mean {row['mean_s']:6.2f} s  p50 {row['p50_s']:6.2f} s  max {row['max_s']:6.2f} s  "
          f"loaded {row['loaded_s3']:4.0f}  recomputed by policy {row['recomputed_by_policy_s3']:4.0f}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/vllm_kvtier/bench-model"))
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--delay-s", type=float, default=3.0, help="added to every request to the slow endpoint")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--kv-cache-bytes", type=int, default=256 * 2**20)
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "load_or_recompute.json"))
    args = ap.parse_args()

    model = build_model(args.model_dir, "bench", dtype="bfloat16",
                        max_position_embeddings=max(8192, args.prompt_tokens + 64))
    warm_store, warmup, *prompts = make_prompts(args.prompts + 2, args.prompt_tokens, args.seed)
    rows = []
    with aws_test_env():
        server = MotoServer(Path(tempfile.mkdtemp(prefix="kvtier-bench-lr-")))
        server.start()
        proxy = FaultProxy(server.url)
        proxy.delay(args.delay_s)
        try:
            bucket = server.create_bucket()
            t = time.perf_counter()
            store = Engine(model, kv_config(server.url, bucket, args, auto=False), args)
            try:
                for p in [warm_store, *prompts]:
                    store.gen(p, store.sp1)
                store.drain()
            finally:
                store.close()
            print(f"stored {len(prompts)} prompts of {args.prompt_tokens} tokens in "
                  f"{time.perf_counter() - t:.1f} s; slow endpoint adds {args.delay_s} s per request", flush=True)
            rows.append(run("none", model, None, warmup, prompts, args))
            for name, endpoint, auto in [("always-slow", proxy.url, False), ("auto-slow", proxy.url, True),
                                         ("always-fast", server.url, False), ("auto-fast", server.url, True)]:
                rows.append(run(name, model, kv_config(endpoint, bucket, args, auto=auto), warmup, prompts, args))
        finally:
            proxy.close()
            server.stop()
    by = {r["config"]: r for r in rows}
    ratio = by["auto-slow"]["mean_s"] / by["always-slow"]["mean_s"]
    fast_ratio = by["auto-fast"]["mean_s"] / by["always-fast"]["mean_s"]
    same = all(r["first_tokens"] == by["none"]["first_tokens"] for r in rows)
    print(f"\nslow tier: auto / always-load mean TTFT = {ratio:.2f} (target < 1: recompute beats a slow load)")
    print(f"fast tier: auto / always-load mean TTFT = {fast_ratio:.2f} (expected ~1: auto keeps loading)")
    print(f"first tokens equal to no-plugin in every configuration: {same}")
    out = {
        "benchmark": "load_or_recompute", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args),
        "rows": rows, "auto_over_always_slow": ratio, "auto_over_always_fast": fast_ratio, "tokens_equal": same,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "loadavg": os.getloadavg()},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
