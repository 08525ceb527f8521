"""Prefill/decode disaggregation peer to peer over NIXL (UCX on 127.0.0.1): a prefill
instance (its own process) offers its prompt blocks from its CPU tier through
``kv_transfer_params``; a decode instance reads them straight out of it, with the tokens of
a single-instance baseline; a stale or unreachable offer is recomputed."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import BLOCK_SIZE, close_llm, kvtier_config, kvtier_counters, make_llm
from tests.integration import test_nvme_engine as nvme_engine
from tests.integration.test_nvme_engine import BLOCK_BYTES, SETS

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None,
                       reason="NIXL is not installed (tools/setup-remote.sh installs it)"),
]

ROOT = Path(__file__).resolve().parents[2]
LOADABLE = (330 - 1) // BLOCK_SIZE
baseline_of = nvme_engine.baseline_of


@pytest.fixture(autouse=True)
def _ucx_env(monkeypatch):
    # No RDMA NIC here: keep UCX off its InfiniBand modules (see the NIXL probe notes).
    monkeypatch.setenv("UCX_MODULES", "^ib")


def pd_config(role: str, **nixl) -> dict:
    """The prefill instance names its agents ``prefill-...`` and answers ``do_remote_decode``
    (issue 31: off by default); the decode instance reads and trusts offers from those
    only (issue 13: by default it reads none)."""
    if role == "kv_producer":
        nixl = {"agent_name": "prefill", "accept_remote_decode": True, **nixl}
    else:
        nixl = {"agent_name": "decode", "allowed_peers": ["prefill-*"], "trusted_peers": ["prefill-*"], **nixl}
    kv = kvtier_config({"cpu": {"capacity_bytes": 64 * BLOCK_BYTES}, "nixl": {"deadline_s": 5.0, **nixl}})
    kv["kv_role"] = role
    return kv


def decode(llm, prompt: list[int], params: dict | None, max_tokens: int = 8) -> tuple[list[int], dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = kvtier_counters(llm)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                        extra_args={"kv_transfer_params": params} if params else None)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0].outputs[0]
    after = kvtier_counters(llm)
    return list(out.token_ids), {k: after.get(k, 0) - before.get(k, 0) for k in after}


def start_prefill(model: Path, ps: list[list[int]], tmp: Path, **nixl) -> tuple[subprocess.Popen, list[dict], Path]:
    hold = tmp / "prefill-may-exit"
    pfile = tmp / "prompts.json"
    pfile.write_text(json.dumps(ps))
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               KVTIER_TEST_HOLD_FILE=str(hold), KVTIER_TEST_KV_PARAMS=json.dumps({"do_remote_decode": True}),
               UCX_MODULES="^ib")
    cmd = [sys.executable, "-m", "tests.engine_run", str(model), json.dumps(pd_config("kv_producer", **nixl)),
           str(pfile), "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    params: list[dict] = []
    line = ""
    while not line.startswith("PARTIAL "):
        assert proc.poll() is None, proc.stderr.read()[-4000:] if proc.stderr else ""
        assert time.monotonic() < deadline, "the prefill instance did not finish"
        line = proc.stdout.readline() if proc.stdout else ""
        if line.startswith("PARAMS "):
            params = json.loads(line.removeprefix("PARAMS "))
    return proc, params, hold


def stop(proc: subprocess.Popen, hold: Path) -> dict:
    hold.touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))["counters"]


def test_decode_reads_the_prompt_from_the_prefill_instance(tiny_model, baseline_of, tmp_path):
    # The third hand-off repeats the first prompt: the decode instance has its blocks in
    # DRAM already, reads nothing and only tells the prefill instance to free the offer.
    ps = [*SETS[2], SETS[2][0]]
    prefill, params, hold = start_prefill(tiny_model, ps, tmp_path)
    try:
        assert len(params) == len(ps) and all("kvtier_peer" in p for p in params), params
        llm = make_llm(tiny_model, pd_config("kv_consumer"))
        try:
            got = [decode(llm, p, {**kp, "do_remote_prefill": True}) for p, kp in zip(ps, params, strict=True)]
        finally:
            close_llm(llm)
    finally:
        counters = stop(prefill, hold)
    for p, (tokens, c) in zip(ps, got, strict=True):
        assert tokens == baseline_of(p)
        assert c.get("load_failures|peer", 0) == 0
    assert [c.get("blocks_loaded|peer", 0) for _, c in got] == [LOADABLE, LOADABLE, 0]
    assert got[2][1].get("blocks_loaded|cpu", 0) == LOADABLE
    assert counters.get("peer_offered_blocks|peer", 0) == 3 * LOADABLE
    # every offer released by the decode side's notification, none left to time out
    assert counters.get("peer_released_blocks|peer", 0) == 3 * LOADABLE
    assert counters.get("peer_hold_timeouts|peer", 0) == 0


def test_an_untrusted_peer_serves_its_request_only_and_a_forged_offer_is_ignored(tiny_model, baseline_of, tmp_path):
    """Decode side with the prefill agents allowed but not trusted: each prompt is read from
    the peer with the baseline's tokens, but nothing of it is kept (the repeated prompt is
    read from the peer again, not from DRAM). An offer naming an agent that is not allowed
    (a client's forgery) is not read: counted, recomputed, same tokens."""
    ps = [*SETS[2], SETS[2][0]]
    prefill, params, hold = start_prefill(tiny_model, ps, tmp_path)
    try:
        llm = make_llm(tiny_model, pd_config("kv_consumer", trusted_peers=[]))
        try:
            got = [decode(llm, p, {**kp, "do_remote_prefill": True}) for p, kp in zip(ps, params, strict=True)]
            forged = json.loads(json.dumps(params[1]))
            for desc in forged["kvtier_peer"]["ranks"].values():
                desc["agent"]["name"] = "rogue-" + desc["agent"]["name"]
            forged_tokens, fc = decode(llm, ps[1], {**forged, "do_remote_prefill": True})
        finally:
            close_llm(llm)
    finally:
        counters = stop(prefill, hold)
    for p, (tokens, c) in zip(ps, got, strict=True):
        assert tokens == baseline_of(p)
        assert c.get("load_failures|peer", 0) == 0 and c.get("blocks_loaded|cpu", 0) == 0, c
        assert c.get("blocks_loaded|peer", 0) == LOADABLE and c.get("peer_unpromoted_blocks|peer", 0) == LOADABLE
        assert c.get("blocks_stored|cpu", 0) == 0, c  # nothing computed on top of them is stored
    assert counters.get("peer_released_blocks|peer", 0) == 3 * LOADABLE
    assert forged_tokens == baseline_of(ps[1])
    assert fc.get("blocks_loaded|peer", 0) == 0 and fc.get("request_params_ignored|peer", 0) == 1, fc


def test_offer_of_a_prefill_instance_that_is_gone_is_recomputed(tiny_model, baseline_of, tmp_path):
    ps = SETS[3]
    prefill, params, hold = start_prefill(tiny_model, ps, tmp_path)
    stop(prefill, hold)  # the prefill instance exits before the decode side reads
    llm = make_llm(tiny_model, pd_config("kv_consumer", deadline_s=3.0))
    try:
        t = time.monotonic()
        tokens, c = decode(llm, ps[0], {**params[0], "do_remote_prefill": True})
        waited = time.monotonic() - t
    finally:
        close_llm(llm)
    assert tokens == baseline_of(ps[0])
    assert c.get("blocks_loaded|peer", 0) == 0 and c.get("load_failures|peer", 0) == LOADABLE
    assert waited < 30


def test_unread_offers_are_reclaimed_after_hold_s(tiny_model, tmp_path):
    ps = SETS[3]
    prefill, params, hold = start_prefill(tiny_model, ps, tmp_path, hold_s=1.0)
    time.sleep(3.0)  # no decode instance comes
    counters = stop(prefill, hold)
    assert params and counters.get("peer_hold_timeouts|peer", 0) == 1


def test_offer_of_a_frozen_prefill_instance_costs_one_deadline(tiny_model, baseline_of, tmp_path, monkeypatch):
    """A transfer that never completes: the prefill process is stopped (SIGSTOP), so its
    UCX side never answers; the decode side aborts the read at nixl.deadline_s and
    recomputes."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # cross-memory attach would read a stopped process anyway
    ps = SETS[3]
    prefill, params, hold = start_prefill(tiny_model, ps, tmp_path)
    llm = None
    try:
        os.kill(prefill.pid, signal.SIGSTOP)
        # kill() returns before the process has stopped: wait until the kernel says so ("T")
        deadline = time.monotonic() + 10
        while Path(f"/proc/{prefill.pid}/stat").read_text().split(") ", 1)[1][0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        llm = make_llm(tiny_model, pd_config("kv_consumer", deadline_s=3.0))
        t = time.monotonic()
        tokens, c = decode(llm, ps[0], {**params[0], "do_remote_prefill": True})
        waited = time.monotonic() - t
        # still serving: a request without an offer right after
        tokens2, _ = decode(llm, SETS[2][0], None)
    finally:
        if llm is not None:
            close_llm(llm)
        os.kill(prefill.pid, signal.SIGCONT)
        stop(prefill, hold)
    assert tokens == baseline_of(ps[0]) and tokens2 == baseline_of(SETS[2][0])
    assert c.get("blocks_loaded|peer", 0) == 0 and c.get("load_failures|peer", 0) == LOADABLE
    assert waited < 30  # one 3 s deadline plus the recompute, never a hang
