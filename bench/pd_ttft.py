"""Decode-instance TTFT with prefill/decode disaggregation, through a Mooncake pool and peer
to peer over NIXL, against the same instance recomputing the prompt.

The setup, all on 127.0.0.1, on the locally built random-weight "bench" model (bf16). For
each path of ``--paths`` (default ``pool,nixl``), one path after the other:

* a prefill instance (``kv_role: kv_producer``, its own process: this script with
  ``--prefill-worker``): a vLLM engine with the KVTier connector and a CPU tier. It
  computes every prompt (``max_tokens=1``, its TTFT is recorded too), steps until its
  connector is idle, and stays up until this script is done with the path:
  - ``pool``: with the Mooncake tier, write-through, and a ``mooncake_master``
    (testkit/mooncake_server.py); the instance's DRAM segment hosts the pool;
  - ``nixl``: with a ``nixl`` section. Every request carries ``{"do_remote_decode": True}``
    and its answer's ``kv_transfer_params`` offer the prompt's blocks where they sit in
    the CPU tier (``kvtier_peer``: each rank's NIXL address, the slots, the block keys),
    pinned for ``hold_s`` (longer than the whole run: no offer expires). One short request
    runs first: the workers publish their NIXL address with their first step. While it
    waits it steps every 20 ms, to see the decode side's release notifications;
* a decode instance in this process (``kv_role: kv_consumer``) serving each prompt with
  the hand-off parameters a proxy would pass; it computes only the last block:
  - ``pool``: ``{"do_remote_prefill": True, "kvtier_pool_blocks": N}``; a pure pool
    client (no segment) that loads the prompt's blocks from the pool (over Mooncake's
    transfer engine from the prefill process);
  - ``nixl``: the prefill instance's answer plus ``"do_remote_prefill": True``; it reads
    the blocks straight out of the prefill process's CPU tier (one UCX read per request),
    then notifies the prefill instance, which releases them.

Then, with no prefill instance left, ``recompute``: the same engine without the connector,
computing every prompt; each path's ratio is against this one run.

TTFT is the wall-clock time of one ``LLM.generate()`` of a single request with
``max_tokens=1`` (the decode instance's time to first token; the proxy's round trip and
the prefill itself are not in it). ``--repeats`` distinct prompts after one warm-up
prompt (the warm-up also goes through the path's hand-off), medians reported. Checked
per path: every first token equals ``recompute``'s (and the prefill instance's); every
request loaded ``(prompt_tokens - 1) // block_size`` blocks from the path's tier
(``mooncake``, ``peer``) with no hand-off timeout and no load failure; ``nixl``: the prefill
instance offered every prompt's full blocks and every offer was released by the decode
side's read (``peer_released_blocks`` == ``peer_offered_blocks``, no
``peer_hold_timeouts``). The ratio P/D over recompute should be well below 1 (lower is
better); for reference, the spine's warm/cold target for the CPU tier is 0.2.

Both instances run with the plugin's defaults. (This benchmark found two bugs in the pool
path, fixed since: a full pool write queue counted as a failing tier and paused its
writes, and the load-or-recompute estimate took per-read times of parallel reads as the
tier's speed; ``--max-queued-writes`` and ``--load-or-recompute`` reproduce the old
settings for comparison. Peer reads bypass load-or-recompute.)

    python bench/pd_ttft.py                    # both paths, 4096-token prompts, 3 repeats
    python bench/pd_ttft.py --prompt-tokens 2048 --repeats 3   # ~6 min on a shared 2-vCPU VM
    python bench/pd_ttft.py --paths nixl --repeats 5
    OMP_WAIT_POLICY=PASSIVE python bench/pd_ttft.py

``UCX_MODULES=^ib`` is set unless the caller set it (as in bench/nixl_throughput.py):
without an RDMA NIC but with libibverbs' provider plugins installed, a process that used
UCX can crash at exit. The ``nixl`` path needs NIXL (tools/setup-remote.sh installs it),
the ``pool`` path Mooncake.

On a small machine, OpenMP's default active wait matters here: the decode instance's
block copies (one small torch ``copy_`` per block and layer) and its forward share the
cores with the pool client's threads, and spinning OpenMP threads slowed both by ~10x in
one profile (2.2 s to copy 25 MB into the CPU tier); ``OMP_WAIT_POLICY=PASSIVE`` removed it.
The variable is recorded in the JSON; all engines of a run get the same setting.

NIXL's own progress thread (the UCX backend's ``nixlUcxSharedThread``; NIXL's Python API
starts it with no delay between polls) busy-polls about one core in every process that has
an agent, idle or not (9.7 s of CPU in 10 s in an idle prefill engine here). This benchmark
found it; the plugin now leaves it off by default (``nixl.progress_thread``) and progresses
transfers as the worker polls them each step. With it on, on 2 vCPUs, the decode instance's
CPU time per request was ~1.8 s instead of ~1.0 s and the NIXL path's ratio 0.26-0.71
instead of 0.058.

The JSON has one entry per path under ``paths`` (its summary, decode runs, prefill runs and
the prefill instance's final counters); the pool path's figures also stay where they were
before ``--paths`` (``summary.pd_over_recompute``, ``pd``, ``prefill``), which
``kvtier bench`` reads.

The machine is shared and noisy: compare ratios from the same run, not seconds across runs.
"""

from __future__ import annotations

import argparse
import importlib.util
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

# Before any NIXL agent, and inherited by the prefill process (see the module doc).
os.environ.setdefault("UCX_MODULES", "^ib")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# bench.ttft sets the same environment defaults as there (in-process engines, quiet vLLM,
# no usage-stats thread) on import, before vLLM is imported.
from bench.ttft import Engine, delta, make_prompts  # noqa: E402
from testkit.tinymodel import SIZES, build_model  # noqa: E402

MiB = 1 << 20
REFERENCE_WARM_COLD = 0.2
PATHS = ("pool", "nixl")
TIER = {"pool": "mooncake", "nixl": "peer"}  # the tier label of each path's loads
NEEDS = {"pool": ("mooncake",), "nixl": ("nixl", "nixl_cu12")}  # Python packages: any one of them
# How long a prefill instance waits for this script, and keeps its NIXL offers pinned:
# longer than any run, so that no offer expires before the decode side reads it.
HOLD_S = 1800.0


def parse_paths(text: str) -> tuple[str, ...]:
    paths = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in paths if p not in PATHS]
    if not paths or bad or len(set(paths)) != len(paths):
        raise argparse.ArgumentTypeError(f"a comma list of distinct paths from {', '.join(PATHS)}; "
                                         f"got {text!r}")
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", type=parse_paths, default=PATHS,
                   help="comma list, run in this order: pool (Mooncake), nixl (peer to peer); default both")
    p.add_argument("--model-dir", default=os.path.expanduser("~/.cache/vllm_kvtier/bench-model"))
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=64, help="multiple of 32 on CPU")
    p.add_argument("--kv-cache-bytes", type=int, default=512 * MiB)
    p.add_argument("--cpu-tier-bytes", type=int, default=512 * MiB)
    p.add_argument("--segment-bytes", type=int, default=1 << 30, help="pool: the prefill instance's pool segment")
    p.add_argument("--load-or-recompute", choices=["off", "on"], default="on",
                   help="the decode instance's load_or_recompute policy (the plugin's default: on)")
    p.add_argument("--max-queued-writes", type=int, default=256,
                   help="pool: the prefill instance's mooncake.max_queued_writes (the tier's default: 256)")
    p.add_argument("--nixl-deadline-s", type=float, default=5.0, help="nixl: nixl.deadline_s of both instances")
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "pd_ttft.json"))
    p.add_argument("--prefill-worker", default=None, help=argparse.SUPPRESS)  # internal: the spec file
    args = p.parse_args(argv)
    missing = [path for path in args.paths if all(importlib.util.find_spec(m) is None for m in NEEDS[path])]
    if missing and args.prefill_worker is None:
        p.error(f"--paths {','.join(missing)}: {', '.join(NEEDS[m][0] for m in missing)} not installed "
                f"(tools/setup-remote.sh installs it); --paths chooses the paths")
    return args


def kv_config(path: str, role: str, args: argparse.Namespace, master: str = "") -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu": {"capacity_bytes": args.cpu_tier_bytes}, "load_mode": "sync"}
    if path == "pool":
        mooncake: dict[str, Any] = {"master": master, "local_hostname": "127.0.0.1", "protocol": "tcp",
                                    "transfer_buffer_bytes": 128 * MiB, "deadline_s": 10.0, "handoff_wait_s": 10.0,
                                    "accept_handoffs": True}
        if role == "kv_producer":
            mooncake.update(global_segment_bytes=args.segment_bytes, mode="write-through",
                            max_queued_writes=args.max_queued_writes)
        else:
            mooncake.update(global_segment_bytes=0)  # the decode instance only reads the pool
        extra["mooncake"] = mooncake
    else:
        # The prefill agents are named pd-...; the decode side reads and trusts those only.
        # Every offer is held for the whole run (HOLD_S), so let offers hold most slots.
        # The prefill side answers do_remote_decode (off by default: clients can send it).
        extra["nixl"] = {"deadline_s": args.nixl_deadline_s, "hold_s": HOLD_S, "agent_name": "pd",
                         "trusted_peers": ["pd-*"], "max_offered_fraction": 0.9,
                         "accept_remote_decode": role == "kv_producer"}
    if role == "kv_consumer":
        extra["load_or_recompute"] = {"enabled": args.load_or_recompute == "on"}
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "vllm_kvtier.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def sampling(kv_transfer_params: dict | None) -> Any:
    """Greedy, one token; ``kv_transfer_params`` as a proxy passes them."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False, extra_args=extra)


def write_json(path: Path, data: dict) -> None:
    """Whole or not at all: the other process polls for the file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, default=str))
    tmp.rename(path)


# ---- the prefill instance (its own process) -----------------------------------------------------


def offers_open(c: dict[str, float]) -> bool:
    """Offered blocks neither released by a read nor timed out."""
    return c.get("peer_offered_blocks|peer", 0) > c.get("peer_released_blocks|peer", 0) + \
        c.get("peer_hold_timeouts|peer", 0)


def prefill_worker(spec_path: Path) -> int:
    """Compute every prompt on a kv_producer engine and report (``result``), stay up until
    the hold file exists (or ``HOLD_S`` passes), then report the final counters (``final``)."""
    spec = json.loads(spec_path.read_text())
    args = argparse.Namespace(**spec["args"])
    nixl = spec["path"] == "nixl"
    eng = Engine(Path(spec["model_dir"]), spec["kv"], args)
    if nixl:  # the workers publish their NIXL address with their first step: nothing is offered before
        eng.gen([3 + i % 997 for i in range(2 * args.block_size)], eng.sp1)
    sp = sampling({"do_remote_decode": True} if nixl else None)
    runs = []
    for i, p in enumerate(spec["prompts"]):
        before = eng.counters()
        secs, tokens = eng.gen(p, sp)
        assert eng.last_output is not None
        runs.append({"prompt": i, "ttft_s": secs, "tokens": tokens,
                     "stored": delta(eng.counters(), before, "blocks_stored"),
                     "kv_transfer_params": eng.last_output.kv_transfer_params})
    # The last prompt's final saves run in the next engine step. The pool puts then finish
    # on the store's threads, but an idle engine polls no results, so the last prompt's
    # puts may be missing from the counters here (and from the final ones: this instance
    # sleeps without stepping until the hold file); the decode side waits for the blocks
    # themselves (handoff_wait_s) and its counters say what it loaded.
    steps = eng.drain()
    write_json(Path(spec["result"]), {"engine_start_s": eng.start_s, "runs": runs, "drain_steps": steps,
                                      "counters": eng.counters()})
    hold, until = Path(spec["hold"]), time.monotonic() + HOLD_S
    while not hold.exists() and time.monotonic() < until:
        if nixl:
            eng.llm.llm_engine.step()  # an idle step: the decode side's release notifications
        time.sleep(0.02 if nixl else 0.1)
    until = time.monotonic() + 10  # a notification sent just before the hold file: see it land
    while nixl and offers_open(eng.counters()) and time.monotonic() < until:
        eng.llm.llm_engine.step()
        time.sleep(0.02)
    write_json(Path(spec["final"]), {"counters": eng.counters()})
    eng.close()
    return 0


class PrefillProcess:
    """A prefill instance (this script with ``--prefill-worker``) and its files in ``work``.
    Called from this script's main thread only."""

    def __init__(self, work: Path, path: str, model_dir: Path, kv: dict, prompts: list[list[int]],
                 args: argparse.Namespace) -> None:
        self.result, self.final = work / "prefill.json", work / "prefill-final.json"
        self.hold, self.log = work / "prefill-may-exit", work / "prefill.log"
        spec = {"path": path, "model_dir": str(model_dir), "kv": kv, "prompts": prompts,
                "result": str(self.result), "final": str(self.final), "hold": str(self.hold),
                "args": {"prompt_tokens": args.prompt_tokens, "block_size": args.block_size,
                         "kv_cache_bytes": args.kv_cache_bytes}}
        spec_path = work / "prefill-spec.json"
        spec_path.write_text(json.dumps(spec))
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--prefill-worker", str(spec_path)],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float) -> dict:
        """Its report once every prompt is computed; RuntimeError with its log's tail if it dies or times out."""
        until = time.monotonic() + timeout_s
        while not self.result.exists():
            if self.proc.poll() is not None or time.monotonic() > until:
                tail = self.log.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"the prefill instance failed (rc {self.proc.returncode}):\n{tail}")
            time.sleep(0.2)
        return json.loads(self.result.read_text())

    def stop(self) -> dict:
        """Let it exit (idempotent); its final counters, {} if it wrote none."""
        self.hold.touch()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        return json.loads(self.final.read_text())["counters"] if self.final.exists() else {}

    def warnings(self) -> list[str]:
        return [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.startswith("kvtier")]


# ---- the decode side (this process) -------------------------------------------------------------


def serve(name: str, model_dir: Path, kv: dict | None, args: argparse.Namespace, prompts: list[list[int]],
          handoffs: list[dict | None]) -> dict:
    """Serve ``prompts[0]`` (the warm-up, not timed) then the others, ``prompts[i]`` with
    ``handoffs[i]`` as its ``kv_transfer_params``, on one engine."""
    eng = Engine(model_dir, kv, args)
    before = eng.counters()
    # first-request costs (allocator, kernels, the pool or peer connection) out of the timings
    eng.gen(prompts[0], sampling(handoffs[0]))
    warmup_loaded = delta(eng.counters(), before, "blocks_loaded")
    runs = []
    for i, (p, h) in enumerate(zip(prompts[1:], handoffs[1:], strict=True)):
        sp = sampling(h)
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


def handoff_params(path: str, prefill_runs: list[dict], args: argparse.Namespace) -> list[dict | None]:
    """What a proxy passes the decode instance for each prompt the prefill instance computed."""
    if path == "pool":
        return [{"do_remote_prefill": True, "kvtier_pool_blocks": args.prompt_tokens // args.block_size}
                for _ in prefill_runs]
    return [{**(r["kv_transfer_params"] or {}), "do_remote_prefill": True} for r in prefill_runs]


def run_path(path: str, work: Path, model_dir: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """One path: its prefill instance (and pool master), then its decode instance; all stopped on return."""
    with ExitStack() as stack:
        t = time.perf_counter()
        master_address = ""
        if path == "pool":
            from testkit.mooncake_server import MooncakeMaster

            master = MooncakeMaster(work)
            master.start()
            stack.callback(master.stop)
            master_address = master.address
        prefill = PrefillProcess(work, path, model_dir, kv_config(path, "kv_producer", args, master_address),
                                 prompts, args)
        stack.callback(prefill.stop)
        report = prefill.wait_ready(900)
        ttfts = ", ".join(f"{r['ttft_s']:.2f}" for r in report["runs"])
        where = f"pool {master_address}" if path == "pool" else "NIXL offers"
        print(f"  prefill   ({path}, kv_producer, pid {prefill.proc.pid}, {where}): {len(report['runs'])} prompts "
              f"computed and stored in {time.perf_counter() - t:.1f}s (TTFT {ttfts}s)", flush=True)
        pd = serve(f"pd-{path}", model_dir, kv_config(path, "kv_consumer", args, master_address), args, prompts,
                   handoff_params(path, report["runs"], args))
        final = prefill.stop()
    for r in report["runs"]:  # the offer itself (NIXL agent metadata) is no result: keep its size
        params = r.pop("kv_transfer_params") or {}
        r["offered_blocks"] = len((params.get("kvtier_peer") or {}).get("slots", ()))
    return {"tier": TIER[path], "pd": pd, "prefill": report, "prefill_final_counters": final,
            "prefill_warnings": prefill.warnings()}


# ---- checks and the report ----------------------------------------------------------------------


def check_path(path: str, res: dict, recompute: dict, args: argparse.Namespace) -> list[str]:
    """What went wrong on one path, one line each (empty: all right)."""
    tier, failures = res["tier"], []
    expect_loaded = (args.prompt_tokens - 1) // args.block_size
    prefill_runs = res["prefill"]["runs"]
    for i, (a, b) in enumerate(zip(res["pd"]["runs"], recompute["runs"], strict=True)):
        if a["tokens"] != b["tokens"]:
            failures.append(f"prompt {i}: P/D first token {a['tokens']} != recompute {b['tokens']}")
        if prefill_runs[i + 1]["tokens"] != b["tokens"]:
            failures.append(f"prompt {i}: prefill instance's token {prefill_runs[i + 1]['tokens']} "
                            f"!= recompute {b['tokens']}")
        if a["loaded"].get(tier, 0) != expect_loaded:
            failures.append(f"prompt {i}: P/D loaded {a['loaded']} blocks, expected {expect_loaded} from {tier}")
        if a["handoff_timeouts"] or a["load_failures"]:
            failures.append(f"prompt {i}: handoff timeouts {a['handoff_timeouts']}, "
                            f"load failures {a['load_failures']}")
    if path == "nixl":
        c = res["prefill_final_counters"]
        offered = c.get("peer_offered_blocks|peer", 0)
        expect_offered = len(prefill_runs) * (args.prompt_tokens // args.block_size)
        if offered != expect_offered:
            failures.append(f"the prefill instance offered {offered:.0f} blocks, expected {expect_offered}")
        released, timeouts = c.get("peer_released_blocks|peer", 0), c.get("peer_hold_timeouts|peer", 0)
        if released != offered or timeouts:
            failures.append(f"the prefill instance released {released:.0f} of {offered:.0f} offered blocks "
                            f"on a decode read, {timeouts:.0f} offers timed out")
    return [f"{path}: {f}" for f in failures]


def summarize(res: dict, recompute: dict, args: argparse.Namespace) -> dict:
    pd, c = res["pd"], res["prefill_final_counters"]
    prefill_runs = res["prefill"]["runs"][1:]  # without the warm-up, as the decode runs
    prefill_ttfts = [r["ttft_s"] for r in prefill_runs]
    tokens_equal = all(a["tokens"] == b["tokens"] == p["tokens"]
                       for a, b, p in zip(pd["runs"], recompute["runs"], prefill_runs, strict=True))
    return {"pd_over_recompute": pd["ttft_median_s"] / recompute["ttft_median_s"],
            "pd_over_recompute_best": pd["ttft_min_s"] / recompute["ttft_min_s"],
            "pd_ttft_median_s": pd["ttft_median_s"], "recompute_ttft_median_s": recompute["ttft_median_s"],
            "prefill_ttft_median_s": statistics.median(prefill_ttfts), "prefill_ttft_min_s": min(prefill_ttfts),
            "blocks_loaded_median": statistics.median(r["loaded"].get(res["tier"], 0) for r in pd["runs"]),
            "blocks_expected": (args.prompt_tokens - 1) // args.block_size,
            "peer_offered_blocks": c.get("peer_offered_blocks|peer", 0),
            "peer_released_blocks": c.get("peer_released_blocks|peer", 0),
            "peer_hold_timeouts": c.get("peer_hold_timeouts|peer", 0),
            "target_pd_below_recompute": pd["ttft_median_s"] < recompute["ttft_median_s"],
            "tokens_equal": tokens_equal, "failures": len(res["failures"])}


def print_report(paths: dict[str, dict], recompute: dict, failures: list[str], args: argparse.Namespace) -> None:
    print()
    print(f"decode-instance TTFT, {args.prompt_tokens}-token prompts, {args.repeats} prompts "
          f"(wall clock, s; ratios P/D over recompute, lower is better)")
    hdr = (f"{'config':13s} {'median':>7s} {'best':>7s} {'CPU s':>7s} {'ratio':>7s} {'best':>7s} "
           f"{'blocks loaded':>22s} {'tokens = recompute':>18s}")
    print(hdr)
    print("-" * len(hdr))
    for res in paths.values():
        pd, s = res["pd"], res["summary"]
        loaded = f"{s['blocks_loaded_median']:.0f} of {s['blocks_expected']} ({res['tier']})"
        print(f"{pd['config']:13s} {pd['ttft_median_s']:7.3f} {pd['ttft_min_s']:7.3f} {pd['cpu_median_s']:7.3f} "
              f"{s['pd_over_recompute']:7.3f} {s['pd_over_recompute_best']:7.3f} {loaded:>22s} "
              f"{'yes' if s['tokens_equal'] else 'NO':>18s}")
    r = recompute
    print(f"{r['config']:13s} {r['ttft_median_s']:7.3f} {r['ttft_min_s']:7.3f} {r['cpu_median_s']:7.3f}")
    print("prefill instances (kv_producer, each in its own process before its decode instance; not paired):")
    for path, res in paths.items():
        s = res["summary"]
        line = f"  {path}: TTFT median {s['prefill_ttft_median_s']:.3f}s, best {s['prefill_ttft_min_s']:.3f}s"
        if path == "pool":
            line += f"; pool puts counted {res['prefill_final_counters'].get('blocks_stored|mooncake', 0):.0f}"
        else:
            line += (f"; peer blocks offered {s['peer_offered_blocks']:.0f}, released {s['peer_released_blocks']:.0f}"
                     f", hold timeouts {s['peer_hold_timeouts']:.0f}")
        print(line)
    print()
    for path, res in paths.items():
        ratio = res["summary"]["pd_over_recompute"]
        print(f"{path}: target P/D TTFT < recompute TTFT: {'PASS' if ratio < 1.0 else 'FAIL'}  (reference: the CPU "
              f"tier's warm/cold target <= {REFERENCE_WARM_COLD}: {'within' if ratio <= REFERENCE_WARM_COLD else 'above'})")
    print(f"first tokens P/D == recompute == prefill instance, every block loaded: {'yes' if not failures else 'NO'}")
    for f in failures:
        print("FAIL:", f)
    for path, res in paths.items():
        if res["prefill_warnings"]:
            print(f"the {path} prefill instance warned ({len(res['prefill_warnings'])} lines): "
                  + " | ".join(res["prefill_warnings"][:5]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prefill_worker:
        return prefill_worker(Path(args.prefill_worker))

    import torch
    import vllm

    t_all = time.perf_counter()
    model_dir = build_model(args.model_dir, "bench", dtype="bfloat16",
                            max_position_embeddings=max(8192, args.prompt_tokens + 64))
    prompts = make_prompts(args.repeats + 1, args.prompt_tokens, args.seed)  # the warm-up first
    print(f"model: {model_dir} (bench {SIZES['bench']}, bf16); paths {', '.join(args.paths)}; "
          f"{args.prompt_tokens}-token prompts, {args.repeats} per config, block_size {args.block_size}, "
          f"load avg {os.getloadavg()[0]:.2f}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
          f"UCX_MODULES={os.environ.get('UCX_MODULES')}", flush=True)

    paths: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-pd-bench-") as tmp:
        for path in args.paths:
            work = Path(tmp) / path
            work.mkdir()
            paths[path] = run_path(path, work, model_dir, prompts, args)
    recompute = serve("recompute", model_dir, None, args, prompts, [None] * len(prompts))

    failures = []
    for path, res in paths.items():
        res["failures"] = check_path(path, res, recompute, args)
        res["summary"] = summarize(res, recompute, args)
        failures += res["failures"]
    print_report(paths, recompute, failures, args)
    total = time.perf_counter() - t_all
    print(f"total {total:.0f}s, load avg {os.getloadavg()[0]:.2f}")

    summary: dict[str, Any] = {
        "recompute_ttft_median_s": recompute["ttft_median_s"],
        "target_pd_below_recompute": all(r["summary"]["target_pd_below_recompute"] for r in paths.values()),
        "tokens_equal": all(r["summary"]["tokens_equal"] for r in paths.values()),
        **{f"{p}_over_recompute": r["summary"]["pd_over_recompute"] for p, r in paths.items()},
    }
    out: dict[str, Any] = {
        "benchmark": "pd_ttft", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args),
        "model": {"size": "bench", "dtype": "bfloat16", **SIZES["bench"]},
        "summary": summary, "failures": failures, "paths": paths, "recompute": recompute,
        "env": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
                "cpus": os.cpu_count(), "machine": platform.machine(), "total_s": total,
                "loadavg_end": os.getloadavg(), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                "UCX_MODULES": os.environ.get("UCX_MODULES")},
    }
    if "pool" in paths:  # where the pool path's figures were before --paths (kvtier bench reads them)
        pool = paths["pool"]
        summary.update({k: pool["summary"][k] for k in ("pd_over_recompute", "pd_over_recompute_best",
                                                       "pd_ttft_median_s", "prefill_ttft_median_s")})
        out.update(pd=pool["pd"], prefill=pool["prefill"], prefill_warnings=pool["prefill_warnings"])
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
