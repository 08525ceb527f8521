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


def test_the_proxy_proves_its_shared_secret_to_the_prefill_call_only():
    """With a secret (the prefill instance's ``nixl`` shared secret) the prefill call
    carries a one-time token made with it, never the secret; the decode call and the
    client's answer carry neither."""
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
    kv = p_body["kv_transfer_params"]
    assert set(kv) == {"do_remote_decode", "do_remote_prefill", "kvtier_pd_auth"} and kv["do_remote_decode"]
    assert secret not in json.dumps(p_body) and secret not in json.dumps(d_body)
    assert "kvtier_pd_auth" not in json.dumps(d_body)
    from vllm_kvtier.plan import pd_auth

    # the proxy's tokens are the plugin's (the proxy does not import the plugin)
    assert load_proxy().hand_off_token(secret, 1234, "ab" * 16) == pd_auth.token(secret.encode(), 1234, "ab" * 16)
    assert pd_auth.HandOffAuth(secret.encode()).refusal(kv, int(kv["kvtier_pd_auth"].split(".")[1])) is None


def prefill_body_from_the_proxy(secret: str) -> dict:
    """The JSON body the proxy sends to the prefill instance (in process, as served)."""
    seen: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        if request.url.host == "prefill":
            return httpx.Response(200, json={"kv_transfer_params": {}})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    app = load_proxy().build_app("http://prefill", "http://decode", transport=httpx.MockTransport(handle),
                                 secret=secret)
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}).status_code == 200
    return seen[0]


def test_vllm_s_request_log_never_holds_the_shared_secret():
    """vLLM's request logging (``--enable-log-requests``: the SamplingParams at INFO, the
    whole JSON body at DEBUG) of the proxy's prefill call, run for real: the secret is in
    neither line, and the token that is there is one the prefill side accepts once."""
    import logging

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.request_logger import RequestLogger

    secret = "proxy-secret-0123456789-abcdef"
    body = prefill_body_from_the_proxy(secret)
    request = CompletionRequest.model_validate(body)
    params = request.to_sampling_params(max_tokens=1)
    assert params.extra_args is not None and params.extra_args["kv_transfer_params"]["do_remote_decode"]
    records: list[str] = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("vllm.entrypoints.serve.utils.request_logger")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        logger = RequestLogger(max_log_len=None)
        logger.log_request_body(request)
        logger.log_inputs("cmpl-1", "hi", None, None, params, None)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    text = "\n".join(records)
    assert "Received request cmpl-1" in text and "JSON body" in text and "kv_transfer_params" in text
    assert secret not in text
    from vllm_kvtier.plan.pd_auth import HandOffAuth

    auth = HandOffAuth(secret.encode())
    kv = params.extra_args["kv_transfer_params"]
    assert auth.refusal(kv, __import__("time").time()) is None
    assert auth.refusal(kv, __import__("time").time()) == "kvtier_pd_auth already used"  # a copy from the log
