"""Data parallelism on vLLM's own API server: ``--data-parallel-size 2``, both engines on one
``nvme.path``, each request sent to the engine a test names (vLLM's ``X-data-parallel-rank``
header). Under ``kv_load_failure_policy: fail`` a failed load is a client error, so every
answer that comes back loaded nothing wrong."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import BLOCK_SIZE, kvtier_config, reuse_scenario
from tests.integration.test_serving import _env, _free_port, _server_cmd, _stop_server, _stored_blocks

DP = 2


def _start(model: Path, kv: dict, log_path: Path) -> tuple[subprocess.Popen, str]:
    """The API server with two data-parallel engines, ready to serve."""
    port = _free_port()
    cmd = [*_server_cmd(model, kv, port), "--data-parallel-size", str(DP), "--kv-cache-memory-bytes", str(64 << 20)]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2], env=_env(VLLM_LOGGING_LEVEL="INFO"),
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 540  # two engines on a small shared machine start slowly
    while True:
        assert server.poll() is None, log_path.read_text()[-4000:]
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, "server not ready in 540 s"
        time.sleep(1)


def _complete(url: str, model: Path, prompt: list[int], max_tokens: int, engine: int) -> list[int]:
    r = requests.post(f"{url}/v1/completions", timeout=300, headers={"X-data-parallel-rank": str(engine)}, json={
        "model": str(model), "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True,
    })
    assert r.status_code == 200, r.text[:2000]
    return r.json()["choices"][0]["token_ids"]


def _nvme_loaded(url: str, engine: int, at_least: int, timeout_s: float = 60.0) -> float:
    """Blocks engine ``engine`` loaded from NVMe, once it reaches ``at_least`` (stats reach
    the API server after the response) or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        total = 0.0
        for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
            if (line.startswith("vllm:kvtier_blocks_loaded_total{") and 'tier="nvme"' in line
                    and f'engine="{engine}"' in line):
                total += float(line.rsplit(" ", 1)[1])
        if total >= at_least or time.monotonic() > deadline:
            return total
        time.sleep(0.2)


@pytest.mark.slow
def test_two_dp_engines_on_one_nvme_path_come_back_warm(tiny_model, baseline, tmp_path):
    """Engine 0 serves the long prompt, engine 1 another; each flushes it to its own NVMe
    directory. After a restart each engine loads its own prompt from NVMe, with the
    baseline's tokens; engine 1 asked for engine 0's prompt recomputes it (its NVMe
    holds none of it) and fails no load."""
    nvme = tmp_path / "nvme"
    kv = kvtier_config({"cpu": {"capacity_bytes": 32 * 2**20},
                        "nvme": {"path": str(nvme), "capacity_bytes": 256 * 2**20}})
    kv["kv_load_failure_policy"] = "fail"
    scenario = {name: (make({}), max_tokens) for name, make, max_tokens in reuse_scenario()
                if name in ("first", "unrelated")}
    mine = {0: "first", 1: "unrelated"}
    blocks = {name: len(prompt) // BLOCK_SIZE for name, (prompt, _) in scenario.items()}  # an async load's

    def ask(url: str, name: str, engine: int) -> list[int]:
        prompt, max_tokens = scenario[name]
        return _complete(url, tiny_model, prompt, max_tokens, engine)

    server, url = _start(tiny_model, kv, tmp_path / "server-1.log")
    try:
        for engine, name in mine.items():
            assert ask(url, name, engine) == baseline[name].tokens, name
        dirs = {0: "r0", 1: "dp1-r0"}
        deadline = time.monotonic() + 120  # the idle flush: an outcome, waited for generously
        while time.monotonic() < deadline and not all(
                sum(_stored_blocks(d) for d in nvme.glob(f"*/{dirs[e]}")) >= blocks[mine[e]] for e in mine):
            time.sleep(0.2)
        stored = {e: sum(_stored_blocks(d) for d in nvme.glob(f"*/{dirs[e]}")) for e in mine}
        assert all(stored[e] >= blocks[mine[e]] for e in mine), stored
    finally:
        _stop_server(server)
    log = (tmp_path / "server-1.log").read_text()
    assert "held by another engine" not in log and "tier disabled" not in log, log[-4000:]

    server, url = _start(tiny_model, kv, tmp_path / "server-2.log")
    try:
        for engine, name in mine.items():
            assert ask(url, name, engine) == baseline[name].tokens, name
            assert _nvme_loaded(url, engine, blocks[name]) == blocks[name], f"engine {engine} not warm"
        assert ask(url, "first", 1) == baseline["first"].tokens  # not in engine 1's NVMe: recomputed
        assert _nvme_loaded(url, 1, blocks["unrelated"] + 1, timeout_s=5) == blocks["unrelated"]
    finally:
        _stop_server(server)
