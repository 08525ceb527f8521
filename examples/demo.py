"""vllm_kvtier demo: a real vLLM engine reusing KV blocks from the CPU and NVMe tiers.

What it shows, on a small random-weight Llama built locally (no network, no arguments):

(a) a long prompt sent twice: the first time it is computed and its KV blocks are saved to
    the CPU DRAM tier; the second time the blocks are loaded back instead of recomputed,
    so the time to first token (TTFT) drops;
(b) a two-turn conversation: turn 2's prompt is turn 1's prompt + turn 1's answer + a new
    user message, so turn 2 loads the blocks of turn 1 (prompt *and* answer, thanks to
    ``save_decode_blocks``) and computes only the new tokens;
(c) the long prompt of (a) once more, after other traffic (two other long documents): the
    CPU tier is deliberately small (room for ~1.5 long prompts), so by then it has evicted
    the prompt's blocks and, in write-back mode, demoted them to the NVMe tier (chunk files
    under ``~/.cache/vllm_kvtier/demo-nvme``, wiped at every start so runs are
    reproducible). The blocks come back from NVMe: read from disk into CPU slots, then
    copied into the KV cache (an NVMe load is always asynchronous: the request waits while
    the files are read).

For every request it prints the TTFT (vLLM's own first-token latency) with the plugin and
without it (a second engine with no connector, where every request is computed from
scratch), and the blocks loaded per tier (deltas of the plugin's ``vllm:kvtier_*``
counters). Finally it checks that greedy decoding produced exactly the same tokens with
reuse as without.

vLLM's own prefix cache is off on both engines. Its KV cache here (256 MiB) would hold every
request, so the plugin would never be asked. In a deployment it stays on, and the plugin
serves what vLLM's cache has evicted. The plugin runs on the embedded ``DEFAULT_CONFIG`` below: both
local tiers, CPU DRAM and NVMe (write-back, every block admitted). Its CPU capacity is
sized for the defaults (tiny model, float32, 2000-token prompts); other ``--size``,
``--dtype`` or ``--prompt-tokens`` rescale it to the same ~1.5 long prompts.

The engines compute in float32 by default. In bfloat16, a request whose prefix KV comes
from a cache (this plugin, or vLLM's own prefix cache alike) computes the rest with
different kernel splits than a full prefill, and with random weights greedy decoding
may then pick a different token after some tens of tokens (a near-tie in the logits);
float32 keeps the with/without comparison exact.

vLLM's log lines (and the plugin's) go to ``~/.cache/vllm_kvtier/demo.log``; the terminal
shows the demo's own lines only, and the log's tail if an engine fails.

    python examples/demo.py                 # under a minute on 2 idle CPU cores
    python examples/demo.py --size bench    # bigger model: larger TTFT differences
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import random
import shutil
import sys
import time
from pathlib import Path

# Unless the caller chose otherwise: an in-process engine (fast start), quiet vLLM logs
# (the plugin's own warnings still print), and no vLLM usage-stats thread: on a small
# machine its one-off system survey, run in the background of the first engine, stole
# hundreds of ms from requests timed there.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testkit.tinymodel import SIZES, VOCAB, build_model  # noqa: E402

BLOCK_SIZE = 64

#: The NVMe tier's directory for this demo (wiped at every start).
NVME_DIR = Path.home() / ".cache" / "vllm_kvtier" / "demo-nvme"
#: vLLM's and the plugin's log lines (overwritten at every start).
LOG_FILE = Path.home() / ".cache" / "vllm_kvtier" / "demo.log"

#: The plugin's configuration for this demo (``kv_connector_extra_config``).
DEFAULT_CONFIG = {
    # Deliberately small: 48 blocks of 128 KiB (tiny model, float32, block_size 64), room
    # for ~1.5 of the 2000-token prompts, so scenario (c) finds its prompt evicted to NVMe.
    "cpu": {"capacity_bytes": 48 * 128 * 2**10},
    "nvme": {
        "path": str(NVME_DIR),
        "capacity_bytes": 2**30,   # 1 GiB of chunk files
        "mode": "write-back",      # a block goes to NVMe when the CPU tier evicts it
        "admit_min_seen": 1,       # admit every block (the default 2 keeps one-off prompts off the SSD)
    },
    "load_mode": "sync",           # load CPU hits inside the step that schedules them
    "save_decode_blocks": True,    # save answers too: the next turn reuses them
}

KV_TRANSFER_CONFIG = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "vllm_kvtier.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": DEFAULT_CONFIG,
}


def block_bytes(size: str, dtype: str) -> int:
    """KV bytes of one block: layers x (K, V) x KV heads x head_dim x block_size x element."""
    m = SIZES[size]
    return (m["num_hidden_layers"] * 2 * m["num_key_value_heads"] * m["head_dim"] * BLOCK_SIZE
            * (4 if dtype == "float32" else 2))


def kv_transfer_config(args) -> dict:
    """``KV_TRANSFER_CONFIG``, its CPU tier rescaled to ~1.5 long prompts when the model,
    dtype or prompt length differ from the defaults."""
    cfg = copy.deepcopy(KV_TRANSFER_CONFIG)
    blocks = (3 * ((args.prompt_tokens + args.answer_tokens) // BLOCK_SIZE) + 1) // 2
    cfg["kv_connector_extra_config"]["cpu"]["capacity_bytes"] = blocks * block_bytes(args.size, args.dtype)
    return cfg


def counters(llm) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvtier_") and getattr(m, "value", None) is not None:
            key = (m.name.removeprefix("vllm:kvtier_"), m.labels.get("tier", ""))
            out[key] = out.get(key, 0) + m.value
    return out


def run_engine(model_dir: Path, kv_transfer_config: dict | None, args) -> list[dict]:
    """Run the demo's requests on one engine; return one record per request."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model_dir), dtype=args.dtype,
              max_model_len=4096, enforce_eager=True, enable_prefix_caching=False,
              block_size=BLOCK_SIZE, kv_cache_memory_bytes=256 * 2**20,
              kv_transfer_config=kv_transfer_config, disable_log_stats=False, seed=0)
    rng = random.Random(7)  # same prompts on both engines

    def ask(label: str, prompt: list[int], max_tokens: int) -> dict:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        before = counters(llm)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        after = counters(llm)
        d: dict[str, dict[str, int]] = {}
        for (name, tier), v in after.items():
            inc = v - before.get((name, tier), 0)
            if inc > 0:
                d.setdefault(name, {})[tier] = int(inc)
        m = out.metrics
        ttft = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
        return {"label": label, "prompt": prompt, "tokens": list(out.outputs[0].token_ids),
                "ttft": ttft or wall, "loaded": d.get("blocks_loaded", {})}

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    # A full-length request first, so one-time costs (allocations, kernel set-up for
    # these shapes) stay out of the timings. On the plugin engine it misses and is saved,
    # like any other prompt.
    ask("warm-up", rand(args.prompt_tokens), args.answer_tokens)
    recs = []
    long_prompt = rand(args.prompt_tokens)
    recs.append(ask("(a) long prompt, first time", long_prompt, args.answer_tokens))
    recs.append(ask("(a) same prompt again", long_prompt, args.answer_tokens))
    turn1 = rand(args.turn1_tokens)
    r1 = ask("(b) turn 1", turn1, args.answer_tokens)
    recs.append(r1)
    turn2 = turn1 + r1["tokens"] + rand(args.user_tokens)
    recs.append(ask("(b) turn 2 = turn 1 + answer + new", turn2, args.answer_tokens))
    # Other traffic: two more long documents push (a)'s blocks out of the small CPU tier
    # (to NVMe, with the plugin); the second one also gives the demotion writes time to land.
    recs.append(ask("(c) other traffic: document 1", rand(args.prompt_tokens), args.answer_tokens))
    recs.append(ask("(c) other traffic: document 2", rand(args.prompt_tokens), args.answer_tokens))
    recs.append(ask("(c) long prompt of (a) again", long_prompt, args.answer_tokens))
    final = counters(llm)

    with contextlib.suppress(Exception):  # stop the engine core now: the NVMe I/O threads finish their queue
        llm.llm_engine.engine_core.shutdown()
    llm = None  # drop the engine before the next one starts
    gc.collect()
    for r in recs:
        r["final_counters"] = final
    return recs


@contextlib.contextmanager
def logs_to(path: Path):
    """Send everything written to fds 1 and 2 (Python, vLLM's C++ and torch's warnings) to
    ``path``; yield a stream on the terminal for the demo's own lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    term = os.fdopen(os.dup(1), "w", buffering=1)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield term
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            term.close()


def speed_up(base: dict, tier: dict) -> str:
    """TTFT without the plugin over TTFT with it, where the plugin loaded blocks (else the
    two engines did the same work, and the ratio is only timing noise)."""
    return f"{base['ttft'] / tier['ttft']:.1f}x" if sum(tier["loaded"].values()) else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--model-dir", default=None, help="default ~/.cache/vllm_kvtier/SIZE-model")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--turn1-tokens", type=int, default=1500)
    ap.add_argument("--user-tokens", type=int, default=100)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute and KV dtype (float32: greedy tokens compare exactly)")
    args = ap.parse_args()

    t_all = time.perf_counter()
    model_dir = Path(args.model_dir or os.path.expanduser(f"~/.cache/vllm_kvtier/{args.size}-model"))
    kv = kv_transfer_config(args)
    shutil.rmtree(NVME_DIR, ignore_errors=True)  # reproducible runs: start with an empty NVMe tier
    NVME_DIR.mkdir(parents=True)
    print(f"vLLM's log: {LOG_FILE}")
    with logs_to(LOG_FILE) as term:
        try:
            build_model(model_dir, args.size, dtype="bfloat16")
            return report(args, model_dir, kv, term, t_all)
        except BaseException:
            import traceback

            traceback.print_exc()  # into the log, then its tail on the terminal
            sys.stderr.flush()
            tail = LOG_FILE.read_text(errors="replace").splitlines()[-30:]
            print("\n".join(["demo failed; the end of " + str(LOG_FILE) + ":", *tail]), file=term)
            return 1


def report(args, model_dir: Path, kv: dict, term, t_all: float) -> int:
    """Run both engines and print the comparison on ``term``."""
    extra = kv["kv_connector_extra_config"]
    bb = block_bytes(args.size, args.dtype)

    def say(*parts: object) -> None:
        print(*parts, file=term, flush=True)

    say(f"model: random-weight Llama '{args.size}' {SIZES[args.size]} at {model_dir}")
    say(f"plugin config: {extra}")
    say(f"  {args.dtype}, block_size {BLOCK_SIZE} ({bb // 2**10} KiB of KV per block), CPU tier "
        f"{extra['cpu']['capacity_bytes'] // bb} blocks, NVMe tier under {NVME_DIR} (wiped)")
    say("  vLLM's prefix cache is off on both engines: its 256 MiB would hold every request here, so "
        "the plugin\n  would never be asked. In a deployment it stays on, and the plugin serves what it evicts.")

    say("engine 1: no connector (every request computed from scratch) ...")
    base = run_engine(model_dir, None, args)
    say("engine 2: KVTierConnector (CPU + NVMe tiers) ...")
    tier = run_engine(model_dir, kv, args)

    tiers = ["cpu", "nvme"]
    say()
    head = (f"{'request':38s} {'prompt':>7s} {'TTFT no plugin':>15s} {'TTFT kvtier':>12s} {'speed-up':>9s}"
            + "".join(f" {'loaded ' + t:>11s}" for t in tiers))
    say(head)
    say("-" * len(head))
    for b, k in zip(base, tier, strict=True):
        say(f"{k['label']:38s} {len(k['prompt']):7d} {b['ttft'] * 1000:12.0f} ms {k['ttft'] * 1000:9.0f} ms "
            f"{speed_up(b, k):>9s}"
            + "".join(f" {k['loaded'].get(t, 0):>4d} blocks" for t in tiers))
    a_cold, a_warm, _, t2, _, _, c_again = tier
    b_t2, b_c = base[3], base[6]

    def loaded(r: dict) -> str:
        return " + ".join(f"{r['loaded'].get(t, 0)} {t}" for t in tiers)

    say()
    say(f"(a) repeat: TTFT {a_cold['ttft'] * 1000:.0f} ms cold -> {a_warm['ttft'] * 1000:.0f} ms warm "
        f"({a_cold['ttft'] / a_warm['ttft']:.1f}x faster), {sum(a_warm['loaded'].values())} of "
        f"{len(a_warm['prompt']) // BLOCK_SIZE} prompt blocks loaded ({loaded(a_warm)})")
    say(f"(b) turn 2: TTFT {b_t2['ttft'] * 1000:.0f} ms without reuse -> {t2['ttft'] * 1000:.0f} ms "
        f"with reuse ({b_t2['ttft'] / t2['ttft']:.1f}x faster), {sum(t2['loaded'].values())} of "
        f"{len(t2['prompt']) // BLOCK_SIZE} prompt blocks loaded (turn 1 prompt + answer; {loaded(t2)})")
    say(f"(c) after other traffic: TTFT {b_c['ttft'] * 1000:.0f} ms without reuse -> "
        f"{c_again['ttft'] * 1000:.0f} ms from NVMe ({b_c['ttft'] / c_again['ttft']:.1f}x faster; "
        f"{a_warm['ttft'] * 1000:.0f} ms from DRAM in (a)), {sum(c_again['loaded'].values())} of "
        f"{len(c_again['prompt']) // BLOCK_SIZE} prompt blocks loaded ({loaded(c_again)})")
    fc = tier[-1]["final_counters"]
    files = [f for f in NVME_DIR.rglob("*.kvt") if f.is_file()]
    say(f"tiers: CPU evicted {int(fc.get(('evictions', 'cpu'), 0))} blocks; NVMe stored "
        f"{int(fc.get(('blocks_stored', 'nvme'), 0))} blocks while serving (write-back demotions); after "
        f"the shutdown flush {len(files)} chunk files, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB "
        f"under {NVME_DIR}")

    same_prompts = all(b["prompt"] == k["prompt"] for b, k in zip(base, tier, strict=True))
    same_tokens = all(b["tokens"] == k["tokens"] for b, k in zip(base, tier, strict=True))
    n = sum(len(k["tokens"]) for k in tier)
    for b, k in zip(base, tier, strict=True):
        if b["prompt"] != k["prompt"] or b["tokens"] != k["tokens"]:
            first = next((i for i, (x, y) in enumerate(zip(b["tokens"], k["tokens"], strict=False)) if x != y), None)
            say(f"  {k['label']}: prompts {'equal' if b['prompt'] == k['prompt'] else 'differ'}, "
                f"tokens differ from position {first}")
    say(f"tokens with reuse vs without: {'identical' if same_tokens and same_prompts else 'DIFFERENT'} "
        f"({n} greedy tokens over {len(tier)} requests)")
    loaded_ok = (sum(a_warm["loaded"].values()) > 0 and sum(t2["loaded"].values()) > 0
                 and c_again["loaded"].get("nvme", 0) > 0)
    if not loaded_ok:
        say("MISSING reuse: (a) and (b) must load blocks, (c) must load from NVMe")
    say(f"done in {time.perf_counter() - t_all:.0f}s")
    return 0 if same_tokens and same_prompts and loaded_ok else 1


if __name__ == "__main__":
    sys.exit(main())
