"""P/D end to end as operators run it: a prefill API server and a decode API server (each
its own multiprocess vLLM with the plugin) behind examples/pd_proxy.py, on 127.0.0.1, for
both hand-off paths (the Mooncake pool, NIXL peer to peer): the decode server's tokens
equal a single-instance baseline and its /metrics show the prompt blocks were loaded.

The first request goes through the proxy right after start (no warm-up): the prefill
workers publish their NIXL address in a step the plugin asks for at start.

What is asserted holds at any machine speed: the hand-off happened (every loadable block
of both prompts loaded on the decode side, no hand-off timeout, no failed load). Two API
servers and a proxy share this machine's cores with whatever else runs, so the waits of the
hand-off are set far above anything a healthy loaded host needs (:data:`GENEROUS`): on a
2-core host at load 15 a NIXL read to a new peer once took 11.8 s (later ones 1-15 ms) and
a batch of pool reads 1.0 s; the product defaults are checked elsewhere. A failure prints
both servers' kvtier counters and log tails."""

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

from testkit import mooncake_server as mcsrv
from tests.conftest import BLOCK_SIZE, kvtier_config
from tests.integration import test_nvme_engine as nvme_engine
from tests.integration.test_nvme_engine import SETS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LOADABLE = (330 - 1) // BLOCK_SIZE
#: The hand-off's waits in this test (stated, not the defaults): a slow host then delays
#: the hand-off, it cannot lose it. Mooncake: the decode side's wait for the prefill's puts,
#: each existence check, each read; NIXL: each read (its first sets up the connection) and
#: the prefill side's hold on the offered blocks (longer than a read may take).
GENEROUS = {
    "mooncake": {"handoff_wait_s": 120.0, "lookup_timeout_s": 2.0, "deadline_s": 60.0},
    "nixl": {"deadline_s": 120.0, "hold_s": 600.0},
}
#: What enables the hand-offs (issue 13: off by default, since clients can send
#: kv_transfer_params): the pool's wait, and the agents whose offers the decode side reads.
ENABLE = {
    "mooncake": {"accept_handoffs": True},
    "nixl": {"agent_name": "pd", "trusted_peers": ["pd-*"], "accept_remote_decode": True},
}
#: The prefill side's shared secret (nixl): the proxy adds it to the prefill call.
SECRET = "proxy-secret-0123456789"
baseline_of = nvme_engine.baseline_of
mooncake_master = mcsrv.mooncake_master


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1",
                UCX_MODULES="^ib", KVTIER_PD_SECRET=SECRET)


def _wait(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready: {log.read_text()[-2000:]}"
        time.sleep(1)


def _server(model: Path, kv: dict, log: Path) -> tuple[subprocess.Popen, str]:
    port = _port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
           "--no-enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--kv-transfer-config", json.dumps(kv)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _loaded(url: str, tier: str) -> float:
    total = 0.0
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:kvtier_blocks_loaded_total{") and f'tier="{tier}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _kvtier(url: str) -> dict[str, float]:
    """Every kvtier counter of ``url``'s /metrics, as ``"metric|tier": value``."""
    out: dict[str, float] = {}
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:kvtier_") and "_total{" in line:
            name = line[len("vllm:kvtier_"):line.index("_total{")]
            tier = line.split('tier="', 1)[1].split('"', 1)[0] if 'tier="' in line else ""
            out[f"{name}|{tier}"] = out.get(f"{name}|{tier}", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _counter(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines()
               if line.startswith(f"vllm:kvtier_{name}_total{{"))


@pytest.mark.parametrize("path", ["mooncake", "nixl"])
def test_prefill_decode_through_the_proxy(tiny_model, baseline_of, tmp_path, path, request):
    if path == "mooncake":
        master = request.getfixturevalue("mooncake_master")
        section = {"mooncake": {"master": master.address, "local_hostname": "127.0.0.1",
                                "global_segment_bytes": 64 * 2**20, "transfer_buffer_bytes": 16 * 2**20,
                                **GENEROUS["mooncake"], **ENABLE["mooncake"]}}
        tier = "mooncake"
    else:
        pytest.importorskip("nixl_cu12", reason="NIXL is not installed (tools/setup-remote.sh installs it)")
        section = {"nixl": {**GENEROUS["nixl"], **ENABLE["nixl"]}}
        tier = "peer"
    kv = {role: {**kvtier_config({"cpu": {"capacity_bytes": 64 * 2**20}, **section}), "kv_role": role}
          for role in ("kv_producer", "kv_consumer")}
    procs = []
    try:
        prefill, p_url = _server(tiny_model, kv["kv_producer"], tmp_path / "prefill.log")
        procs.append(prefill)
        decode, d_url = _server(tiny_model, kv["kv_consumer"], tmp_path / "decode.log")
        procs.append(decode)
        port = _port()
        proxy = subprocess.Popen([sys.executable, str(ROOT / "examples" / "pd_proxy.py"), "--prefill", p_url,
                                  "--decode", d_url, "--port", str(port)], cwd=ROOT, env=_env(),
                                 stdout=open(tmp_path / "proxy.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                 start_new_session=True)
        procs.append(proxy)
        for proc, url, name in ((prefill, p_url, "prefill"), (decode, d_url, "decode"),
                                (proxy, f"http://127.0.0.1:{port}", "proxy")):
            _wait(url, proc, tmp_path / f"{name}.log")
        ps = SETS[2]
        before = _loaded(d_url, tier)
        for p in ps:
            r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=600, json={
                "model": str(tiny_model), "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            r.raise_for_status()
            assert r.json()["choices"][0]["token_ids"] == baseline_of(p)
        for _ in range(50):  # stats reach the API server asynchronously
            if _loaded(d_url, tier) - before >= 2 * LOADABLE:
                break
            time.sleep(0.1)
        counters = _kvtier(d_url)
        diag = (f"decode counters {counters}\nprefill counters {_kvtier(p_url)}\n"
                f"decode log: {(tmp_path / 'decode.log').read_text()[-3000:]}\n"
                f"prefill log: {(tmp_path / 'prefill.log').read_text()[-3000:]}")
        # The hand-off happened: every block came from the prefill instance, none was lost
        # to a wait running out or a failed read.
        assert _loaded(d_url, tier) - before == 2 * LOADABLE, diag
        assert counters.get("handoff_timeouts|all", 0) == 0, diag
        assert counters.get(f"load_failures|{tier}", 0) == 0, diag
        assert requests.get(f"http://127.0.0.1:{port}/proxy_stats", timeout=10).json()["prefill_failures"] == 0
        if path == "nixl":  # the prefill server freed the offers when the decode side read them
            for _ in range(100):
                if _counter(p_url, "peer_released_blocks") >= 2 * LOADABLE:
                    break
                time.sleep(0.1)
            assert _counter(p_url, "peer_released_blocks") == 2 * LOADABLE
            assert _counter(p_url, "peer_hold_timeouts") == 0
        # Through vLLM's OpenAI server, a client's own kv_transfer_params reach the plugin:
        # a pin (not enabled here) and a forged P/D offer are ignored and counted, and the
        # request is served with the baseline's tokens.
        p = SETS[3][0]
        forged = {"kvtier_pin_ttl_s": 604800, "do_remote_prefill": True,
                  "kvtier_peer": {"ranks": {"0": {"agent": {"name": "rogue-r0", "metadata": "AAAA",
                                                             "regions": [[4096, 4096]]},
                                                   "planes": [], "stamps": 1}},
                                  "slots": list(range(10)), "keys": ["00" * 32] * 10}}
        r = requests.post(f"{d_url}/v1/completions", timeout=600, json={
            "model": str(tiny_model), "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "kv_transfer_params": forged})
        r.raise_for_status()
        assert r.json()["choices"][0]["token_ids"] == baseline_of(p)
        for _ in range(50):
            if _kvtier(d_url).get("request_params_ignored|cpu", 0) >= 1:
                break
            time.sleep(0.1)
        counters = _kvtier(d_url)
        assert counters.get("request_params_ignored|cpu", 0) == 1, counters
        # the forged offer: not read (nixl: not an allowed agent; mooncake: no nixl section)
        assert counters.get("request_params_ignored|peer", 0) == (1 if path == "nixl" else 0), counters
        assert counters.get("blocks_loaded|peer", 0) == (2 * LOADABLE if path == "nixl" else 0), counters
    finally:
        for proc in reversed(procs):
            _stop(proc)
