"""Decode-instance TTFT with prefill/decode disaggregation through a Mooncake pool, against
the same instance recomputing the prompt.

The setup, all on 127.0.0.1, on the locally built random-weight "bench" model (bf16):

* a ``mooncake_master`` (tests/mooncake_server.py);
* a prefill instance (``kv_role: kv_producer``, its own process: this script with
  ``--prefill-worker``): a vLLM engine with the KVTier connector, a CPU tier and the
  Mooncake tier (write-through, the instance's DRAM segment hosts the pool). It computes
  every prompt (``max_tokens=1``, its TTFT is recorded too), steps until its connector is
  idle, and stays in the pool until this script is done;
* then, in this process, one engine after the other:
  - ``pd``: a decode instance (``kv_role: kv_consumer``, a pure pool client with no
    segment) serving each prompt with the handoff parameters a proxy would pass,
    ``{"do_remote_prefill": True, "kvtier_pool_blocks": N}``: it loads the prompt's blocks
    from the pool (over Mooncake's transfer engine from the prefill process) and computes
    only the last block;
  - ``recompute``: the same engine without the connector, computing every prompt.

TTFT is the wall-clock time of one ``LLM.generate()`` of a single request with
``max_tokens=1`` (the decode instance's time to first token; the proxy's round trip and
the prefill itself are not in it). ``--repeats`` distinct prompts after one warm-up
prompt (the warm-up also goes through the pool on the ``pd`` engine), medians reported.
Checked: every first token of ``pd`` equals ``recompute``'s (and the prefill instance's),
and every ``pd`` request loaded ``(prompt_tokens - 1) // block_size`` blocks from the pool
with no handoff timeout. The ratio P/D over recompute should be well below 1 (lower is
better); for reference, the spine's warm/cold target for the CPU tier is 0.2.

Both instances run with the plugin's defaults. (This benchmark found two bugs, fixed
since: a full pool write queue counted as a failing tier and paused its writes, and the
load-or-recompute estimate took per-read times of parallel reads as the tier's speed; the
flags below reproduce the old settings for comparison.)

    python bench/pd_ttft.py                    # 4096-token prompts, 3 repeats: ~2-4 min on 2 CPU cores
    python bench/pd_ttft.py --prompt-tokens 2048 --repeats 5
    OMP_WAIT_POLICY=PASSIVE python bench/pd_ttft.py

On a small machine, OpenMP's default active wait matters here: the decode instance's
block copies (one small torch ``copy_`` per block and layer) and its forward share the
cores with the pool client's threads, and spinning OpenMP threads slowed both by ~10x in
one profile (2.2 s to copy 25 MB into the CPU tier); ``OMP_WAIT_POLICY=PASSIVE`` removed it.
The variable is recorded in the JSON; both engines of a run get the same setting.

The machine is shared and noisy: compare ratios from the same run, not seconds across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# bench.ttft sets the same environment defaults as there (in-process engines, quiet vLLM,
# no usage-stats thread) on import, before vLLM is imported.
from bench.ttft import Engine, delta, make_prompts  # noqa: E402
from vllm_kvtier.tinymodel import SIZES, build_model  # noqa: E402

MiB = 1 << 20
REFERENCE_WARM_COLD = 0.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=os.path.expanduser("~/.cache/vllm_kvtier/bench-model"))
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=64, help="multiple of 32 on CPU")
    p.add_argument("--kv-cache-bytes", type=int, default=512 * MiB)
    p.add_argument("--cpu-tier-bytes", type=int, default=512 * MiB)
    p.add_argument("--segment-bytes", type=int, default=1 << 30, help="the prefill instance's pool segment")
    p.add_argument("--load-or-recompute", choices=["off", "on"], default="on",
                   help="the decode instance's load_or_recompute policy (the plugin's default: on)")
    p.add_argument("--max-queued-writes", type=int, default=256,
                   help="the prefill instance's mooncake.max_queued_writes (the tier's default: 256)")
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "pd_ttft.json"))
    p.add_argument("--prefill-worker", default=None, help=argparse.SUPPRESS)  # internal: the spec file
    return p.parse_args(argv)


def kv_config(role: str, master: str, args: argparse.Namespace) -> dict[str, Any]:
    mooncake: dict[str, Any] = {"master": master, "local_hostname": "127.0.0.1", "protocol": "tcp",
                                "transfer_buffer_bytes": 128 * MiB, "deadline_s": 10.0, "handoff_wait_s": 10.0}
    if role == "kv_producer":
        mooncake.update(global_segment_bytes=args.segment_bytes, mode="write-through",
                        max_queued_writes=args.max_queued_writes)
    else:
        mooncake.update(global_segment_bytes=0)  # the decode instance only reads the pool
    extra: dict[str, Any] = {"cpu": {"capacity_bytes": args.cpu_tier_bytes}, "load_mode": "sync", "mooncake": mooncake}
    if role == "kv_consumer":
        extra["load_or_recompute"] = {"enabled": args.load_or_recompute == "on"}
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "vllm_kvtier.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


# ---- the prefill instance (its own process) -----------------------------------------------------


def prefill_worker(spec_path: Path) -> int:
    """Compute every prompt on a kv_producer engine, report, then stay in the pool until
    the hold file exists (or 20 minutes pass)."""
    spec = json.loads(spec_path.read_text())
    args = argparse.Namespace(**spec["args"])
    eng = Engine(Path(spec["model_dir"]), spec["kv"], args)
    runs = []
    for i, p in enumerate(spec["prompts"]):
        before = eng.counters()
        secs, tokens = eng.gen(p, eng.sp1)
        runs.append({"prompt": i, "ttft_s": secs, "tokens": tokens,
                     "stored": delta(eng.counters(), before, "blocks_stored")})
    # The last prompt's final saves run in the next engine step. The pool puts then finish
    # on the store's threads, but an idle engine polls no results, so the last prompt's
    # puts may be missing from the counters here; the decode side waits for the blocks
    # themselves (handoff_wait_s) and its counters say what it loaded.
    steps = eng.drain()
    report = {"engine_start_s": eng.start_s, "runs": runs, "drain_steps": steps, "counters": eng.counters()}
    tmp = Path(spec["result"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.rename(spec["result"])
    hold, until = Path(spec["hold"]), time.monotonic() + 1200
    while not hold.exists() and time.monotonic() < until:
        time.sleep(0.1)
    eng.close()
    return 0


def start_prefill(work: Path, model_dir: Path, kv: dict, prompts: list[list[int]],
                  args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], Path, Path, Path]:
    spec = {"model_dir": str(model_dir), "kv": kv, "prompts": prompts, "result": str(work / "prefill.json"),
            "hold": str(work / "prefill-may-exit"),
            "args": {"prompt_tokens": args.prompt_tokens, "block_size": args.block_size,
                     "kv_cache_bytes": args.kv_cache_bytes}}
    spec_path = work / "prefill-spec.json"
    spec_path.write_text(json.dumps(spec))
    log = work / "prefill.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--prefill-worker", str(spec_path)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, Path(spec["result"]), Path(spec["hold"]), log


def wait_prefill(proc: subprocess.Popen[bytes], result: Path, log: Path, timeout_s: float) -> dict:
    until = time.monotonic() + timeout_s
    while not result.exists():
        if proc.poll() is not None or time.monotonic() > until:
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the prefill instance failed (rc {proc.returncode}):\n{tail}")
        time.sleep(0.2)
    return json.loads(result.read_text())


# ---- the decode side (this process) -------------------------------------------------------------


def serve(name: str, model_dir: Path, kv: dict | None, args: argparse.Namespace, warmup: list[int],
          prompts: list[list[int]], handoff: dict | None) -> dict:
    from vllm import SamplingParams

    eng = Engine(model_dir, kv, args)
    extra = {"kv_transfer_params": handoff} if handoff is not None else None
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False, extra_args=extra)
    before = eng.counters()
    eng.gen(warmup, sp)  # first-request costs (allocator, kernels, the pool connection) out of the timings
    warmup_loaded = delta(eng.counters(), before, "blocks_loaded")
    runs = []
    for i, p in enumerate(prompts):
        before = eng.counters()
        secs, tokens = eng.gen(p, sp)
        after = eng.counters()
        rec = {"prompt": i, "ttft_s": secs, "cpu_s": eng.cpu_s, "tokens": tokens,
               "loaded": delta(after, before, "blocks_loaded"),
               "handoff_timeouts": delta(after, before, "handoff_timeouts"),
               "load_failures": delta(after, before, "load_failures")}
        runs.append(rec)
        print(f"  {name:9s} prompt {i}: TTFT {secs:.3f}s  first token {tokens}"
              + (f"  loaded {rec['loaded']}" if kv is not None else ""), flush=True)
    res = {"config": name, "engine_start_s": eng.start_s, "runs": runs, "warmup_loaded": warmup_loaded,
           "counters": eng.counters(), "ttft_median_s": statistics.median(r["ttft_s"] for r in runs),
           "ttft_min_s": min(r["ttft_s"] for r in runs),
           "cpu_median_s": statistics.median(r["cpu_s"] for r in runs)}
    eng.close()
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prefill_worker:
        return prefill_worker(Path(args.prefill_worker))

    import torch
    import vllm

    from tests.mooncake_server import MooncakeMaster

    t_all = time.perf_counter()
    model_dir = build_model(args.model_dir, "bench", dtype="bfloat16",
                            max_position_embeddings=max(8192, args.prompt_tokens + 64))
    warmup, *prompts = make_prompts(args.repeats + 1, args.prompt_tokens, args.seed)
    expect_loaded = (args.prompt_tokens - 1) // args.block_size
    handoff = {"do_remote_prefill": True, "kvtier_pool_blocks": args.prompt_tokens // args.block_size}
    print(f"model: {model_dir} (bench {SIZES['bench']}, bf16); {args.prompt_tokens}-token prompts, "
          f"{args.repeats} per config, block_size {args.block_size}, load avg {os.getloadavg()[0]:.2f}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}", flush=True)

    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-pd-bench-")))
        master = MooncakeMaster(work)
        master.start()
        stack.callback(master.stop)
        t = time.perf_counter()
        proc, result, hold, log = start_prefill(work, model_dir, kv_config("kv_producer", master.address, args),
                                                [warmup, *prompts], args)

        def stop_prefill() -> None:
            hold.touch()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

        stack.callback(stop_prefill)
        prefill = wait_prefill(proc, result, log, 900)
        prefill_ttfts_all = [r["ttft_s"] for r in prefill["runs"]]
        print(f"  prefill   (kv_producer, pid {proc.pid}, pool {master.address}): "
              f"{len(prefill['runs'])} prompts computed and stored in {time.perf_counter() - t:.1f}s "
              f"(TTFT {', '.join(f'{x:.2f}' for x in prefill_ttfts_all)}s; "
              f"pool puts counted {prefill['counters'].get('blocks_stored|mooncake', 0):.0f})", flush=True)
        pd = serve("pd", model_dir, kv_config("kv_consumer", master.address, args), args, warmup, prompts, handoff)
        recompute = serve("recompute", model_dir, None, args, warmup, prompts, None)
        stop_prefill()
        prefill_warnings = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("kvtier")]

    # ---- checks ------------------------------------------------------------------
    failures = []
    for i, (a, b) in enumerate(zip(pd["runs"], recompute["runs"], strict=True)):
        if a["tokens"] != b["tokens"]:
            failures.append(f"prompt {i}: P/D first token {a['tokens']} != recompute {b['tokens']}")
        if prefill["runs"][i + 1]["tokens"] != b["tokens"]:
            failures.append(f"prompt {i}: prefill instance's token {prefill['runs'][i + 1]['tokens']} "
                            f"!= recompute {b['tokens']}")
        if a["loaded"].get("mooncake", 0) != expect_loaded:
            failures.append(f"prompt {i}: P/D loaded {a['loaded']} blocks, expected {expect_loaded} from mooncake")
        if a["handoff_timeouts"] or a["load_failures"]:
            failures.append(f"prompt {i}: handoff timeouts {a['handoff_timeouts']}, "
                            f"load failures {a['load_failures']}")

    ratio = pd["ttft_median_s"] / recompute["ttft_median_s"]
    ratio_min = pd["ttft_min_s"] / recompute["ttft_min_s"]
    prefill_ttfts = [r["ttft_s"] for r in prefill["runs"][1:]]
    print()
    print(f"decode-instance TTFT, {args.prompt_tokens}-token prompts, {args.repeats} prompts (wall clock, s)")
    hdr = f"{'config':10s} {'median':>8s} {'best':>8s} {'CPU s':>8s} {'blocks from pool':>17s}"
    print(hdr)
    print("-" * len(hdr))
    for r in (pd, recompute):
        loaded = (f"{statistics.median(x['loaded'].get('mooncake', 0) for x in r['runs']):.0f} of {expect_loaded}"
                  if r is pd else "-")
        print(f"{r['config']:10s} {r['ttft_median_s']:8.3f} {r['ttft_min_s']:8.3f} {r['cpu_median_s']:8.3f} "
              f"{loaded:>17s}")
    print(f"(the prefill instance, kv_producer writing through to the pool, in its own process before these: "
          f"TTFT median {statistics.median(prefill_ttfts):.3f}s, best {min(prefill_ttfts):.3f}s; not paired)")
    print()
    print(f"P/D over recompute: median {ratio:.3f}, best {ratio_min:.3f} (lower is better)")
    verdict = "PASS" if ratio < 1.0 else "FAIL"
    print(f"target P/D TTFT < recompute TTFT: {verdict}  (reference: the CPU tier's warm/cold target "
          f"<= {REFERENCE_WARM_COLD}: {'within' if ratio <= REFERENCE_WARM_COLD else 'above'})")
    print(f"first tokens P/D == recompute == prefill instance: {'yes' if not failures else 'NO'}")
    for f in failures:
        print("FAIL:", f)
    if prefill_warnings:
        print(f"the prefill instance warned ({len(prefill_warnings)} lines): " + " | ".join(prefill_warnings[:5]))
    total = time.perf_counter() - t_all
    print(f"total {total:.0f}s, load avg {os.getloadavg()[0]:.2f}")

    out = {
        "benchmark": "pd_ttft", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args),
        "model": {"size": "bench", "dtype": "bfloat16", **SIZES["bench"]},
        "summary": {"pd_over_recompute": ratio, "pd_over_recompute_best": ratio_min,
                    "pd_ttft_median_s": pd["ttft_median_s"], "recompute_ttft_median_s": recompute["ttft_median_s"],
                    "prefill_ttft_median_s": statistics.median(prefill_ttfts),
                    "target_pd_below_recompute": ratio < 1.0, "tokens_equal": not failures},
        "failures": failures, "prefill_warnings": prefill_warnings, "pd": pd, "recompute": recompute, "prefill": prefill,
        "env": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
                "cpus": os.cpu_count(), "machine": platform.machine(), "total_s": total,
                "loadavg_end": os.getloadavg(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
