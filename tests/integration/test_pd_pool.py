"""Prefill/decode disaggregation through a real Mooncake Store pool on 127.0.0.1: a prefill
instance (``kv_producer``, its own process) puts each prompt's blocks into the pool; a
decode instance (``kv_consumer``) loads them instead of recomputing, with the tokens of a
single-instance baseline; when the prefill side's blocks never come, the decode side
recomputes within its deadline. Fault drills (slow): the master killed under both instances
(the decode side recomputes within its bounds and keeps serving), and restarted on the same
port (both instances' clients remount their segments; puts and loads work again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit import mooncake_server as mcsrv
from tests.conftest import BLOCK_SIZE, close_llm, kvtier_config, kvtier_counters, make_llm
from tests.integration import test_nvme_engine as nvme_engine
from tests.integration.test_nvme_engine import BLOCK_BYTES, SETS

pytestmark = pytest.mark.mooncake

ROOT = Path(__file__).resolve().parents[2]
LOADABLE = (330 - 1) // BLOCK_SIZE
#: What a P/D proxy passes the decode instance: the prefill instance put a 330-token
#: prompt's full blocks into the pool.
HANDOFF = {"do_remote_prefill": True, "kvtier_pool_blocks": 330 // BLOCK_SIZE}
mooncake_master = mcsrv.mooncake_master
baseline_of = nvme_engine.baseline_of


def pd_config(master: str, role: str, *, cpu_blocks: int = 64, **mooncake) -> dict:
    kv = kvtier_config({
        "cpu": {"capacity_bytes": cpu_blocks * BLOCK_BYTES},
        # Always load what is found: on this noisy machine the load-or-recompute estimate
        # sometimes prefers recomputing the tiny model's blocks, and then these tests could
        # not tell a load from a recompute they did not cause.
        "load_or_recompute": {"enabled": False},
        "mooncake": {"master": master, "local_hostname": "127.0.0.1", "global_segment_bytes": 64 * 2**20,
                     "transfer_buffer_bytes": 16 * 2**20, "deadline_s": 3.0, "accept_handoffs": True,
                     **mooncake},
    })
    kv["kv_role"] = role
    return kv


def decode(llm, prompt: list[int], params: dict, max_tokens: int = 8) -> tuple[list[int], dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = kvtier_counters(llm)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                        extra_args={"kv_transfer_params": params})
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0].outputs[0]
    after = kvtier_counters(llm)
    return list(out.token_ids), {k: after.get(k, 0) - before.get(k, 0) for k in after}


def start_prefill(model: Path, master: str, ps: list[list[int]], tmp: Path, **env: str) -> subprocess.Popen:
    """A prefill instance (``kv_producer``, its own process) that runs ``ps`` (after
    ``KVTIER_TEST_GO_FILE`` exists, if ``env`` names one), prints a PARTIAL line, and stays
    up, stepping, until :func:`stop_prefill`. Its stderr goes to ``tmp/prefill.err``: the
    Mooncake client logs there every second while the master is gone, and a pipe nobody
    reads would fill up and stall it."""
    pfile = tmp / "prompts.json"
    pfile.write_text(json.dumps(ps))
    full_env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                    KVTIER_TEST_HOLD_FILE=str(tmp / "prefill-may-exit"), **env)
    cmd = [sys.executable, "-m", "tests.engine_run", str(model), json.dumps(pd_config(master, "kv_producer")),
           str(pfile), "1"]
    with open(tmp / "prefill.err", "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=err, text=True)


def wait_prefilled(prefill: subprocess.Popen, tmp: Path, timeout_s: float = 300) -> None:
    """Until the prefill instance ran every prompt (its puts are then issued)."""
    deadline = time.monotonic() + timeout_s
    line = ""
    while not line.startswith("PARTIAL "):
        assert prefill.poll() is None, (tmp / "prefill.err").read_text()[-4000:]
        assert time.monotonic() < deadline, "the prefill instance did not finish"
        line = prefill.stdout.readline() if prefill.stdout else ""


def stop_prefill(prefill: subprocess.Popen, tmp: Path) -> float:
    """Let the prefill instance exit; the seconds it took (it is killed after 120 s)."""
    (tmp / "prefill-may-exit").touch()
    t = time.monotonic()
    try:
        prefill.wait(120)
    except subprocess.TimeoutExpired:
        prefill.kill()
        prefill.wait()
    return time.monotonic() - t


def test_decode_loads_what_prefill_put_in_the_pool(tiny_model, baseline_of, mooncake_master, tmp_path):
    ps = SETS[2]
    prefill = start_prefill(tiny_model, mooncake_master.address, ps, tmp_path)
    try:
        wait_prefilled(prefill, tmp_path)
        llm = make_llm(tiny_model, pd_config(mooncake_master.address, "kv_consumer"))
        try:
            got = [decode(llm, p, HANDOFF) for p in ps]
            # No handoff parameters and nothing in the pool: an ordinary request, recomputed.
            fresh = SETS[3][0]
            alone, alone_c = decode(llm, fresh, {})
        finally:
            close_llm(llm)
    finally:
        stop_prefill(prefill, tmp_path)
    for p, (tokens, c) in zip(ps, got, strict=True):
        assert tokens == baseline_of(p)
        assert c.get("blocks_loaded|mooncake", 0) == LOADABLE, c
        assert c.get("load_failures|mooncake", 0) == 0
    assert alone == baseline_of(fresh) and alone_c.get("blocks_loaded|mooncake", 0) == 0



def test_pool_handoff_objects_are_signed_and_verified(tiny_model, baseline_of, mooncake_master, tmp_path,
                                                      monkeypatch):
    """``auth``: the hand-off objects a prefill instance with the key puts into the pool are
    signed; a decode instance with the key loads them; one without it refuses every one
    (counted, ``unauthenticated``) and recomputes, with the baseline's tokens."""
    monkeypatch.setenv("KVTIER_AUTH_KEY", "a7" * 32)
    ps = SETS[2][:1]
    prefill = start_prefill(tiny_model, mooncake_master.address, ps, tmp_path)
    try:
        wait_prefilled(prefill, tmp_path)
        llm = make_llm(tiny_model, pd_config(mooncake_master.address, "kv_consumer"))
        try:
            signed = decode(llm, ps[0], HANDOFF)
        finally:
            close_llm(llm)
        monkeypatch.delenv("KVTIER_AUTH_KEY")
        llm = make_llm(tiny_model, pd_config(mooncake_master.address, "kv_consumer"))
        try:
            keyless = decode(llm, ps[0], HANDOFF)
        finally:
            close_llm(llm)
    finally:
        stop_prefill(prefill, tmp_path)
    tokens, c = signed
    assert tokens == baseline_of(ps[0])
    assert c.get("blocks_loaded|mooncake", 0) == LOADABLE and c.get("auth_failures|mooncake", 0) == 0, c
    tokens, c = keyless
    assert tokens == baseline_of(ps[0])
    assert c.get("blocks_loaded|mooncake", 0) == 0 and c.get("auth_failures|mooncake", 0) >= 1, c

def test_decode_recomputes_when_the_prefill_blocks_never_come(tiny_model, baseline_of, mooncake_master):
    """The proxy says the prefill instance stored the blocks, but the pool never gets them
    (prefill gone): the decode instance waits handoff_wait_s, then recomputes."""
    p = SETS[3][0]
    llm = make_llm(tiny_model, pd_config(mooncake_master.address, "kv_consumer", handoff_wait_s=1.0))
    try:
        t = time.monotonic()
        tokens, c = decode(llm, p, HANDOFF)
        waited = time.monotonic() - t
    finally:
        close_llm(llm)
    assert tokens == baseline_of(p)
    assert c.get("blocks_loaded|mooncake", 0) == 0 and c.get("handoff_timeouts|all", 0) == 1
    assert 1.0 <= waited < 30


#: Added to each request's bound from the config: a 330-token prefill of the tiny model
#: takes well under a second; the rest is room for a slow, shared machine. A hang is
#: unbounded, so it still fails.
SLACK_S = 10.0


def timed(llm, prompt: list[int], params: dict) -> tuple[list[int], dict, float]:
    t = time.monotonic()
    tokens, c = decode(llm, prompt, params)
    return tokens, c, time.monotonic() - t


@pytest.mark.slow
def test_decode_recomputes_and_keeps_serving_when_the_master_dies(tiny_model, baseline_of, tmp_path):
    """The master is killed after the prefill instance put its prompts and the decode
    instance loaded two of them. A prompt the decode side already located in the pool
    (its blocks since left the decode side's small DRAM tier) fails to load and is
    recomputed; prompts it never saw find nothing (lookups do not answer) and are
    recomputed after ``handoff_wait_s``; an ordinary request is served as usual. Every
    answer has the tokens of a single instance, each within its bound, and the engine
    shuts down in bounded time with the master still gone."""
    master = mcsrv.MooncakeMaster(tmp_path)
    master.start()
    seen, unseen, plain = SETS[2], SETS[1], SETS[3][0]
    wait_s = 2.0
    kv = pd_config(master.address, "kv_consumer", cpu_blocks=12, handoff_wait_s=wait_s)
    mc = kv["kv_connector_extra_config"]["mooncake"]
    prefill = start_prefill(tiny_model, master.address, seen + unseen, tmp_path)
    try:
        wait_prefilled(prefill, tmp_path)
        llm = make_llm(tiny_model, kv)
        try:
            loaded = [decode(llm, p, HANDOFF) for p in seen]
            master.kill()
            reread = timed(llm, seen[0], HANDOFF)
            fresh = [timed(llm, p, HANDOFF) for p in unseen]
            alone = timed(llm, plain, {})
        finally:
            t = time.monotonic()
            close_llm(llm)
            closed_s = time.monotonic() - t
    finally:
        exit_s = stop_prefill(prefill, tmp_path)
        master.stop()
    for p, (tokens, c) in zip(seen, loaded, strict=True):
        assert tokens == baseline_of(p) and c.get("blocks_loaded|mooncake", 0) == LOADABLE, c
    tokens, c, seconds = reread
    assert tokens == baseline_of(seen[0])
    assert c.get("blocks_loaded|mooncake", 0) == 0 and c.get("load_failures|mooncake", 0) > 0, c
    # The read fails within deadline_s; the rescheduled request then finds none of the
    # blocks (they cool down after a failed read) and does not wait for them again.
    assert c.get("handoff_timeouts|all", 0) == 0, c
    assert seconds < mc["deadline_s"] + SLACK_S
    for p, (tokens, c, seconds) in zip(unseen, fresh, strict=True):
        assert tokens == baseline_of(p)
        assert c.get("blocks_loaded|mooncake", 0) == 0 and c.get("handoff_timeouts|all", 0) == 1, c
        assert wait_s <= seconds < wait_s + SLACK_S  # each lookup gives up after lookup_timeout_s
    # With the master gone a client's first call fails at once (reads as absent); later
    # ones block ~4 s in the client, past lookup_timeout_s: counted once per call sent.
    assert sum(c.get("lookup_timeouts|mooncake", 0) for _, c, _ in fresh) > 0
    tokens, c, seconds = alone
    assert tokens == baseline_of(plain) and seconds < SLACK_S
    # Leaving a pool whose master is gone: each client's close is bounded (1 s for the
    # scheduler's lookup clients, 5 s for the worker's), the rest of vLLM's shutdown is quick.
    # (About 13 s here; the prefill process, whose exit also waits for its clients'
    # background teardown, about 40 s.)
    assert closed_s < 60
    assert exit_s < 120, "the prefill instance did not exit by itself with the master gone"


@pytest.mark.slow
def test_decode_loads_again_after_the_master_restarts(tiny_model, baseline_of, tmp_path):
    """Both instances have joined the pool (each client mounted its segment) when the
    master dies; a handoff meanwhile is recomputed. The master comes back, empty, on the
    same port: both clients remount their segments without a restart, the prefill instance
    puts new prompts, and the decode instance loads them."""
    master = mcsrv.MooncakeMaster(tmp_path)
    master.start()
    ps, warm, during = SETS[4][:2], SETS[4][5], SETS[3][0]
    wait_s = 2.0
    go = tmp_path / "prefill-may-start"
    # A warm-up request: the prefill instance has stepped before it is told to start.
    prefill = start_prefill(tiny_model, master.address, ps, tmp_path, KVTIER_TEST_GO_FILE=str(go),
                            KVTIER_TEST_WARMUP_TOKENS="40")
    try:
        llm = make_llm(tiny_model, pd_config(master.address, "kv_consumer", handoff_wait_s=wait_s))
        try:
            first = decode(llm, warm, {})
            assert master.wait_for_segments(2, 300), f"segments: {master.mounted_segments()}"
            master.kill()
            gone = timed(llm, during, HANDOFF)
            master.start()
            # Each client pings the master every second; one that the master does not
            # know (a restarted master) mounts its segment again.
            assert master.wait_for_segments(2, 30), f"segments after the restart: {master.mounted_segments()}"
            go.touch()
            wait_prefilled(prefill, tmp_path)
            got = [decode(llm, p, HANDOFF) for p in ps]
        finally:
            close_llm(llm)
    finally:
        stop_prefill(prefill, tmp_path)
        master.stop()
    assert first[0] == baseline_of(warm)
    tokens, c, seconds = gone
    assert tokens == baseline_of(during) and c.get("handoff_timeouts|all", 0) == 1, c
    assert c.get("blocks_loaded|mooncake", 0) == 0 and seconds < wait_s + SLACK_S
    for p, (tokens, c) in zip(ps, got, strict=True):
        assert tokens == baseline_of(p)
        assert c.get("blocks_loaded|mooncake", 0) == LOADABLE and c.get("load_failures|mooncake", 0) == 0, c
