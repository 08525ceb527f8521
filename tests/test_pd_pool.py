"""Prefill/decode disaggregation through a real Mooncake Store pool on 127.0.0.1: a prefill
instance (``kv_producer``, its own process) puts each prompt's blocks into the pool; a
decode instance (``kv_consumer``) loads them instead of recomputing, with the tokens of a
single-instance baseline; and when the prefill side's blocks never come, the decode side
recomputes within its deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import mooncake_server as mcsrv
from tests import test_nvme_engine as nvme_engine
from tests.conftest import BLOCK_SIZE, close_llm, kvtier_config, kvtier_counters, make_llm
from tests.test_nvme_engine import BLOCK_BYTES, SETS

pytestmark = pytest.mark.mooncake

ROOT = Path(__file__).resolve().parent.parent
LOADABLE = (330 - 1) // BLOCK_SIZE
mooncake_master = mcsrv.mooncake_master
baseline_of = nvme_engine.baseline_of


def pd_config(master: str, role: str, **mooncake) -> dict:
    kv = kvtier_config({
        "cpu": {"capacity_bytes": 64 * BLOCK_BYTES},
        "mooncake": {"master": master, "local_hostname": "127.0.0.1", "global_segment_bytes": 64 * 2**20,
                     "transfer_buffer_bytes": 16 * 2**20, "deadline_s": 3.0, **mooncake},
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


def test_decode_loads_what_prefill_put_in_the_pool(tiny_model, baseline_of, mooncake_master, tmp_path):
    ps = SETS[2]
    hold = tmp_path / "prefill-may-exit"
    pfile = tmp_path / "prompts.json"
    pfile.write_text(json.dumps(ps))
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               KVTIER_TEST_HOLD_FILE=str(hold))
    cmd = [sys.executable, "-m", "tests.engine_run", str(tiny_model),
           json.dumps(pd_config(mooncake_master.address, "kv_producer")), str(pfile), "1"]
    prefill = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        line = ""
        while not line.startswith("PARTIAL "):  # the prefill instance ran every prompt
            assert prefill.poll() is None, prefill.stderr.read()[-4000:] if prefill.stderr else ""
            assert time.monotonic() < deadline, "the prefill instance did not finish"
            line = prefill.stdout.readline() if prefill.stdout else ""
        llm = make_llm(tiny_model, pd_config(mooncake_master.address, "kv_consumer"))
        try:
            got = [decode(llm, p, {"do_remote_prefill": True, "kvtier_pool_blocks": 330 // BLOCK_SIZE})
                   for p in ps]
            # No handoff parameters and nothing in the pool: an ordinary request, recomputed.
            fresh = SETS[3][0]
            alone, alone_c = decode(llm, fresh, {})
        finally:
            close_llm(llm)
    finally:
        hold.touch()
        try:
            prefill.wait(120)
        except subprocess.TimeoutExpired:
            prefill.kill()
    for p, (tokens, c) in zip(ps, got, strict=True):
        assert tokens == baseline_of(p)
        assert c.get("blocks_loaded|mooncake", 0) == LOADABLE, c
        assert c.get("load_failures|mooncake", 0) == 0
    assert alone == baseline_of(fresh) and alone_c.get("blocks_loaded|mooncake", 0) == 0


def test_decode_recomputes_when_the_prefill_blocks_never_come(tiny_model, baseline_of, mooncake_master):
    """The proxy says the prefill instance stored the blocks, but the pool never gets them
    (prefill gone): the decode instance waits handoff_wait_s, then recomputes."""
    p = SETS[3][0]
    llm = make_llm(tiny_model, pd_config(mooncake_master.address, "kv_consumer", handoff_wait_s=1.0))
    try:
        t = time.monotonic()
        tokens, c = decode(llm, p, {"do_remote_prefill": True, "kvtier_pool_blocks": 330 // BLOCK_SIZE})
        waited = time.monotonic() - t
    finally:
        close_llm(llm)
    assert tokens == baseline_of(p)
    assert c.get("blocks_loaded|mooncake", 0) == 0 and c.get("handoff_timeouts|all", 0) == 1
    assert 1.0 <= waited < 30
