"""Run requests on a vLLM engine in a fresh process and print the results as JSON.

    python -m tests.engine_run MODEL KV_JSON              # the reuse scenario
    python -m tests.engine_run MODEL KV_JSON PROMPTS_JSON [MAX_TOKENS]  # these prompts, in order

With ``KVTIER_TEST_WARMUP_TOKENS=N``, one request of N fixed tokens runs first (a step
the engine has run: the plugin's workers have published what the first steps send). With
``KVTIER_TEST_READY_FILE`` set, the file is created once the engine is up; with
``KVTIER_TEST_GO_FILE``, the prompts wait until that file exists (another instance stores
first), then ``KVTIER_TEST_GO_DELAY_S`` more seconds; with ``KVTIER_TEST_HOLD_FILE``, the
engine stays up after the prompts (results already printed on a ``PARTIAL`` line) until
that file exists.

A fresh process guarantees vLLM reads the environment it was given (e.g.
``VLLM_ENABLE_V1_MULTIPROCESSING=1``) and that nothing survives from an earlier engine but
what the plugin stored on disk.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tests.conftest import close_llm, generate, kvtier_counters, make_llm, reuse_scenario, run_scenario


def _offers_open(c: dict[str, float]) -> bool:
    """P/D prefill over NIXL: offered blocks neither released by a read nor timed out."""
    return c.get("peer_offered_blocks|peer", 0) > c.get("peer_released_blocks|peer", 0) + \
        c.get("peer_hold_timeouts|peer", 0)


if __name__ == "__main__":
    model, kv = Path(sys.argv[1]), json.loads(sys.argv[2])
    llm = make_llm(model, kv or None)
    if os.environ.get("KVTIER_TEST_WARMUP_TOKENS"):
        generate(llm, [3 + i % 997 for i in range(int(os.environ["KVTIER_TEST_WARMUP_TOKENS"]))], 1)
    if os.environ.get("KVTIER_TEST_READY_FILE"):
        Path(os.environ["KVTIER_TEST_READY_FILE"]).touch()
    if os.environ.get("KVTIER_TEST_GO_FILE"):
        go, deadline = Path(os.environ["KVTIER_TEST_GO_FILE"]), time.monotonic() + 600
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(float(os.environ.get("KVTIER_TEST_GO_DELAY_S", "0")))
    if len(sys.argv) > 3:
        prompts = json.loads(Path(sys.argv[3]).read_text())
        max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 8
        if os.environ.get("KVTIER_TEST_KV_PARAMS"):  # P/D prefill: hand-off params in, theirs out
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                extra_args={"kv_transfer_params": json.loads(os.environ["KVTIER_TEST_KV_PARAMS"])})
            generate(llm, prompts[0], 1)  # first step: the workers publish their NIXL addresses
            outs = [llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0] for p in prompts]
            print("PARAMS " + json.dumps([o.kv_transfer_params for o in outs]), flush=True)
        res = {str(i): generate(llm, p, max_tokens) for i, p in enumerate(prompts)}
        print("PARTIAL " + json.dumps({k: asdict(v) for k, v in res.items()}), flush=True)
        if os.environ.get("KVTIER_TEST_HOLD_FILE"):  # stay up until told (P/D tests), stepping
            hold, until = Path(os.environ["KVTIER_TEST_HOLD_FILE"]), time.monotonic() + 600
            while not hold.exists() and time.monotonic() < until:
                llm.llm_engine.step()  # idle steps: hand-off notifications and expiries
                time.sleep(0.02)
            until = time.monotonic() + 10  # a notification sent just before: see it land
            while time.monotonic() < until and _offers_open(kvtier_counters(llm)):
                llm.llm_engine.step()
                time.sleep(0.02)
    else:
        res = run_scenario(llm, reuse_scenario())
    counters = kvtier_counters(llm)
    close_llm(llm)
    print("RESULT " + json.dumps({"results": {k: asdict(v) for k, v in res.items()}, "counters": counters}))
