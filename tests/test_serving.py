"""The plugin as operators run it: a multiprocess engine (EngineCore and Worker in their
own processes) and the OpenAI-compatible API server on 127.0.0.1."""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parent.parent
P1_BLOCKS = (320 - 1) // BLOCK_SIZE


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


@pytest.mark.slow
def test_openai_api_server(tiny_model, baseline, tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 (closed in finally)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
        "--enforce-eager", "--no-enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
        "--kv-transfer-config", json.dumps(kvtier_config()),
    ]
    server = subprocess.Popen(cmd, cwd=ROOT, env=_env(VLLM_CPU_KVCACHE_SPACE="1"), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                if requests.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "server not ready in 240 s"
            time.sleep(1)

        def complete(prompt: list[int], max_tokens: int) -> list[int]:
            r = requests.post(f"{base_url}/v1/completions", timeout=120, json={
                "model": str(tiny_model), "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            })
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

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
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
