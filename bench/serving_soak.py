"""Serving soak and exactness under concurrency: vLLM's API server with the plugin under mixed
traffic for a bounded time, and the same requests sent to servers with and without it.

Who runs it: ``make bench-serving`` after ``bench/serving.py``, or by hand, on a quiet machine.
Servers and clients as in :mod:`bench.serving` (vLLM's ``bench serve`` from the installed wheel;
``VLLM_CPU_NUM_OF_RESERVED_CPU`` alike on every server), on the ``bench`` random-weight Llama in
**fp32** (in bf16 even a server without the plugin does not repeat its own greedy tokens under
concurrency: batch shapes change the rounding), prefix caching off on every server so the
plugin's loads are what serves a hit.

* ``correctness``: the same 36 requests (a shared 512-token prefix and 256 tokens of their own,
  32 output tokens, temperature 0) at concurrency 4 sent to a baseline server twice and to a
  plugin server once; each output against the first baseline's: the same tokens, a near tie
  (the first differing token's log-probability within 1e-3 nats of the baseline's choice there:
  another batch shape's rounding decides it, fp32 rounding moves logits by ~1e-6), or a
  mismatch (must be 0). Baseline-vs-baseline gives the repeatability at this concurrency.
* ``soak`` (``--soak-minutes``, default 20; any length elsewhere): mixed traffic (rounds of
  ``bench serve`` ``prefix_repetition`` with fresh prefixes each round, and ``random``) against
  a plugin server whose CPU and NVMe tiers are smaller than the working set, so both evict all
  along. Sampled every ``--sample-s``: the server's RSS (API server, EngineCore, worker) and the
  tiers' usage gauges; every ``--probe-s`` a greedy probe (fixed prompts) whose tokens must equal
  those of a server without the plugin (or differ first at a near tie, see ``correctness``). Reported: failed requests (must be 0), probe mismatches
  (must be 0), RSS growth after warm-up (max of the last third over max of the second third),
  a PNG of RSS and tier usage over time.

Writes ``bench/results/serving_soak.json`` and ``serving_soak.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import save_json  # noqa: E402
from bench.serving import BINDING_ENV, Server, kv_config, run_client  # noqa: E402
from testkit.tinymodel import build_model, words  # noqa: E402

PROBES = 4
PROBE_TOKENS = 768


def bench_serve(server: Server, model: Path, work: Path, name: str, args: argparse.Namespace,
                extra: list[str]) -> dict[str, Any]:
    argv = ["--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions", "--model", "bench",
            "--tokenizer", str(model), "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--save-result",
            "--save-detailed", "--result-dir", str(work), "--result-filename", f"{name}.json", *extra]
    run_client(argv, work / f"{name}.client.log", args.client_timeout_s)
    return json.loads((work / f"{name}.json").read_text())


def probe_prompts() -> list[str]:
    return [words([3 + (i * 7919 + j * 31) % 1000 for j in range(PROBE_TOKENS)]) for i in range(PROBES)]


#: a flip between two tokens whose log-probabilities differ by less than this (nats) at the
#: first differing position is a near tie: the rounding of another batch shape can decide it
#: (fp32 rounding moves logits by ~1e-6); wrong KV moves them by far more
TIE_NATS = 1e-3


_SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2}


def _token_id(token: str) -> int:
    """The id of a token string of the test tokenizer ("w17" -> 17, specials by name)."""
    t = token.strip()
    return _SPECIAL[t] if t in _SPECIAL else int(t.removeprefix("##")[1:])


def complete(server: Server, prompt: str, max_tokens: int) -> tuple[list[int], list[dict[str, float]]] | None:
    """Greedy completion: (token ids, top-2 log-probabilities per position), None on failure."""
    import requests

    try:
        r = requests.post(server.url + "/v1/completions", timeout=600, json={
            "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 2})
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        ids = [_token_id(t) for t in lp["tokens"]]
        return ids, [{k.strip(): float(v) for k, v in (top or {}).items()} for top in lp["top_logprobs"]]
    except Exception:
        return None


def divergence(ref: tuple[list[int], list[dict[str, float]]],
               got: tuple[list[int], list[dict[str, float]]]) -> dict[str, float] | None:
    """Where two greedy outputs first differ (None if they do not): the position, the reference's
    log-probability gap there between its token and the other's (inf when the other's token is
    not in its top 2), and the drift before it (the largest difference of the chosen token's
    log-probability over the positions both chose alike: the numerical noise between the two
    runs)."""
    if ref[0] == got[0]:
        return None
    p = next(i for i, (a, b) in enumerate(zip(ref[0], got[0], strict=True)) if a != b)
    by_id = {_token_id(t): v for t, v in ref[1][p].items()}
    mine, theirs = ref[0][p], got[0][p]
    gap = abs(by_id[mine] - by_id[theirs]) if mine in by_id and theirs in by_id else float("inf")
    drift = 0.0
    for i in range(p):
        a = {_token_id(t): v for t, v in ref[1][i].items()}.get(ref[0][i])
        b = {_token_id(t): v for t, v in got[1][i].items()}.get(got[0][i])
        if a is not None and b is not None:
            drift = max(drift, abs(a - b))
    return {"position": p, "gap_nats": gap, "drift_nats": drift}


def compare(ref: tuple[list[int], list[dict[str, float]]] | None,
            got: tuple[list[int], list[dict[str, float]]] | None) -> str:
    """"same"; "near_tie": the first differing token is one whose log-probability at that
    position was within ``max(TIE_NATS, 4 x drift)`` of the reference's choice (the rounding of
    another batch shape decides such a tie; the drift measures that rounding between these two
    runs); "mismatch"; or "failed"."""
    if ref is None or got is None:
        return "failed"
    d = divergence(ref, got)
    if d is None:
        return "same"
    return "near_tie" if d["gap_nats"] <= max(TIE_NATS, 4 * d["drift_nats"]) else "mismatch"


def server_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(max_model_len=args.max_model_len, kv_cache_bytes=args.kv_cache_bytes,
                              max_num_seqs=args.max_num_seqs, start_timeout_s=args.start_timeout_s,
                              prefix_caching=False, dtype="float32")


def correctness(model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The same 36 greedy requests (a shared 512-token prefix, 256 tokens of their own) sent 4 at
    a time to a baseline server twice and to a plugin server; each output compared with the first
    baseline's (:func:`compare`). The requests are sent by a thread pool here (not vLLM's bench
    client) because the comparison needs each output's top-2 log-probabilities."""
    from concurrent.futures import ThreadPoolExecutor

    prefix = [3 + (j * 37) % 1000 for j in range(512)]
    prompts = [words(prefix + [3 + (i * 131 + j * 17) % 1000 for j in range(256)]) for i in range(36)]
    outs: dict[str, list[Any]] = {}
    counters: dict[str, float] = {}
    for name, kv in (("baseline-a", None), ("baseline-b", None),
                     ("plugin", kv_config({"preset": "interactive"}, work / "unused"))):
        server = Server(model, kv, server_args(args), work / f"correctness-{name}.server.log")
        try:
            with ThreadPoolExecutor(4) as pool:
                outs[name] = list(pool.map(lambda p, s=server: complete(s, p, 32), prompts))
            if kv is not None:
                counters = server.metrics()
        finally:
            server.stop()

    def tally(other: str) -> dict[str, Any]:
        pairs = list(zip(outs["baseline-a"], outs[other], strict=True))
        verdicts = [compare(a, b) for a, b in pairs]
        out: dict[str, Any] = {v: verdicts.count(v) for v in ("same", "near_tie", "mismatch", "failed")}
        out["divergences"] = [d for a, b in pairs if a is not None and b is not None
                              and (d := divergence(a, b)) is not None]
        return out

    out = {"requests": len(prompts), "concurrency": 4, "tie_nats": TIE_NATS,
           "baseline_vs_baseline": tally("baseline-b"), "plugin_vs_baseline": tally("plugin"),
           "plugin_counters": {k: v for k, v in counters.items() if v}}
    def brief(t: dict[str, Any]) -> str:
        divs = " ".join(f"(pos {d['position']}, gap {d['gap_nats']:.2g}, drift {d['drift_nats']:.2g})"
                        for d in t["divergences"])
        return f"{t['same']} same, {t['near_tie']} near ties, {t['mismatch']} mismatched {divs}"

    print(f"correctness at concurrency 4, {out['requests']} requests of 32 tokens: baseline vs baseline: "
          f"{brief(out['baseline_vs_baseline'])}; plugin vs baseline: {brief(out['plugin_vs_baseline'])}; "
          f"plugin counters {out['plugin_counters']}")
    return out


def _gauges(server: Server) -> dict[str, float]:
    import requests

    out: dict[str, float] = {}
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:kvtier_usage_bytes{") and 'tier="' in line:
            tier = line.split('tier="', 1)[1].split('"', 1)[0]
            out[tier] = out.get(tier, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def soak(model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    prompts = probe_prompts()
    base = Server(model, None, server_args(args), work / "soak-baseline.server.log")
    try:
        expected = [complete(base, p, 24) for p in prompts]
    finally:
        base.stop()
    extra = {"preset": "interactive", "cpu": {"capacity_bytes": args.soak_cpu_bytes},
             "nvme": {"path": str(work / "soak-nvme"), "capacity_bytes": args.soak_nvme_bytes}}
    server = Server(model, kv_config(extra, work), server_args(args), work / "soak-plugin.server.log")
    samples: list[dict[str, float]] = []
    probes = {"sent": 0, "same": 0, "near_tie": 0, "mismatch": 0, "failed": 0}
    totals = {"rounds": 0, "completed": 0, "failed": 0}
    stop = threading.Event()
    t0 = time.monotonic()
    deadline = t0 + args.soak_minutes * 60

    def traffic() -> None:
        r = 0
        while time.monotonic() < deadline and not stop.is_set():
            if r % 2 == 0:  # fresh long prefixes every round: the working set keeps growing
                load = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
                        "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
                        "--prefix-repetition-output-len", "16"]
            else:
                load = ["--dataset-name", "random", "--random-prefix-len", "256", "--random-input-len", "512",
                        "--random-output-len", "16", "--random-range-ratio", "0"]
            try:
                res = bench_serve(server, model, work, f"soak-round-{r}", args,
                                  [*load, "--num-prompts", "24", "--max-concurrency", "4", "--seed", str(1000 + r)])
                totals["completed"] += int(res.get("completed", 0))
                totals["failed"] += int(res.get("failed", 0))
            except Exception as e:  # the client failing is a failed round, not a crash of the soak
                print(f"soak round {r} failed: {e}", flush=True)
                totals["failed"] += 24
            totals["rounds"] += 1
            r += 1

    worker = threading.Thread(target=traffic, daemon=True)
    try:
        worker.start()
        next_probe = t0 + args.probe_s
        while time.monotonic() < deadline:
            now = time.monotonic()
            try:
                samples.append({"t_s": now - t0, "rss_bytes": float(server.rss_bytes()),
                                **{f"usage_{k}": v for k, v in _gauges(server).items()}})
            except Exception as e:
                print(f"sample failed: {e}", flush=True)
            if now >= next_probe:
                for p, e in zip(prompts, expected, strict=True):
                    probes["sent"] += 1
                    probes[compare(e, complete(server, p, 24))] += 1
                next_probe = now + args.probe_s
            time.sleep(args.sample_s)
        stop.set()
        worker.join(timeout=args.client_timeout_s)
        counters = server.metrics()
    finally:
        stop.set()
        server.stop()
    rss = [s["rss_bytes"] for s in samples]
    third = max(1, len(rss) // 3)
    growth = (max(rss[-third:]) / max(rss[third:2 * third])) if len(rss) >= 3 else None
    out = {"minutes": args.soak_minutes, "samples": samples, "probes": probes, "requests": totals,
           "rss_growth_after_warmup": growth, "cpu_capacity_bytes": args.soak_cpu_bytes,
           "nvme_capacity_bytes": args.soak_nvme_bytes, "counters": {k: v for k, v in counters.items() if v}}
    print(f"soak {args.soak_minutes} min: {totals['completed']} requests, {totals['failed']} failed; probes "
          f"{probes['sent']} sent: {probes['same']} same, {probes['near_tie']} near ties, {probes['mismatch']} "
          f"mismatched, {probes['failed']} failed; RSS growth after "
          f"warm-up {growth if growth is None else round(growth, 3)}; counters {out['counters']}")
    return out


_PLOT = """
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
d = json.load(open(sys.argv[1]))["soak"]
s = d["samples"]
t = [x["t_s"] / 60 for x in s]
fig, ax = plt.subplots(figsize=(9, 4))
ax.plot(t, [x["rss_bytes"] / 2**20 for x in s], label="server RSS (all processes)")
for k in sorted({k for x in s for k in x if k.startswith("usage_") and k != "usage_all"}):
    ax.plot(t, [x.get(k, 0) / 2**20 for x in s], label=k.replace("usage_", "tier usage: "))
ax.set_xlabel("minutes"); ax.set_ylabel("MiB"); ax.legend(fontsize=8)
ax.set_title("soak: %d requests, %d failed; probes %d: %d same, %d near ties, %d mismatched" % (
    d["requests"]["completed"], d["requests"]["failed"], d["probes"]["sent"], d["probes"]["same"],
    d["probes"]["near_tie"], d["probes"]["mismatch"]))
fig.tight_layout(); fig.savefig(sys.argv[2], dpi=110)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/vllm_kvtier/bench-model-fp32"))
    ap.add_argument("--studies", default="correctness,soak")
    ap.add_argument("--soak-minutes", type=float, default=20.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--probe-s", type=float, default=60.0)
    ap.add_argument("--soak-cpu-bytes", type=int, default=256 * 2**20)
    ap.add_argument("--soak-nvme-bytes", type=int, default=1 * 2**30)
    ap.add_argument("--kv-cache-bytes", type=int, default=96 * 2**20)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--client-timeout-s", type=float, default=1800)
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "serving_soak.json"))
    args = ap.parse_args()
    model = build_model(Path(args.model_dir), "bench", dtype="float32")
    work = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    result: dict[str, Any] = {"binding": {k: os.environ.get(k) for k in BINDING_ENV}}
    try:
        studies = args.studies.split(",")
        if "correctness" in studies:
            result["correctness"] = correctness(model, work, args)
        if "soak" in studies:
            result["soak"] = soak(model, work, args)
    finally:
        if args.keep_logs:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    save_json(args.json, result)
    client_py = ROOT / ".venv-client" / "bin" / "python"
    if "soak" in result and client_py.exists():
        png = Path(args.json).with_suffix(".png")
        subprocess.run([str(client_py), "-c", _PLOT, args.json, str(png)], check=False)
        print(f"wrote {png}")
    bad = 0
    if "correctness" in result:
        c = result["correctness"]
        bad += c["plugin_vs_baseline"]["mismatch"] > 0 or c["plugin_vs_baseline"]["failed"] > 0
    if "soak" in result:
        s = result["soak"]
        bad += s["requests"]["failed"] > 0 or s["probes"]["mismatch"] > 0 or s["probes"]["failed"] > 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
