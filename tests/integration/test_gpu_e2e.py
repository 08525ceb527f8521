"""On a CUDA device: the copy engine and a real vLLM engine (CUDA build of ``vllm``).

Skipped where ``torch.cuda.is_available()`` is False (set ``KVTIER_REQUIRE_GPU=1`` to make
that a failure instead, as ``bench/gpu_check.sh`` does, so a GPU check cannot pass by
skipping).

1. ``CudaCopyEngine``: random KV tensors on the GPU in the FlashAttention layout and in
   the CPU-attention layout; blocks are saved to a pinned pool, the KV cache is then
   overwritten, the slots are loaded into other block ids, and the bytes must equal.
2. End to end: ``vllm.LLM`` on CUDA with and without the plugin, three prompts sharing a
   300-token prefix sent one after the other; greedy tokens must be equal and the plugin's
   ``vllm:kvtier_blocks_loaded{tier="cpu"}`` counter must be > 0. Each engine runs in a
   fresh process (``python -m tests.integration.test_gpu_e2e MODEL KV_JSON``) so GPU memory and
   vLLM's global state never leak from one engine to the next.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA and os.environ.get("KVTIER_REQUIRE_GPU") == "1":
    raise RuntimeError("KVTIER_REQUIRE_GPU=1 but torch.cuda.is_available() is False "
                       f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA device: torch.cuda.is_available() "
                       f"is False (torch {torch.__version__})"),
]

KV = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "vllm_kvtier.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"cpu": {"capacity_bytes": 268435456}},
}
BLOCK_SIZE = 16
PREFIX_TOKENS = 300
ENGINE_TIMEOUT_S = 300


# ---- 1. copy engine ------------------------------------------------------------------


def _kv_tensors(layout: str, num_blocks: int, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], int]:
    layers, heads, block, head = 4, 8, BLOCK_SIZE, 128
    if layout == "flash":
        shape, bdim = (2, num_blocks, block, heads, head), 1
    else:
        shape, bdim = (num_blocks, heads, block, 2 * head), 0
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    kv = {}
    for i in range(layers):
        t = torch.empty(shape, dtype=dtype, device="cuda")
        t.view(torch.uint8).random_(0, 256, generator=g)
        kv[f"model.layers.{i}.self_attn.attn"] = t
    return kv, bdim


@pytest.mark.parametrize("ids", ["consecutive", "scattered"])
@pytest.mark.parametrize("layout", ["flash", "cpu"])
def test_cuda_copy_engine_roundtrip(layout: str, ids: str) -> None:
    from vllm_kvtier.tiers.cpu import CPUPool
    from vllm_kvtier.transfer.copier import CudaCopyEngine, make_copy_engine
    from vllm_kvtier.transfer.layout import build_layout

    num_blocks, n = 97, 24
    kv, bdim = _kv_tensors(layout, num_blocks, torch.float16)
    lay = build_layout(kv, num_blocks)
    assert lay.device.type == "cuda"
    pool = CPUPool(n + 5, lay.plane_bytes, pin=True, prefault=False)
    assert pool.planes[0].is_pinned()
    engine = make_copy_engine(lay, pool)
    assert isinstance(engine, CudaCopyEngine)

    rng = random.Random(1)
    if ids == "consecutive":
        src, dst, slots = list(range(3, 3 + n)), list(range(50, 50 + n)), list(range(2, 2 + n))
    else:
        src = rng.sample(range(0, 48), n)
        dst = rng.sample(range(48, num_blocks), n)
        slots = rng.sample(range(pool.num_slots), n)

    lead = (slice(None),) * bdim
    at_src = (*lead, torch.tensor(src, device="cuda"))
    at_dst = (*lead, torch.tensor(dst, device="cuda"))
    saved = {k: t.view(torch.uint8)[at_src].clone() for k, t in kv.items()}

    t_save = engine.submit("save", src, slots, background=False)
    t_save.wait()
    assert t_save.done()
    assert t_save.nbytes == lay.block_bytes * n

    # Overwrite every byte on the compute stream; the load is queued after it (the copy
    # stream waits for the compute stream), so it must still bring back the saved bytes.
    for t in kv.values():
        t.view(torch.uint8).add_(1)
    expected = {}
    for k, t in kv.items():
        e = t.view(torch.uint8).clone()
        e[at_dst] = saved[k]
        expected[k] = e

    t_load = engine.submit("load", dst, slots, background=True)
    engine.order_before_compute(t_load)  # the compute stream waits for the load
    snapshot = {k: t.view(torch.uint8).clone() for k, t in kv.items()}  # on the compute stream
    torch.cuda.synchronize()
    assert t_load.done()
    for k in kv:
        assert torch.equal(snapshot[k], expected[k]), f"{layout}/{ids}: layer {k} differs after save+load"
        assert torch.equal(kv[k].view(torch.uint8), expected[k])
    engine.shutdown()


# ---- 2. end to end on vLLM -----------------------------------------------------------


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, 1000) for _ in range(PREFIX_TOKENS)]
    return [prefix + [rng.randrange(3, 1000) for _ in range(k)] for k in (20, 37, 51)]


def _run_engine(model: str, kv: dict[str, Any] | None) -> dict[str, Any]:
    """One vLLM engine on CUDA; returns the greedy tokens and the kvtier counters."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=1024,
              enforce_eager=True, enable_prefix_caching=False, gpu_memory_utilization=0.3,
              block_size=BLOCK_SIZE, kv_transfer_config=kv, disable_log_stats=False, seed=0)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    tokens = []
    for p in _prompts():  # one after the other: later prompts can hit the earlier saves
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
    counters: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvtier_") and hasattr(m, "value"):
            key = f"{m.name}{{tier={m.labels.get('tier', '')}}}"
            counters[key] = counters.get(key, 0) + float(m.value)
    return {"tokens": tokens, "counters": counters, "vllm": vllm.__version__}


def _engine_in_subprocess(model: Path, kv: dict[str, Any] | None) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: faster start
    env.setdefault("HF_HUB_OFFLINE", "1")  # local model; never wait on the network
    cmd = [sys.executable, "-m", "tests.integration.test_gpu_e2e", str(model), json.dumps(kv)]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        err = e.stderr or ""
        tail = (err.decode(errors="replace") if isinstance(err, bytes) else err)[-6000:]
        pytest.fail(f"engine (kv={'on' if kv else 'off'}) did not finish in {ENGINE_TIMEOUT_S} s:\n{tail}")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        pytest.fail(f"engine (kv={'on' if kv else 'off'}) failed, rc={p.returncode}\n"
                    f"--- stdout tail ---\n{p.stdout[-3000:]}\n--- stderr tail ---\n{p.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_vllm_engine_end_to_end(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    from testkit.tinymodel import build_model

    model = build_model(tmp_path / "tiny", "tiny", dtype="float16")
    base = _engine_in_subprocess(model, None)
    got = _engine_in_subprocess(model, KV)
    print(f"\nvllm {got['vllm']}: tokens {got['tokens']}\nkvtier counters: {got['counters']}")

    assert got["tokens"] == base["tokens"], (
        f"greedy tokens differ with the plugin:\n without {base['tokens']}\n with    {got['tokens']}")
    loaded = got["counters"].get("vllm:kvtier_blocks_loaded{tier=cpu}", 0)
    assert loaded > 0, f"no block was loaded from the CPU tier; counters: {got['counters']}"
    # Prompts 2 and 3 each share PREFIX_TOKENS // BLOCK_SIZE full blocks with prompt 1.
    stored = got["counters"].get("vllm:kvtier_blocks_stored{tier=cpu}", 0)
    assert stored >= PREFIX_TOKENS // BLOCK_SIZE, got["counters"]
    assert got["counters"].get("vllm:kvtier_load_failures{tier=cpu}", 0) == 0, got["counters"]


if __name__ == "__main__":
    # Runner for test_vllm_engine_end_to_end: python -m tests.integration.test_gpu_e2e MODEL KV_JSON
    result = _run_engine(sys.argv[1], json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # skip vLLM's teardown at interpreter exit; the process is done
