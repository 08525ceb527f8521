"""Trace replay: shared system prompts, multi-turn chats and a flood of one-off documents.

The workload (seeded, generated here) is what a small CPU tier finds hardest to keep hot:

* a few long **system prompts** (``--sys-tokens``) shared by many users;
* **multi-turn conversations**: each user picks a system prompt; turn 1 is that prompt +
  the user's text, turn n+1 is turn n's prompt + the model's answer (``--answer-tokens``,
  generated greedily) + new user text. A handful of conversations are open at a time;
* **floods of one-off documents** (``--doc-tokens``, never seen again) arriving in bursts
  between chat turns: a scan that pushes everything else out of an LRU pool.

It is replayed request by request on real vLLM engines, one per configuration, each in its
own process (in-process engine core, so the bench reaches the connector's index), in lock
step: request i goes to every engine, one after the other, before request i+1, so load
from other jobs on this shared machine hits every configuration alike. The model is the
locally built random-weight "tiny" one (float32, block 32 tokens = 64 KiB), with vLLM's
own prefix cache on (as in production) but a KV cache (``--gpu-blocks``, 160) too small to
keep what is shared, and a CPU tier (``--cpu-blocks``, 512) that holds the system prompts
(3 x 64 blocks) and some traffic, not the floods (4-12 documents of 24-48 blocks each):

* ``none``: no connector (vLLM's prefix cache alone);
* ``lru``: KVTierConnector, ``cpu.eviction: lru``;
* ``s3fifo``: KVTierConnector, ``cpu.eviction: s3fifo`` (scan-resistant: reuse count);
* ``s3fifo+pin``: the same, plus the system prompts' blocks pinned through the index API
  (``SlotIndex.pin_key``, TTL ``--pin-ttl-s``) right after the warm-up, as a request-level
  pin would do.

Every engine first serves the same unmeasured warm-up (one short request, then each system
prompt once), then the trace. Per request: TTFT (vLLM's own ``first_token_latency``, from
arrival to the first token), blocks hit in vLLM's prefix cache ("gpu": its cached tokens
minus the connector's) and in the CPU tier (the connector's ``hit_blocks``), over the
blocks a tier could serve (all full prompt blocks but the one holding the last token), and
the prompt tokens the engine had to compute ("computed": the deterministic part of TTFT,
immune to the machine's noise). For chat requests, the system prompt's share of the hits
is reported apart. Greedy answers must be identical in every configuration (they feed the
next turns): asserted.

    python bench/trace_replay.py                 # ~2 min on 2 quiet CPU cores, ~10 min when shared
    python bench/trace_replay.py --requests 200 --configs none,lru,s3fifo

The machine is shared and noisy: compare configurations of the same run, not runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.tinymodel import SIZES, VOCAB, build_model  # noqa: E402
from vllm_kvtier.keys import BlockKey  # noqa: E402

CONFIGS = ("none", "lru", "s3fifo", "s3fifo+pin")

# ---- the workload --------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    kind: str  # "chat" or "doc"
    user: int = -1  # chat: the user, whose turns come in order
    turn: int = 0
    tokens: tuple[int, ...] = ()  # chat: the user's new text; doc: the whole prompt


@dataclass
class Workload:
    system_prompts: list[list[int]]
    user_system: list[int]  # user -> system prompt index
    events: list[Event]


def make_workload(a: argparse.Namespace) -> Workload:
    rng = random.Random(a.seed)

    def text(lo: int, hi: int) -> tuple[int, ...]:
        return tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi)))

    systems = [list(text(a.sys_tokens, a.sys_tokens)) for _ in range(a.system_prompts)]
    # Popularity of the system prompts: 1, 1/2, 1/3... (Zipf-like).
    weights = [1 / (i + 1) for i in range(a.system_prompts)]
    user_system: list[int] = []
    turns_left: dict[int, int] = {}
    turns_done: dict[int, int] = {}
    open_users: list[int] = []
    events: list[Event] = []
    while len(events) < a.requests:
        if rng.random() < a.flood_prob:
            for _ in range(min(rng.randint(a.flood_min, a.flood_max), a.requests - len(events))):
                events.append(Event("doc", tokens=text(a.doc_tokens[0], a.doc_tokens[1])))
            continue
        while len(open_users) < a.open_chats:
            u = len(user_system)
            user_system.append(rng.choices(range(a.system_prompts), weights)[0])
            turns_left[u] = rng.randint(a.turns[0], a.turns[1])
            open_users.append(u)
        u = rng.choice(open_users)
        turns_done[u] = turns_done.get(u, 0) + 1
        events.append(Event("chat", u, turns_done[u], text(a.user_tokens[0], a.user_tokens[1])))
        turns_left[u] -= 1
        if turns_left[u] == 0:
            open_users.remove(u)
    return Workload(systems, user_system, events)


# ---- one engine ------------------------------------------------------------------------


@dataclass
class Record:
    kind: str
    prompt_tokens: int
    loadable: int  # full prompt blocks a tier could serve
    sys_blocks: int  # chat: full blocks of its system prompt
    gpu_hit: int
    cpu_hit: int
    computed: int  # prompt tokens the engine computed (not served by a tier)
    ttft_s: float
    answer: list[int] = field(default_factory=list)


class Engine:
    def __init__(self, model_dir: Path, kv: dict | None, a: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams

        self.a = a
        self.llm = LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=a.max_model_len,
            enforce_eager=True,
            enable_prefix_caching=True,
            block_size=a.block_size,
            kv_cache_memory_bytes=a.gpu_blocks * a.block_bytes,
            kv_transfer_config=kv,
            disable_log_stats=False,
            seed=0,
        )
        self.core = self.llm.llm_engine.engine_core.engine_core
        conn = getattr(self.core.scheduler, "connector", None)
        self.half = getattr(conn, "scheduler_half", None)
        self.sp = {
            n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
            for n in (1, a.answer_tokens)
        }

    def check_policy(self, eviction: str) -> None:
        """Fail unless the CPU index runs ``eviction``: the configuration's name says which
        policy a row measures, and the connector passes ``cpu.eviction`` to its index."""
        assert self.half is not None
        got = self.half.planner.index.eviction
        if got != eviction:
            raise SystemExit(f"configuration {eviction!r}: the CPU index runs {got!r}")

    def counter(self, name: str) -> float:
        return self.half.planner.counters.totals.get(f"{name}|cpu", 0.0) if self.half is not None else 0.0

    def run(self, prompt: list[int], max_tokens: int) -> tuple[float, int, int, list[int]]:
        """(TTFT, cached tokens, CPU-tier hit blocks, generated tokens) of one request."""
        from vllm.inputs import TokensPrompt

        hits = self.counter("hit_blocks")
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], self.sp[max_tokens], use_tqdm=False)
        out = outs[0]
        cpu_hit = int(self.counter("hit_blocks") - hits)
        return out.metrics.first_token_latency, out.num_cached_tokens, cpu_hit, list(out.outputs[0].token_ids)

    def pin_prefix(self, tokens: list[int], ttl_s: float) -> dict[str, int]:
        """Pin the blocks of ``tokens`` in the CPU index, keyed as vLLM hashes them."""
        hasher = self.core.request_block_hasher
        fake = SimpleNamespace(
            block_hashes=[],
            num_tokens=len(tokens),
            all_token_ids=tokens,
            mm_features=[],
            lora_request=None,
            cache_salt=None,
            prompt_embeds=None,
        )
        outcomes: dict[str, int] = {}
        for h in hasher(fake):
            o = self.half.planner.index.pin_key(BlockKey(h), ttl_s)
            outcomes[o.value] = outcomes.get(o.value, 0) + 1
        return outcomes

    def close(self) -> None:
        import contextlib
        import gc

        with contextlib.suppress(Exception):
            self.core.shutdown()
        del self.llm
        gc.collect()


def kv_config(name: str, a: argparse.Namespace) -> dict | None:
    if name == "none":
        return None
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "vllm_kvtier.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "cpu": {"capacity_bytes": a.cpu_blocks * a.block_bytes, "eviction": name.split("+")[0]}
        },
    }


def serve(conn: Any, name: str, model_dir: Path, systems: list[list[int]], a: argparse.Namespace) -> None:
    """One configuration's engine, in its own process: set up, then answer ``(prompt,
    max_tokens)`` messages with :meth:`Engine.run`'s tuple until ``None``; then report."""
    t0 = time.perf_counter()
    eng = Engine(model_dir, kv_config(name, a), a)
    info: dict[str, Any] = {"config": name, "engine_start_s": time.perf_counter() - t0}
    if name != "none":
        eng.check_policy(name.split("+")[0])
    rng = random.Random(a.seed + 1)
    eng.run([rng.randrange(3, VOCAB) for _ in range(64)], 1)
    for s in systems:  # warm-up: every system prompt seen once, unmeasured
        eng.run(s + [rng.randrange(3, VOCAB) for _ in range(8)], 1)
    if name.endswith("+pin"):
        info["pins"] = {i: eng.pin_prefix(s, a.pin_ttl_s) for i, s in enumerate(systems)}
    conn.send(info)
    while (msg := conn.recv()) is not None:
        conn.send(eng.run(*msg))
    if eng.half is not None:
        info["counters"] = {k: v for k, v in eng.half.planner.counters.totals.items() if k.endswith("|cpu")}
        info["pinned_keys_end"] = eng.half.planner.index.pinned_keys
        info["eviction"] = eng.half.planner.index.eviction
    eng.close()
    conn.send(info)


def replay(
    names: list[str], model_dir: Path, w: Workload, a: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Replay ``w`` on one engine per configuration, in lock step: request i goes to every
    engine (one after the other, in an order rotated per request) before request i+1, so
    load from other jobs on the machine hits every configuration alike. The next turn of
    a conversation is built from the first configuration's answer."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    conns, procs, res = {}, [], {}
    for name in names:
        here, there = ctx.Pipe()
        p = ctx.Process(target=serve, args=(there, name, model_dir, w.system_prompts, a), daemon=True)
        p.start()
        conns[name] = here
        procs.append(p)
        res[name] = here.recv()  # started one at a time: start-up is not measured
        print(
            f"  {name:11s} engine up in {res[name]['engine_start_s']:.1f}s"
            + (f", pins {res[name]['pins']}" if "pins" in res[name] else ""),
            flush=True,
        )
    bs = a.block_size
    records: dict[str, list[Record]] = {n: [] for n in names}
    last_prompt: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for i, e in enumerate(w.events):
        if e.kind == "doc":
            prompt, max_tokens = list(e.tokens), 1
        else:
            prompt = last_prompt.get(e.user, w.system_prompts[w.user_system[e.user]]) + list(e.tokens)
            max_tokens = a.answer_tokens
        loadable = max(0, (len(prompt) - 1) // bs)
        sys_blocks = a.sys_tokens // bs if e.kind == "chat" else 0
        for name in names[i % len(names) :] + names[: i % len(names)]:
            conns[name].send((prompt, max_tokens))
            ttft, cached, cpu_hit, out = conns[name].recv()
            records[name].append(
                Record(
                    e.kind,
                    len(prompt),
                    loadable,
                    sys_blocks,
                    max(0, cached // bs - cpu_hit),
                    cpu_hit,
                    len(prompt) - cached,
                    ttft,
                    out if e.kind == "chat" else [],
                )
            )
        if e.kind == "chat":
            last_prompt[e.user] = prompt + records[names[0]][-1].answer
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{len(w.events)} requests, {time.perf_counter() - t0:.0f}s", flush=True)
    for name in names:
        conns[name].send(None)
        res[name].update(conns[name].recv())
        res[name]["replay_s"] = time.perf_counter() - t0
        res[name]["summary"] = summarize(records[name])
        res[name]["records"] = [r.__dict__ for r in records[name]]  # dropped from the JSON unless --records
    for p in procs:
        p.join(timeout=60)
    return res


# ---- numbers ---------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1), nearest rank: what a p99 SLO counts."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def summarize(records: list[Record]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group, rs in (
        ("all", records),
        ("chat", [r for r in records if r.kind == "chat"]),
        ("doc", [r for r in records if r.kind == "doc"]),
    ):
        if not rs:
            continue
        loadable = sum(r.loadable for r in rs) or 1
        t = [r.ttft_s for r in rs]
        c = [float(r.computed) for r in rs]
        out[group] = {
            "requests": len(rs),
            "hit_gpu": sum(r.gpu_hit for r in rs) / loadable,
            "hit_cpu": sum(r.cpu_hit for r in rs) / loadable,
            "hit_total": sum(r.gpu_hit + r.cpu_hit for r in rs) / loadable,
            "ttft_mean_s": statistics.fmean(t),
            "ttft_p50_s": pct(t, 0.5),
            "ttft_p99_s": pct(t, 0.99),
            "computed_mean": statistics.fmean(c),
            "computed_p99": pct(c, 0.99),
        }
        if group == "chat":
            # The system prompt's share: hits form a prefix, so min(hits, its blocks).
            sys_total = sum(r.sys_blocks for r in rs) or 1
            out[group]["sys_hit_total"] = (
                sum(min(r.gpu_hit + r.cpu_hit, r.sys_blocks) for r in rs) / sys_total
            )
            out[group]["sys_hit_cpu"] = (
                sum(min(r.gpu_hit + r.cpu_hit, r.sys_blocks) - min(r.gpu_hit, r.sys_blocks) for r in rs)
                / sys_total
            )
            out[group]["sys_full_hits"] = sum(r.gpu_hit + r.cpu_hit >= r.sys_blocks for r in rs) / len(rs)
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    hdr = (
        f"{'config':11s} {'group':5s} {'n':>4s} {'hit gpu':>7s} {'hit cpu':>7s} {'hit all':>7s} "
        f"{'sys hit':>7s} {'sys cpu':>7s} {'TTFT mean':>9s} {'p50':>7s} {'p99':>7s} {'computed':>8s} {'p99':>5s}"
    )
    lines += [hdr, "-" * len(hdr)]
    for name, res in results.items():
        for group in ("all", "chat", "doc"):
            s = res["summary"].get(group)
            if s is None:
                continue
            sys_hit = f"{s['sys_hit_total']:7.1%}" if "sys_hit_total" in s else f"{'':7s}"
            sys_cpu = f"{s['sys_hit_cpu']:7.1%}" if "sys_hit_cpu" in s else f"{'':7s}"
            lines.append(
                f"{name if group == 'all' else '':11s} {group:5s} {s['requests']:4d} {s['hit_gpu']:7.1%} "
                f"{s['hit_cpu']:7.1%} {s['hit_total']:7.1%} {sys_hit} {sys_cpu} "
                f"{s['ttft_mean_s'] * 1e3:7.1f}ms {s['ttft_p50_s'] * 1e3:5.1f}ms {s['ttft_p99_s'] * 1e3:5.1f}ms "
                f"{s['computed_mean']:8.0f} {s['computed_p99']:5.0f}"
            )
    return "\n".join(lines)


def paired(base: list[dict[str, Any]], other: list[dict[str, Any]], kind: str) -> dict[str, float]:
    """Request by request (same request, same moment, lock step): how often ``other`` had
    the lower TTFT, and the median ratio other/base."""
    pairs = [(b["ttft_s"], o["ttft_s"]) for b, o in zip(base, other, strict=True) if b["kind"] == kind]
    return {
        "faster_share": sum(o < b for b, o in pairs) / len(pairs),
        "median_ratio": statistics.median(o / b for b, o in pairs),
    }


def pair(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(",")
    return int(lo), int(hi or lo)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/vllm_kvtier/tiny-model"))
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}"
    )
    ap.add_argument("--requests", type=int, default=360)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--system-prompts", type=int, default=3)
    ap.add_argument("--sys-tokens", type=int, default=2048)
    ap.add_argument("--open-chats", type=int, default=6, help="conversations open at a time")
    ap.add_argument("--turns", type=pair, default=(2, 6), help="turns per conversation: lo,hi")
    ap.add_argument("--user-tokens", type=pair, default=(32, 160), help="new user text per turn: lo,hi")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--doc-tokens", type=pair, default=(768, 1536), help="one-off document length: lo,hi")
    ap.add_argument(
        "--flood-prob", type=float, default=0.12, help="chance that a flood comes before a chat turn"
    )
    ap.add_argument("--flood-min", type=int, default=4)
    ap.add_argument("--flood-max", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--gpu-blocks", type=int, default=160, help="vLLM KV cache, in blocks")
    ap.add_argument("--cpu-blocks", type=int, default=512, help="CPU tier, in blocks")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--pin-ttl-s", type=float, default=3600.0)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "trace_replay.json"))
    ap.add_argument("--records", action="store_true", help="also write every request's numbers to the JSON")
    a = ap.parse_args()

    import torch
    import vllm

    spec = SIZES["tiny"]
    # K and V, every layer, float32: the bytes of one block in vLLM's cache and in a CPU slot.
    a.block_bytes = (
        2 * spec["num_hidden_layers"] * spec["num_key_value_heads"] * spec["head_dim"] * 4 * a.block_size
    )
    t_all = time.perf_counter()
    model_dir = build_model(
        a.model_dir, "tiny", dtype="float32", max_position_embeddings=max(8192, a.max_model_len)
    )
    w = make_workload(a)
    n_chat = sum(e.kind == "chat" for e in w.events)
    print(
        f"workload: {len(w.events)} requests ({n_chat} chat turns of {len(w.user_system)} users on "
        f"{a.system_prompts} system prompts of {a.sys_tokens} tokens, {len(w.events) - n_chat} one-off documents "
        f"of {a.doc_tokens[0]}-{a.doc_tokens[1]} tokens in floods); block {a.block_size} tokens; vLLM cache "
        f"{a.gpu_blocks} blocks, CPU tier {a.cpu_blocks} blocks; load avg {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    names = [c.strip() for c in a.configs.split(",") if c.strip()]
    for name in names:
        if name not in CONFIGS:
            ap.error(f"unknown config {name!r}")
    results = replay(names, model_dir, w, a)

    failures = []
    ref = next(iter(results.values()))
    for name, res in results.items():
        bad = sum(x["answer"] != y["answer"] for x, y in zip(ref["records"], res["records"], strict=True))
        if bad:
            failures.append(f"{name}: {bad} answers differ from {ref['config']}'s")
    print()
    print(
        "hit rates over the blocks a tier could serve; 'sys' = the system prompt's blocks of chat requests; "
        "TTFT = vLLM first_token_latency; computed = prompt tokens prefilled (mean, p99)"
    )
    print(table(results))
    verdict = {}
    if "lru" in results:
        lru = results["lru"]["summary"]["chat"]
        for name in ("s3fifo", "s3fifo+pin"):
            if name in results:
                s = results[name]["summary"]
                pc = paired(results["lru"]["records"], results[name]["records"], "chat")
                v = verdict[name] = {
                    "p99_all_better": s["all"]["ttft_p99_s"] < results["lru"]["summary"]["all"]["ttft_p99_s"],
                    "p99_chat_better": s["chat"]["ttft_p99_s"] < lru["ttft_p99_s"],
                    "sys_hit_better": s["chat"]["sys_hit_total"] > lru["sys_hit_total"],
                    "computed_p99_chat_lower": s["chat"]["computed_p99"] < lru["computed_p99"],
                    "paired_chat": pc,
                }

                def word(ok: bool) -> str:
                    return "better" if ok else "NOT better"

                print(
                    f"{name} vs lru: p99 TTFT all {word(v['p99_all_better'])}, chat {word(v['p99_chat_better'])}; "
                    f"system-prompt hit rate {word(v['sys_hit_better'])}; chat p99 computed tokens "
                    f"{word(v['computed_p99_chat_lower'])}; chat requests faster {pc['faster_share']:.0%} "
                    f"of the time, median TTFT ratio {pc['median_ratio']:.2f}"
                )
    for f in failures:
        print("FAIL:", f)
    total = time.perf_counter() - t_all
    print(f"total {total:.0f}s, load avg {os.getloadavg()[0]:.2f}")
    out = {
        "args": {k: v for k, v in vars(a).items()},
        "verdict": verdict,
        "failures": failures,
        "results": results,
        "env": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "total_s": total,
        },
    }
    if not a.records:
        for res in results.values():
            del res["records"]
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
