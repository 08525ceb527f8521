"""A small routing proxy for prefill/decode disaggregation: one OpenAI-compatible endpoint
in front of a prefill instance and a decode instance.

For each ``/v1/completions`` or ``/v1/chat/completions`` request it

1. sends the request to the **prefill** instance with ``max_tokens: 1`` (so it computes
   the prompt's KV and stops; ``stream`` off) and ``kv_transfer_params:
   {"do_remote_decode": true}``: the prefill side stores the KV (into the pool, or keeps it
   in its CPU tier for a NIXL pull) and answers with ``kv_transfer_params`` saying where;
2. sends the original request to the **decode** instance with those ``kv_transfer_params``
   (plus ``do_remote_prefill: true``), and returns its answer (streamed when asked).

If the prefill instance fails or times out, the request goes to the decode instance alone
(it recomputes the prompt): slower, never wrong, never stuck.

Trust: a client's own ``kv_transfer_params`` are never forwarded (vLLM's OpenAI server
would hand them to the plugin: pins, peer offers, pool hand-offs). The prefill call gets
``do_remote_decode`` only (plus the shared secret, below), the decode call the prefill
instance's answer only, or no ``kv_transfer_params`` at all when the prefill call failed
(docs/security.md). The prefill instance's answer (NIXL agent metadata, memory
registration keys) never goes back to the client: the client gets the decode answer.

Shared secret: with the environment variable ``KVTIER_PD_SECRET`` set (or
``--secret-file``), each prefill call carries a one-time token made with it,
``kv_transfer_params.kvtier_pd_auth`` (the time, a random nonce and their HMAC-SHA256 under
the secret); give the prefill instance the same secret (its ``nixl.remote_decode_secret_env``
or ``nixl.remote_decode_secret_file``) so that it answers ``do_remote_decode`` from this
proxy only. The secret itself is never sent: vLLM logs the request's parameters. This host's
clock and the prefill host's must agree within 10 minutes (NTP).

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Both instances run vLLM with the plugin: the prefill one with ``"kv_role": "kv_producer"``,
the decode one with ``"kv_role": "kv_consumer"`` (see ``configs/pd-disagg.yaml``).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import secrets
import time
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("pd_proxy")


def hand_off_token(secret: str, seconds: int | None = None, nonce: str | None = None) -> str:
    """A one-time ``kvtier_pd_auth`` token: ``v1.<unix seconds>.<nonce>.<HMAC-SHA256>``
    (the plugin's ``vllm_kvtier/plan/pd_auth.py`` checks it)."""
    seconds = int(time.time()) if seconds is None else seconds
    nonce = secrets.token_hex(16) if nonce is None else nonce
    msg = f"kvtier-pd-auth.v1.{seconds}.{nonce}".encode()
    return f"v1.{seconds}.{nonce}.{hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()}"


def build_app(prefill_url: str, decode_url: str, *, prefill_timeout_s: float = 300.0,
              decode_timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None,
              secret: str | None = None) -> FastAPI:
    """``transport``: httpx's, for both instances (tests pass an in-process one).
    ``secret``: the prefill instance's shared secret (each prefill call carries a token
    made with it, never the secret)."""
    hand_off: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    app = FastAPI(title="vllm_kvtier P/D proxy")
    prefill = httpx.AsyncClient(base_url=prefill_url, timeout=prefill_timeout_s, transport=transport)
    decode = httpx.AsyncClient(base_url=decode_url, timeout=decode_timeout_s, transport=transport)
    app.state.stats = {"requests": 0, "prefill_failures": 0, "client_kv_params_stripped": 0}

    async def run_prefill(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        params = dict(hand_off)
        if secret:
            params["kvtier_pd_auth"] = hand_off_token(secret)
        req = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
        req.pop("stream_options", None)
        req.pop("max_completion_tokens", None)
        try:
            r = await prefill.post(path, json=req)
            r.raise_for_status()
            params = r.json().get("kv_transfer_params")
            return params if isinstance(params, dict) else {}
        except (httpx.HTTPError, ValueError) as e:
            app.state.stats["prefill_failures"] += 1
            logger.warning("prefill failed (%s); the decode instance recomputes the prompt", e)
            return None

    async def route(path: str, request: Request) -> Response:
        body = await request.json()
        if not isinstance(body, dict):
            return JSONResponse({"error": "the request body must be a JSON object"}, status_code=400)
        # Never forward a client's kv_transfer_params (see the module doc).
        if body.pop("kv_transfer_params", None) is not None:
            app.state.stats["client_kv_params_stripped"] += 1
        app.state.stats["requests"] += 1
        params = await run_prefill(path, body)
        out = dict(body)
        if params is not None:
            out["kv_transfer_params"] = {**params, "do_remote_prefill": True, "do_remote_decode": False}
        if body.get("stream"):
            async def relay():
                async with decode.stream("POST", path, json=out) as r:
                    async for chunk in r.aiter_raw():
                        yield chunk

            return StreamingResponse(relay(), media_type="text/event-stream")
        r = await decode.post(path, json=out)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await route("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await decode.get("/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        ok = {}
        for name, client in (("prefill", prefill), ("decode", decode)):
            try:
                ok[name] = (await client.get("/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                ok[name] = False
        # Serving needs the decode instance; without prefill it degrades to recompute.
        return JSONResponse(ok, status_code=200 if ok["decode"] else 503)

    @app.get("/proxy_stats")
    async def proxy_stats() -> dict[str, int]:
        return dict(app.state.stats)

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="base URL of the prefill instance")
    ap.add_argument("--decode", required=True, help="base URL of the decode instance")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill-timeout-s", type=float, default=300.0)
    ap.add_argument("--secret-file", help="file holding the prefill instance's shared secret "
                                          "(default: the environment variable KVTIER_PD_SECRET)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    if args.secret_file:
        with open(args.secret_file, encoding="utf-8") as f:
            secret: str | None = f.read().strip()
    else:
        secret = os.environ.get("KVTIER_PD_SECRET", "").strip() or None
    uvicorn.run(build_app(args.prefill, args.decode, prefill_timeout_s=args.prefill_timeout_s, secret=secret),
                host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
