"""examples/pd_proxy.py never forwards a client's ``kv_transfer_params`` (issue 13): the
prefill call carries ``do_remote_decode`` only, the decode call the prefill instance's
answer only, and nothing of the client's when the prefill call fails. The proxy app runs
in process; both instances are an httpx transport that records what reaches them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[2]
CLIENT_PARAMS = {"kvtier_pin_ttl_s": 604800, "do_remote_prefill": True,
                 "kvtier_peer": {"ranks": {"0": {"agent": {"name": "attacker"}}}, "slots": [0], "keys": ["00"]}}


def load_proxy():
    spec = importlib.util.spec_from_file_location("pd_proxy", ROOT / "examples" / "pd_proxy.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(prefill_ok: bool) -> list[tuple[str, dict]]:
    seen: list[tuple[str, dict]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host == "prefill":
            if not prefill_ok:
                return httpx.Response(500, json={"error": "down"})
            return httpx.Response(200, json={"kv_transfer_params": {"kvtier_pool_blocks": 3}})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    app = load_proxy().build_app("http://prefill", "http://decode", transport=httpx.MockTransport(handle))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4,
                                                 "kv_transfer_params": CLIENT_PARAMS})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
        assert client.get("/proxy_stats").json()["client_kv_params_stripped"] == 1
    return seen


def test_the_client_s_params_reach_neither_instance():
    (p_host, p_body), (d_host, d_body) = run(prefill_ok=True)
    assert (p_host, d_host) == ("prefill", "decode")
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert d_body["kv_transfer_params"] == {"kvtier_pool_blocks": 3, "do_remote_prefill": True,
                                            "do_remote_decode": False}
    assert d_body["max_tokens"] == 4 and d_body["prompt"] == "hi"


def test_a_failed_prefill_does_not_forward_the_client_s_params():
    (_, _), (d_host, d_body) = run(prefill_ok=False)
    assert d_host == "decode" and "kv_transfer_params" not in d_body


def test_the_proxy_adds_its_shared_secret_to_the_prefill_call_only():
    """With a secret (the prefill instance's ``nixl`` shared secret) the prefill call
    carries it; the decode call and the client's answer never do."""
    seen: list[tuple[str, dict]] = []
    secret = "proxy-secret-0123456789"

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host == "prefill":
            return httpx.Response(200, json={"kv_transfer_params": {"kvtier_peer": {"slots": [1]}}})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    app = load_proxy().build_app("http://prefill", "http://decode", transport=httpx.MockTransport(handle),
                                 secret=secret)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200 and secret not in r.text and "kvtier_peer" not in r.text
    (_, p_body), (_, d_body) = seen
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                            "kvtier_pd_secret": secret}
    assert secret not in json.dumps(d_body)
