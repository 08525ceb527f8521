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

from tests.conftest import BLOCK_SIZE, Result, assert_same_tokens, kvtier_config, reuse_scenario
from vllm_kvtier.tiers.nvme import read_header

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


def _start_server(model: Path, kv: dict, log_path: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's own OpenAI API server with the plugin (vLLM's default shutdown: a SIGTERM
    aborts the engine at once), ready to serve; (process, base URL)."""
    port = _free_port()
    log = open(log_path, "w")  # noqa: SIM115 (the server writes it until it exits)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
        "--enforce-eager", "--no-enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
        "--kv-transfer-config", json.dumps(kv),
    ]
    server = subprocess.Popen(cmd, cwd=ROOT, env=_env(VLLM_CPU_KVCACHE_SPACE="1"), stdout=log,
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
    server, base_url = _start_server(tiny_model, kvtier_config(), tmp_path / "server.log")
    try:
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
    finally:
        _stop_server(server)


def _stored_blocks(root: Path) -> int:
    """Blocks in the chunk files under ``root`` that verify (a torn file would raise)."""
    n = 0
    for f in root.rglob("*.kvt"):
        n += read_header(f, f.parent.parent.name).nblocks
    return n


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_api_server_comes_back_warm_after_a_plain_stop(tiny_model, baseline, tmp_path, stop):
    """The default config (cpu + nvme, nothing else) behind vLLM's own API server, stopped
    as operators stop it: a plain SIGTERM (vLLM's default --shutdown-timeout 0 aborts the
    engine at once, so no shutdown flush runs) or a SIGKILL of every process (a crash).
    What the idle engine flushed after serving is on NVMe, no chunk file is torn, and a new
    server loads the prompt's blocks from NVMe with the baseline's tokens."""
    nvme = tmp_path / "nvme"
    kv = kvtier_config({"cpu": {"capacity_bytes": 32 * 2**20},
                        "nvme": {"path": str(nvme), "capacity_bytes": 256 * 2**20}})
    _, make_prompt, max_tokens = reuse_scenario()[0]
    prompt = make_prompt({})
    server, url = _start_server(tiny_model, kv, tmp_path / "server-1.log")
    try:
        assert _complete(url, tiny_model, prompt, max_tokens) == baseline["first"].tokens
        deadline = time.monotonic() + 120  # the idle flush: an outcome, waited for generously
        while _stored_blocks(nvme) < P1_BLOCKS_ASYNC and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _stored_blocks(nvme) >= P1_BLOCKS_ASYNC, "the idle engine flushed nothing to NVMe"
        if stop == "sigterm":
            server.send_signal(signal.SIGTERM)  # the API server alone, as a pod stop or ^C does
        else:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=60)
    finally:
        _stop_server(server)
    assert _stored_blocks(nvme) >= P1_BLOCKS_ASYNC  # every chunk file left verifies: nothing torn
    server, url = _start_server(tiny_model, kv, tmp_path / "server-2.log")
    try:
        assert _complete(url, tiny_model, prompt, max_tokens) == baseline["first"].tokens
        assert _wait_metric(url, "vllm:kvtier_blocks_loaded_total", "nvme", P1_BLOCKS_ASYNC) == P1_BLOCKS_ASYNC
    finally:
        _stop_server(server)
