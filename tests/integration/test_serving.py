"""The plugin as operators run it: a multiprocess engine (EngineCore and Worker in their
own processes) and the OpenAI-compatible API server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from bench import timeline
from tests.conftest import BLOCK_SIZE, Result, assert_same_tokens, kvtier_config, reuse_scenario
from vllm_kvtier.tiers.nvme.store import read_header

ROOT = Path(__file__).resolve().parents[2]
P1_BLOCKS = (320 - 1) // BLOCK_SIZE  # a sync load (DRAM) stops before the block of the last token
P1_BLOCKS_ASYNC = 320 // BLOCK_SIZE  # an async load (from NVMe) covers the whole 10-block prompt


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT), **extra})
    return env


@pytest.mark.slow
def test_multiprocess_engine(tiny_model, baseline):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine_run", str(tiny_model), json.dumps(kvtier_config())],
        cwd=ROOT, env=_env(VLLM_ENABLE_V1_MULTIPROCESSING="1"), capture_output=True, text=True,
        timeout=600,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    data = json.loads(line.removeprefix("RESULT "))
    res = {k: Result(**v) for k, v in data["results"].items()}
    assert_same_tokens(baseline, res)
    assert res["repeat"].loaded == P1_BLOCKS
    assert res["shared_prefix"].loaded == 300 // BLOCK_SIZE
    assert res["turn2"].loaded == 11
    assert data["counters"]["blocks_stored|cpu"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(text: str, name: str, tier: str = "cpu") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'tier="{tier}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _server_cmd(model: Path, kv: dict, port: int) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
        "--enforce-eager", "--no-enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
        "--kv-transfer-config", json.dumps(kv),
    ]


def _start_server(model: Path, kv: dict, log_path: Path, log_level: str = "WARNING",
                  timeline: Path | None = None) -> tuple[subprocess.Popen, str]:
    """vLLM's own OpenAI API server with the plugin (vLLM's default shutdown: a SIGTERM
    aborts the engine at once), ready to serve; (process, base URL). ``timeline``: the
    serving benchmark's ``--timeline`` recorder (``bench/timeline.py``) writes there."""
    port = _free_port()
    log = open(log_path, "w")  # noqa: SIM115 (the server writes it until it exits)
    cmd = _server_cmd(model, kv, port)
    env = _env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL=log_level)
    if timeline is not None:
        env |= {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'bench' / 'timeline_hook'}",
                "KVTIER_BENCH_TIMELINE": str(timeline)}
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert server.poll() is None, log_path.read_text()[-4000:]
        try:
            if requests.get(f"{base_url}/health", timeout=2).status_code == 200:
                return server, base_url
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, "server not ready in 300 s"
        time.sleep(1)


def _stop_server(server: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def _complete(base_url: str, model: Path, prompt: list[int], max_tokens: int) -> list[int]:
    r = requests.post(f"{base_url}/v1/completions", timeout=300, json={
        "model": str(model), "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True,
    })
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def _wait_metric(base_url: str, name: str, tier: str, at_least: float, timeout_s: float = 60.0) -> float:
    """The metric once it reaches ``at_least`` (stats reach the API server after the
    response), or its value at the deadline: the caller asserts on the value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = _metric(requests.get(f"{base_url}/metrics", timeout=10).text, name, tier)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


@pytest.mark.slow
def test_openai_api_server(tiny_model, baseline, tmp_path):
    """The reuse scenario through vLLM's server; the plugin is operable from the first
    minute: its counters are scraped at 0 before any traffic, its INFO lines are in the
    server's log in vLLM's format. The serving benchmark's ``--timeline`` recorder rides
    along: it wraps the installed vLLM's methods (none missing), changes no token, and
    records every request's way in order."""
    log_path = tmp_path / "server.log"
    recorded = tmp_path / "timeline.jsonl"
    server, base_url = _start_server(tiny_model, kvtier_config(), log_path, log_level="INFO", timeline=recorded)
    try:
        idle = requests.get(f"{base_url}/metrics", timeout=10).text
        zero = [ln for ln in idle.splitlines()
                if ln.startswith("vllm:kvtier_load_failures_total{") and 'tier="cpu"' in ln]
        assert zero and float(zero[0].rsplit(" ", 1)[1]) == 0.0, "no load_failures series at 0 before traffic"
        assert "vllm:kvtier_blocks_loaded_total{" in idle
        assert 'vllm:kvtier_background_cpu_seconds_total{' in idle, "no series for the plugin threads' CPU"
        def complete(prompt: list[int], max_tokens: int) -> list[int]:
            return _complete(base_url, tiny_model, prompt, max_tokens)

        scenario = reuse_scenario()
        got: dict[str, list[int]] = {}
        loaded: dict[str, float] = {}
        for name, make_prompt, max_tokens in scenario:
            before = _metric(requests.get(f"{base_url}/metrics", timeout=10).text, "vllm:kvtier_blocks_loaded_total")
            tokens = complete(make_prompt({k: Result(v, [], 0, 0) for k, v in got.items()}), max_tokens)
            got[name] = tokens
            # Stats reach the API server asynchronously: wait for them briefly.
            for _ in range(50):
                after = _metric(requests.get(f"{base_url}/metrics", timeout=10).text, "vllm:kvtier_blocks_loaded_total")
                if after > before or name in ("first", "unrelated"):
                    break
                time.sleep(0.1)
            loaded[name] = after - before
        for name in got:
            assert got[name] == baseline[name].tokens, name
        assert loaded["repeat"] == P1_BLOCKS
        assert loaded["turn2"] == 11
        plugin_lines = [ln for ln in log_path.read_text().splitlines() if "kvtier: CPU tier" in ln]
        assert plugin_lines and " INFO " in plugin_lines[0], "the plugin's start-up line is not in the server log"
    finally:
        _stop_server(server)
    summary = timeline.summarize(timeline.read(recorded))
    assert summary["missing"] == []
    assert summary["requests"] == len(scenario), summary
    assert summary["steps"] >= len(scenario) and summary["running_mean"] > 0
    assert all(p["mean"] is not None and p["mean"] >= 0 for p in summary["phases_ms"].values()), summary


@pytest.mark.slow
def test_an_oversized_cpu_budget_stops_the_server_at_start_naming_the_field(tiny_model, tmp_path):
    """A CPU budget the machine cannot hold fails the start, before /health says 200, with
    a non-zero exit and the field named (it used to pass /health and kill the server at
    its first request, exiting 0)."""
    kv = kvtier_config({"cpu": {"capacity_bytes": 1 << 50}})
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_server_cmd(tiny_model, kv, _free_port()), cwd=ROOT,
                                env=_env(VLLM_CPU_KVCACHE_SPACE="1"), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    text = log_path.read_text()
    assert rc != 0, text[-4000:]
    assert "cpu.capacity_bytes" in text, text[-4000:]


def _stored_blocks(root: Path) -> int:
    """Blocks in the chunk files under ``root`` that verify (a torn file would raise)."""
    n = 0
    for f in root.rglob("*.kvt"):
        n += read_header(f, f.parent.parent.name).nblocks
    return n


@pytest.mark.slow
def test_api_server_comes_back_warm_after_a_plain_stop_and_after_a_crash(tiny_model, baseline, tmp_path):
    """The default config (cpu + nvme, nothing else) behind vLLM's own API server, stopped
    as operators stop it, twice on one NVMe path: a plain SIGTERM (vLLM's default
    --shutdown-timeout 0 aborts the engine at once, so no shutdown flush runs), then a
    SIGKILL of every process (a crash). Each time, what the idle engine flushed after
    serving is on NVMe, no chunk file is torn, and the next server loads the prompt's
    blocks from NVMe with the baseline's tokens."""
    nvme = tmp_path / "nvme"
    kv = kvtier_config({"cpu": {"capacity_bytes": 32 * 2**20},
                        "nvme": {"path": str(nvme), "capacity_bytes": 256 * 2**20}})
    scenario = {name: (make_prompt, max_tokens) for name, make_prompt, max_tokens in reuse_scenario()}
    prompts = {name: scenario[name][0]({}) for name in ("first", "unrelated")}
    blocks = {name: len(prompts[name]) // BLOCK_SIZE for name in prompts}  # async loads: whole blocks
    assert blocks["first"] == P1_BLOCKS_ASYNC and blocks["unrelated"] >= 1

    def serve(name: str, url: str) -> None:
        assert _complete(url, tiny_model, prompts[name], scenario[name][1]) == baseline[name].tokens

    def flushed(at_least: int) -> None:
        deadline = time.monotonic() + 120  # the idle flush: an outcome, waited for generously
        while _stored_blocks(nvme) < at_least and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _stored_blocks(nvme) >= at_least, "the idle engine flushed nothing new to NVMe"

    server, url = _start_server(tiny_model, kv, tmp_path / "server-1.log")
    try:
        serve("first", url)
        flushed(blocks["first"])
        server.send_signal(signal.SIGTERM)  # the API server alone, as a pod stop or ^C does
        server.wait(timeout=60)
    finally:
        _stop_server(server)
    assert _stored_blocks(nvme) >= blocks["first"]  # every chunk file left verifies: nothing torn

    server, url = _start_server(tiny_model, kv, tmp_path / "server-2.log")
    try:
        serve("first", url)
        assert _wait_metric(url, "vllm:kvtier_blocks_loaded_total", "nvme", blocks["first"]) == blocks["first"]
        serve("unrelated", url)
        flushed(blocks["first"] + blocks["unrelated"])
        os.killpg(server.pid, signal.SIGKILL)  # a crash: every process at once
        server.wait(timeout=60)
    finally:
        _stop_server(server)
    assert _stored_blocks(nvme) >= blocks["first"] + blocks["unrelated"]

    server, url = _start_server(tiny_model, kv, tmp_path / "server-3.log")
    try:
        serve("unrelated", url)
        serve("first", url)
        want = blocks["first"] + blocks["unrelated"]
        assert _wait_metric(url, "vllm:kvtier_blocks_loaded_total", "nvme", want) == want
    finally:
        _stop_server(server)


def test_a_config_typo_on_the_command_line_stops_the_server_before_the_model_loads(tmp_path):
    """vLLM builds the connector after the model is loaded; the plugin checks the config
    given on vLLM's command line as vLLM loads plugins, first of all: exit 2, one line
    naming the field, no traceback, and no model load (the model path does not even
    exist: vLLM would fail on it later, differently)."""
    kv = kvtier_config({"cpu": {"capacty_bytes": 5}})
    proc = subprocess.run(_server_cmd(tmp_path / "no-such-model", kv, _free_port()), cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "kvtier config field 'cpu.capacty_bytes': unknown key" in proc.stderr
    assert "Traceback" not in proc.stderr and "no-such-model" not in proc.stderr
