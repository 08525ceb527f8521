"""Fleet agreement: two vLLM engines sharing one S3 bucket hit what ``kvtier plan --trace
--instances 2`` predicts, tier by tier, and across instances.

What it does:

1. samples whole conversations of a Mooncake-format trace (``--trace``, by default the
   first half of Mooncake's conversation trace; ``--fraction``, ``--seed``), cuts each
   request to ``--max-blocks`` blocks and scales it to the test model's 32-token block
   (one trace block = one engine block, its tokens drawn from the block's id, plus one
   token of its own), as ``tests/integration/test_plan_trace_engine.py`` does;
2. replays it through the planner's fleet model (``simulate_fleet``: two instances, each
   with a CPU tier of ``--cpu-blocks`` and a write-back NVMe tier, one shared S3 tier),
   with the planner's own router (``--router``), which records where each request went;
3. starts a local S3 server (moto, as the tests do) and two engine processes on one bucket
   (vLLM on CPU, the random-weight "tiny" model the tests build, the plugin with the same
   tiers), and sends each request to the instance the router chose, one at a time;
4. prints per tier the share of prompt tokens predicted and measured (the plugin's
   ``hit_blocks`` counters), and the cross-instance share (``remote_hit_blocks``: hits on
   chunks the other instance wrote). A JSON goes to ``--out``.

Hit counts, not times, are compared, so both sides must see the same order of events.
The model numbers request i at i seconds and lists the bucket every second: a chunk one
instance writes for request i is found by the other from request i + 1. The bench does
the same in lock step: before each request the instance lists the bucket (its rescan,
run at once), and after it the instance's writes are confirmed (one-token requests let
the engine step until no write is in flight). The engines' background rescan is off.
That is why each engine is vLLM's ``LLM`` with its engine core in the engine's own
process, not an API server: the bench reaches the plugin's planners there.

    python bench/fleet_agreement.py                         # 3-5 minutes on a shared 2-core machine
    python bench/fleet_agreement.py --router session --fraction 0.02
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.first_half.jsonl"
BLOCK_SIZE = 32
#: one block of the tiny model: layers x KV heads x block x (K, V) x head dim x fp32
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4
CHUNK_BLOCKS = 4
TIERS = ("cpu", "nvme", "s3")


# ---- the trace and the prediction ------------------------------------------------------


def sampled_records(path: Path, fraction: float, seed: int, max_blocks: int) -> list[dict[str, Any]]:
    """Whole conversations of the trace, cut and scaled to the engine's block, numbered one
    a second in trace order (the model's clock: one request a step of the bench)."""
    from vllm_kvtier.ops.trace_sim import read_trace, sample_conversations, trace_records

    rows = sample_conversations(trace_records(read_trace(path)), fraction, seed)
    return [{"timestamp": 1000 * i, "input_length": BLOCK_SIZE * len(r["hash_ids"][:max_blocks]) + 1,
             "output_length": 1, "hash_ids": [*r["hash_ids"][:max_blocks], -(i + 1)]}
            for i, r in enumerate(rows)]


def prompt_of(ids: Sequence[int]) -> list[int]:
    """The prompt of a scaled request: each block's tokens drawn from its id (equal ids,
    equal prefixes), then the request's own last token."""
    tokens: list[int] = []
    for h in ids[:-1]:
        rng = random.Random(h)
        tokens += [rng.randrange(3, 1000) for _ in range(BLOCK_SIZE)]
    return [*tokens, 3]


class Recorder:
    """The planner's router, remembering where it sent each request."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name, self.routes = inner, inner.name, []

    def route(self, i: int, keys: Any, view: Any) -> int:
        self.routes.append(self.inner.route(i, keys, view))
        return self.routes[-1]


def predict(records: list[dict[str, Any]], args: argparse.Namespace) -> tuple[Any, list[int]]:
    """The fleet model's result, and the instance of each request."""
    from vllm_kvtier.ops.fleet_sim import FleetSetup, simulate_fleet
    from vllm_kvtier.ops.routers import make_router
    from vllm_kvtier.ops.trace_sim import LowerTier, TierSetup, make_trace

    trace = make_trace(records, BLOCK_SIZE)
    nvme = LowerTier("nvme", None, "write-back", 1, CHUNK_BLOCKS, block_bytes=BLOCK_BYTES)
    s3 = LowerTier("s3", None, "write-through", 1, CHUNK_BLOCKS, block_bytes=BLOCK_BYTES)
    setup = TierSetup(cpu_blocks=args.cpu_blocks, cpu_eviction="kvaware", lower=(nvme,), save_partial_blocks=False,
                      block_bytes=BLOCK_BYTES)
    rec = Recorder(make_router(args.router, trace.keys))
    fleet = FleetSetup(args.instances, setup, s3 if args.shared == "s3" else None, "s3", rescan_interval_s=1.0)
    res = simulate_fleet(trace, fleet, rec)
    return res, rec.routes


# ---- one engine (a process of its own) --------------------------------------------------


def kv_config(args: argparse.Namespace, endpoint: str, bucket: str, nvme: Path, writer: str) -> dict[str, Any]:
    """The plugin's config of one instance: the tiers the prediction models."""
    extra: dict[str, Any] = {
        "load_or_recompute": {"enabled": False},  # hit counts must not follow the machine's speed
        "cpu": {"capacity_bytes": args.cpu_blocks * BLOCK_BYTES, "eviction": "kvaware"},
        "nvme": {"path": str(nvme), "capacity_bytes": 1 << 30, "admit_min_seen": 1, "chunk_blocks": CHUNK_BLOCKS,
                 "flush_interval_s": 0},
    }
    if args.shared == "s3":
        # the background rescan waits an hour: the bench lists the bucket itself
        extra["s3"] = {"bucket": bucket, "endpoint_url": endpoint, "path_style": True, "chunk_blocks": CHUNK_BLOCKS,
                       "admit_min_seen": 1, "rescan_interval_s": 3600, "deadline_s": 10.0, "writer_id": writer}
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "vllm_kvtier.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def worker(model: str, kv_json: str) -> int:
    """Serve the commands read from stdin (one JSON a line), one reply a line on stdout."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its index is reachable
    from tests.conftest import close_llm, generate, kvtier_counters, make_llm

    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints stay off the reply channel
    llm = make_llm(Path(model), json.loads(kv_json))
    half = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_half
    settle_prompt = [3]  # one token: no full block to look up or save

    def writing() -> int:
        # the planners' chunks written but not confirmed yet (a bench-only look inside)
        return sum(len(p.index._pending) for p in half.planner.lower)

    def list_bucket() -> None:
        # the S3 planner's rescan, run now on this thread, and all of it applied
        for p in half.planner.lower:
            if p.feed.rescans is not None:
                p.feed.rescans.rescan_once()
                p.refresh()
                while p.rescan_pending():
                    p.refresh()

    print("READY", file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "serve":
            list_bucket()
            generate(llm, cmd["prompt"], max_tokens=1)
            deadline, steps = time.monotonic() + 60, 0
            while (writing() or steps < 1) and time.monotonic() < deadline:
                generate(llm, settle_prompt, max_tokens=1)
                steps += 1
            reply: dict[str, Any] = {"settle_steps": steps, "unconfirmed": writing()}
        elif cmd["op"] == "counters":
            reply = kvtier_counters(llm)
        else:
            break
        print("REPLY " + json.dumps(reply), file=out, flush=True)
    close_llm(llm)
    return 0


class Engine:
    """One engine process, driven line by line."""

    def __init__(self, model: Path, kv: dict[str, Any], env: dict[str, str], log: Path) -> None:
        self.log = open(log, "w")  # noqa: SIM115 (the engine writes it until it exits)
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(model), json.dumps(kv)], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        self.log_path = log

    def wait_ready(self) -> None:
        self._read("READY")

    def _read(self, tag: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        self.log.flush()
        raise RuntimeError(f"engine exited ({self.proc.wait()}):\n{self.log_path.read_text()[-3000:]}")

    def call(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read("REPLY"))

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def aws_env() -> dict[str, str]:
    """Fake credentials for the local server; no shared config, no instance metadata."""
    from testkit.s3_server import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return env | {"AWS_ACCESS_KEY_ID": ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
                  "AWS_DEFAULT_REGION": REGION, "AWS_CONFIG_FILE": os.devnull,
                  "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true"}


def measure(records: list[dict[str, Any]], routes: list[int], args: argparse.Namespace,
            work: Path) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Each engine's plugin counters after the trace, and how the run went."""
    from testkit.s3_server import MotoServer
    from testkit.tinymodel import build_model

    env = aws_env() | {"PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_NO_USAGE_STATS": "1",
                       "XDG_CACHE_HOME": str(work / "xdg-cache")}
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    for k in [k for k in os.environ if k.startswith("AWS_") and k not in env]:
        del os.environ[k]
    model = build_model(work / "tiny", "tiny", dtype="float32")
    s3 = MotoServer(work)
    s3.start()
    engines: list[Engine] = []
    try:
        bucket = s3.create_bucket()
        for name in "ab"[: args.instances]:  # one start at a time: two would share 2 cores
            kv = kv_config(args, s3.url, bucket, work / f"nvme-{name}", f"fleet-{name}")
            engines.append(Engine(model, kv, env, work / f"engine-{name}.log"))
            engines[-1].wait_ready()
        t0 = time.monotonic()
        unconfirmed = settle = 0
        for n, (r, me) in enumerate(zip(records, routes, strict=True)):
            got = engines[me].call(op="serve", prompt=prompt_of(r["hash_ids"]))
            unconfirmed += got["unconfirmed"]
            settle += got["settle_steps"]
            if (n + 1) % 25 == 0:
                print(f"  {n + 1}/{len(records)} requests, {time.monotonic() - t0:.0f} s", flush=True)
        counters = [e.call(op="counters") for e in engines]
        run = {"replay_s": round(time.monotonic() - t0, 1), "settle_requests": settle,
               "writes_unconfirmed": unconfirmed,
               "objects": len(s3.client().list_objects_v2(Bucket=bucket).get("Contents", []))}
    finally:
        for e in engines:
            e.stop()
        s3.stop()
    return counters, run


# ---- the comparison --------------------------------------------------------------------


def compare(res: Any, counters: list[dict[str, float]], shared: bool) -> dict[str, dict[str, float]]:
    """Per tier and across instances: the predicted and measured shares of prompt tokens."""
    prompt = res.prompt_tokens
    pred = {"cpu": res.hit_tokens["cpu"], "nvme": res.hit_tokens["nvme"], "s3": res.hit_tokens["shared"],
            "cross": res.cross_hit_tokens}
    got = {t: sum(c.get(f"hit_blocks|{t}", 0) for c in counters) * BLOCK_SIZE for t in TIERS}
    got["cross"] = sum(c.get("remote_hit_blocks|s3", 0) for c in counters) * BLOCK_SIZE
    pred["all"], got["all"] = sum(pred[t] for t in TIERS), sum(got[t] for t in TIERS)
    shown = [k for k in pred if shared or k not in ("s3", "cross")]
    return {k: {"predicted": pred[k] / prompt, "measured": got[k] / prompt,
                "diff_points": 100 * (got[k] - pred[k]) / prompt} for k in shown}


def table(rows: dict[str, dict[str, float]]) -> str:
    lines = [f"{'tier':<8}{'predicted':>11}{'measured':>10}{'diff (points)':>15}"]
    for k, r in rows.items():
        lines.append(f"{k:<8}{r['predicted']:>11.4f}{r['measured']:>10.4f}{r['diff_points']:>+15.2f}")
    return "\n".join(lines)


def commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or None


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--fraction", type=float, default=0.03, help="share of the conversations sampled (default 0.03)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-blocks", type=int, default=40, help="blocks kept of each request (default 40)")
    ap.add_argument("--cpu-blocks", type=int, default=100, help="each instance's CPU tier (default 100)")
    ap.add_argument("--router", default="round-robin", choices=("round-robin", "session", "prefix"))
    ap.add_argument("--instances", type=int, default=2, choices=(1, 2),
                    help="1: one engine, the single-instance replay (default 2)")
    ap.add_argument("--shared", default="s3", choices=("s3", "none"), help="the shared tier (default s3)")
    ap.add_argument("--tolerance-points", type=float, default=3.0)
    ap.add_argument("--out", default=None, help="JSON path (default bench/runs/DATE-fleet-agreement-ROUTER.json, "
                                                "a suffix for one instance or no shared tier)")
    args = ap.parse_args()
    if not args.trace.is_file():
        print(f"--trace: {args.trace} is not a file", file=sys.stderr)
        return 2
    start = datetime.datetime.now(datetime.UTC)
    records = sampled_records(args.trace, args.fraction, args.seed, args.max_blocks)
    res, routes = predict(records, args)
    print(f"{len(records)} requests, {res.prompt_tokens:,} prompt tokens; router {args.router}: "
          f"{routes.count(0)} on instance a, {routes.count(1)} on b")
    with tempfile.TemporaryDirectory(prefix="fleet-agreement-") as tmp:
        counters, run = measure(records, routes, args, Path(tmp))
    rows = compare(res, counters, args.shared == "s3")
    ok = all(abs(r["diff_points"]) <= args.tolerance_points for r in rows.values())
    print(table(rows))
    print(f"within {args.tolerance_points:g} points: {'yes' if ok else 'NO'}")
    end = datetime.datetime.now(datetime.UTC)
    tag = args.router + ("" if args.instances == 2 else "-one-instance") + ("" if args.shared == "s3" else "-no-shared")
    what = (f"{'two instances' if args.instances == 2 else 'one instance'}"
            f"{', sharing one S3 bucket' if args.shared == 's3' else ', no shared tier'}")
    result = {
        "name": f"fleet-agreement-{tag}", "benchmark": "bench/fleet_agreement.py",
        "date": start.strftime("%Y-%m-%d"), "time_utc": f"{start:%H:%M}-{end:%H:%M}", "commit": commit(),
        "command": " ".join(["python", "bench/fleet_agreement.py", *sys.argv[1:]]),
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, shared with other jobs; vLLM on CPU, tiny model fp32",
        "source": f"{args.trace.name}, {args.fraction:g} of the conversations (seed {args.seed}), "
                  f"cut to {args.max_blocks} blocks of {BLOCK_SIZE} tokens",
        "tables": [{"title": f"share of prompt tokens served: {what}",
                    "columns": ["tier", "predicted", "measured", "diff (points)"],
                    "rows": [{"tier": k, "predicted": f"{r['predicted']:.4f}", "measured": f"{r['measured']:.4f}",
                              "diff (points)": f"{r['diff_points']:+.2f}"} for k, r in rows.items()]}],
        "notes": [f"{len(records)} requests, {res.prompt_tokens} prompt tokens, {what}, router {args.router}; "
                  f"CPU {args.cpu_blocks} blocks, NVMe write-back (admit 1, no flush)"
                  f"{', S3 write-through' if args.shared == 's3' else ''}, {CHUNK_BLOCKS}-block chunks; "
                  f"within {args.tolerance_points:g} points: {ok}"],
        "figures": {"rows": rows, "counters": counters, "run": run, "requests": len(records),
                    "prompt_tokens": res.prompt_tokens, "routes": {"a": routes.count(0), "b": routes.count(1)}},
    }
    print(json.dumps(result["figures"]["rows"], indent=2))
    from bench._common import save_json

    save_json(args.out or ROOT / "bench" / "runs" / f"{start:%Y-%m-%d}-fleet-agreement-{tag}.json", result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
