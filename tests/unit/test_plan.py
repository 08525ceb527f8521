"""``kvtier plan``: the brief's figures and hand-computed ones, from real config.json files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kvtier.cli import main
from vllm_kvtier.ops.capacity import PlanInput, kv_bytes_per_token, make_plan, request_kv
from vllm_kvtier.ops.model_shape import KVModel, read_model_config
from vllm_kvtier.ops.units import PlanInputError, parse_size, parse_tokens

GiB = 2**30
K128 = 131072

LLAMA3_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8}
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8}
# StarCoder-like MQA: one KV head shared by 48 query heads, head_dim 6144 / 48 = 128.
MQA = {"model_type": "gpt_bigcode_like", "hidden_size": 6144, "num_attention_heads": 48,
       "num_hidden_layers": 40, "num_key_value_heads": 1}
# DeepSeek-V3: the per-head fields are there but MLA caches only the latent (512 + 64).
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61,
               "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128}
MISTRAL_SW = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
              "sliding_window": 4096}
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584,
          "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "head_dim": 256,
          "sliding_window": 4096,
          "layer_types": ["sliding_attention", "full_attention"] * 21}


def write_config(tmp_path: Path, cfg: dict, name: str = "model") -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d / "config.json")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_llama3_70b_reproduces_the_brief(tmp_path, capsys):
    m = read_model_config(write_config(tmp_path, LLAMA3_70B))
    assert (m.attention, m.num_layers, m.values_per_token_layer) == ("GQA", 80, 2 * 8 * 128)
    assert kv_bytes_per_token(m, "bf16") == 327_680
    assert request_kv(m, "bf16", K128).model_bytes == 42_949_672_960 == 40 * GiB
    assert kv_bytes_per_token(m, "fp8") == 163_840
    assert request_kv(m, "fp8", K128).stored_bytes == 20 * GiB

    rc, out, _ = run(capsys, "plan", "--model-config", str(tmp_path / "model"), "--context-tokens", "128K")
    assert rc == 0
    assert "KV per token           327,680 B = 327.68 kB = 320.00 KiB" in out
    assert "KV per request         42,949,672,960 B = 42.95 GB = 40.00 GiB" in out
    assert "GB = 10^9 bytes, GiB = 2^30 bytes" in out


def test_llama3_8b_reproduces_the_brief_and_the_40gb_gpu(tmp_path, capsys):
    m = read_model_config(write_config(tmp_path, LLAMA3_8B))
    assert kv_bytes_per_token(m, "bf16") == 131_072
    assert request_kv(m, "bf16", K128).model_bytes == 16 * GiB
    assert request_kv(m, "fp8", K128).model_bytes == 8 * GiB
    # The brief: a 40 GB GPU with 16 GB of weights has no room beyond one 128K request.
    plan = make_plan(PlanInput(m, "bf16", K128, concurrency=2, gpu_kv_bytes=int(40e9 * 0.9) - 16 * 10**9))
    assert plan.tiers[0].requests_fit == 1


def test_two_70b_requests_exceed_an_h100(tmp_path, capsys):
    path = write_config(tmp_path, LLAMA3_70B)
    rc, out, _ = run(capsys, "plan", "--model-config", path, "--context-tokens", "131072", "--concurrency", "2",
                     "--gpu-kv-bytes", "80GB")
    assert rc == 0
    assert "KV for 2 requests      85,899,345,920 B = 85.90 GB = 80.00 GiB" in out
    assert "GPU: 1 of the 2 requests fit at once" in out


def test_explicit_dims_match_the_config(capsys):
    rc, out, _ = run(capsys, "plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128",
                     "--kv-dtype", "fp8", "--context-tokens", "128K", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["bytes_per_token"] == 163_840
    assert data["request"]["model_bytes"] == 20 * GiB


def test_mqa_one_kv_head(tmp_path):
    m = read_model_config(write_config(tmp_path, MQA))
    assert m.attention == "MQA"
    assert kv_bytes_per_token(m, "bf16") == 2 * 40 * 1 * 128 * 2 == 20_480
    # Falcon style: multi_query instead of num_key_value_heads, head_dim from 4544 / 71 = 64.
    falcon = {"model_type": "falcon", "hidden_size": 4544, "n_head": 71, "n_layer": 32, "multi_query": True}
    f = read_model_config(write_config(tmp_path, falcon, "falcon"))
    assert (f.attention, kv_bytes_per_token(f, "bf16")) == ("MQA", 2 * 32 * 64 * 2)


def test_mha_without_kv_heads_field(tmp_path):
    cfg = {k: v for k, v in LLAMA3_8B.items() if k != "num_key_value_heads"}
    m = read_model_config(write_config(tmp_path, cfg))
    assert m.attention == "MHA"
    assert kv_bytes_per_token(m, "fp16") == 2 * 32 * 32 * 128 * 2 == 524_288


def test_mla_deepseek_v3_caches_the_latent_only(tmp_path):
    m = read_model_config(write_config(tmp_path, DEEPSEEK_V3))
    assert m.attention == "MLA"
    assert kv_bytes_per_token(m, "bf16") == 61 * (512 + 64) * 2 == 70_272
    assert kv_bytes_per_token(m, "fp8") == 35_136
    assert request_kv(m, "bf16", K128).model_bytes == 70_272 * K128 == 9_210_691_584
    assert any("store it once" in n and "once per TP rank" in n for n in m.notes)  # what the tiers do with TP


def test_mistral_uniform_sliding_window(tmp_path):
    m = read_model_config(write_config(tmp_path, MISTRAL_SW))
    assert (m.window_tokens, m.windowed_layers) == (4096, 32)
    assert kv_bytes_per_token(m, "bf16") == 131_072
    r = request_kv(m, "bf16", 32768)
    assert r.model_bytes == r.gpu_bytes == 131_072 * 4096 == 512 * 2**20
    assert r.stored_bytes == 131_072 * 32768
    short = request_kv(m, "bf16", 1000)
    assert short.model_bytes == short.stored_bytes == 131_072_000


def test_gemma2_mixed_layers(tmp_path, capsys):
    m = read_model_config(write_config(tmp_path, GEMMA2))
    assert (m.num_layers, m.windowed_layers, m.window_tokens) == (42, 21, 4096)
    per_layer = 2 * 8 * 256 * 2
    r = request_kv(m, "bf16", 8192)
    assert r.model_bytes == per_layer * (21 * 8192 + 21 * 4096) == 2_113_929_216
    # The plugin keeps vLLM's hybrid KV cache manager on: sliding layers hold their window.
    assert r.gpu_bytes == r.model_bytes
    assert r.stored_bytes == 42 * per_layer * 8192 == 2_818_572_288  # an upper bound
    # Same model without layer_types: Gemma-2 alternates, sliding first.
    legacy = {k: v for k, v in GEMMA2.items() if k != "layer_types"}
    assert request_kv(read_model_config(write_config(tmp_path, legacy, "legacy")), "bf16", 8192) == r
    rc, out, _ = run(capsys, "plan", "--model-config", str(tmp_path / "model"), "--context-tokens", "8192")
    assert rc == 0
    assert "as vLLM allocates it" not in out
    assert "KV per request         2,113,929,216 B" in out
    assert "a tier stores <=     2,818,572,288 B" in out
    assert "disables" not in out


def test_plan_sizes_hybrid_models_as_the_connector_runs_them():
    """The planner's GPU figure for a model mixing sliding and full layers assumes vLLM's
    hybrid KV cache manager stays on: true only while the connector supports it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    from vllm_kvtier.connector import KVTierConnector

    assert issubclass(KVTierConnector, SupportsHMA)
    m = KVModel(name="m", attention="GQA", shape="s", num_layers=4, values_per_token_layer=16,
                window_tokens=64, windowed_layers=2)
    r = request_kv(m, "bf16", 1024)
    assert r.gpu_bytes == r.model_bytes == 16 * 2 * (2 * 1024 + 2 * 64)


def test_sliding_window_pattern_and_qwen_switch(tmp_path):
    gemma3 = {"model_type": "gemma3_text", "num_hidden_layers": 12, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 1024, "sliding_window_pattern": 6}
    m = read_model_config(write_config(tmp_path, gemma3))
    assert m.windowed_layers == 10  # layers 5 and 11 are full attention
    assert request_kv(m, "bf16", 8192).model_bytes == 4096 * (2 * 8192 + 10 * 1024) == 109_051_904
    qwen = {**LLAMA3_8B, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    q = read_model_config(write_config(tmp_path, qwen, "qwen"))
    assert q.windowed_layers == 0
    assert request_kv(q, "bf16", 8192).model_bytes == 131_072 * 8192


def test_multimodal_text_config(tmp_path):
    m = read_model_config(write_config(tmp_path, {"model_type": "llava", "text_config": LLAMA3_8B}))
    assert kv_bytes_per_token(m, "bf16") == 131_072


def test_tiers_cpu_budget_and_load_times(tmp_path, capsys):
    path = write_config(tmp_path, LLAMA3_70B)
    rc, out, _ = run(capsys, "plan", "--model-config", path, "--context-tokens", "128K", "--json",
                     "--dram-bytes", "512GiB", "--dram-reserved-bytes", "64GiB", "--nvme-bytes", "1TB",
                     "--pcie-gb-per-s", "5", "--nvme-gb-per-s", "7", "--prefill-tokens-per-s", "4096")
    assert rc == 0
    data = json.loads(out)
    budget = data["cpu_budget"]
    assert budget["available_bytes"] == 448 * GiB
    assert budget["capacity_bytes"] == 224 * GiB
    assert (budget["low_bytes"], budget["high_bytes"]) == (224 * GiB, int(448 * GiB * 0.7))
    tiers = {t["tier"]: t for t in data["tiers"]}
    assert tiers["cpu"]["requests_fit"] == 5  # 224 GiB / 40 GiB
    assert tiers["nvme"]["requests_fit"] == 10**12 // (40 * GiB) == 23
    assert tiers["cpu"]["load_s"] == pytest.approx(40 * GiB / 5e9)
    # NVMe is faster than this PCIe link, so PCIe bounds the load.
    assert tiers["nvme"]["load_s"] == pytest.approx(40 * GiB / 5e9)
    assert tiers["s3"]["load_s"] == pytest.approx(40 * GiB / 1.25e9)
    assert tiers["s3"]["unbounded"] is True
    assert data["recompute_s"] == pytest.approx(32.0)


def test_plan_through_a_subprocess(tmp_path):
    path = write_config(tmp_path, LLAMA3_8B)
    res = subprocess.run([sys.executable, "-m", "vllm_kvtier.cli", "plan", "--model-config", path,
                          "--context-tokens", "128K", "--kv-dtype", "fp8"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "KV per token           65,536 B" in res.stdout
    assert "8,589,934,592 B = 8.59 GB = 8.00 GiB" in res.stdout


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        ({k: v for k, v in LLAMA3_8B.items() if k != "num_hidden_layers"}, "num_hidden_layers"),
        ({**LLAMA3_8B, "num_key_value_heads": 0}, "num_key_value_heads"),
        ({**LLAMA3_8B, "hidden_size": 4000, "num_attention_heads": 48}, "head_dim"),
        ({k: v for k, v in DEEPSEEK_V3.items() if k != "qk_rope_head_dim"}, "qk_rope_head_dim"),
        ({**LLAMA3_8B, "attention_chunk_size": 8192}, "attention_chunk_size"),
        ({**LLAMA3_8B, "layer_types": ["full_attention", "linear_attention"] * 16}, "layer_types[1]"),
        ({**LLAMA3_8B, "layer_types": ["sliding_attention"] * 32}, "sliding_window"),
    ],
)
def test_bad_config_names_the_field(tmp_path, capsys, cfg, field):
    path = write_config(tmp_path, cfg)
    rc, _, err = run(capsys, "plan", "--model-config", path, "--context-tokens", "1024")
    assert rc == 2
    assert f"'{field}'" in err


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--context-tokens", "-5"], "--context-tokens"),
        (["--dram-bytes", "80G"], "a bare G is ambiguous"),
        (["--gpu-util", "1.5"], "--gpu-util"),
        (["--kv-dtype", "int4"], "--kv-dtype"),
        (["--prefill-tokens-per-s", "0"], "--prefill-tokens-per-s"),
        (["--nvme-bytes", "0"], "--nvme-bytes"),
        (["--gpu-memory-bytes", "10GB", "--weights-bytes", "20GB"], "--weights-bytes"),
        (["--dram-bytes", "64GB", "--dram-reserved-bytes", "64GB"], "--dram-reserved-bytes"),
    ],
)
def test_bad_options_name_the_option(capsys, args, named):
    base = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--context-tokens", "1024"]
    rc, _, err = run(capsys, *base, *args)
    assert rc == 2
    assert named in err


def test_missing_inputs(tmp_path, capsys):
    rc, _, err = run(capsys, "plan", "--model-config", str(tmp_path / "nope.json"), "--context-tokens", "8")
    assert rc == 2 and "nope.json" in err
    rc, _, err = run(capsys, "plan", "--layers", "32", "--kv-heads", "8", "--context-tokens", "8")
    assert rc == 2 and "--head-dim" in err
    rc, _, err = run(capsys, "plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128")
    assert rc == 2 and "--context-tokens" in err
    (tmp_path / "bad.json").write_text("{not json")
    rc, _, err = run(capsys, "plan", "--model-config", str(tmp_path / "bad.json"), "--context-tokens", "8")
    assert rc == 2 and "not valid JSON" in err


def test_units():
    assert parse_size("80GB", "x") == 80 * 10**9
    assert parse_size("40GiB", "x") == 40 * GiB
    assert parse_size("1.5 TB", "x") == 1_500_000_000_000
    assert parse_size("4096", "x") == 4096
    assert parse_tokens("128K", "x") == K128
    assert parse_tokens("1m", "x") == 2**20
    with pytest.raises(PlanInputError, match="--dram-bytes"):
        parse_size("lots", "--dram-bytes")


def test_plan_states_the_host_memory_outside_the_cpu_budget():
    """Idle transfer buffers and the chunks a lower tier's write queue may hold are not in
    cpu.capacity_bytes: the plan states them (issue 16), at the tiers' default queue and
    chunk sizes. A 70B-like model in bf16: 327,680 B per token, 256 tokens per chunk."""
    from vllm_kvtier.ops.capacity import host_overhead

    h = host_overhead(327_680)
    assert h.writes_in_flight["nvme"] == (64, 16, 64 * 256 * 327_680)  # 5 GiB
    assert h.writes_in_flight["s3"] == (32, 16, 32 * 256 * 327_680)
    assert h.total_bytes(workers=2) == 2 * (256 << 20) + 96 * 256 * 327_680
    out = subprocess.run([sys.executable, "-m", "vllm_kvtier.cli", "plan", "--layers", "80", "--kv-heads", "8",
                          "--head-dim", "128", "--context-tokens", "128K"], capture_output=True, text=True,
                         check=True).stdout
    assert "Host memory outside the CPU budget" in out and "5.00 GiB (nvme.max_queued_writes 64" in out


def test_host_overhead_follows_the_configured_tiers():
    from vllm_kvtier.config import parse_config
    from vllm_kvtier.ops.capacity import host_overhead

    cfg = parse_config({"nvme": {"path": "/tmp/kv", "capacity_bytes": 2**30, "max_queued_writes": 8,
                                 "chunk_blocks": 4}})
    h = host_overhead(1000, cfg, block_tokens=16)
    assert h.writes_in_flight == {"nvme": (8, 4, 8 * 64 * 1000)}  # no S3 section, no S3 queue
