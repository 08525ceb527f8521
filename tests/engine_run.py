"""Run the reuse scenario in a fresh process and print the results as JSON.

Used by the multiprocess test: ``python -m tests.engine_run MODEL KV_JSON``. A fresh
process guarantees vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` and spawns a real
EngineCore and Worker, as ``vllm serve`` does.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from tests.conftest import close_llm, kvtier_counters, make_llm, reuse_scenario, run_scenario

if __name__ == "__main__":
    model, kv = Path(sys.argv[1]), json.loads(sys.argv[2])
    llm = make_llm(model, kv or None)
    res = run_scenario(llm, reuse_scenario())
    counters = kvtier_counters(llm)
    close_llm(llm)
    print("RESULT " + json.dumps({"results": {k: asdict(v) for k, v in res.items()}, "counters": counters}))
