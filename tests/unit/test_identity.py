"""Model identity (issue 13): every input of the namespace's model digest changes it; an
unchanged model gives the same digest twice; untrusted safetensors headers are bounded.

Real files in ``tmp_path`` (safetensors written by hand: an 8-byte length, a JSON header,
the data), no vLLM."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import struct
import tracemalloc
from pathlib import Path

import pytest

from vllm_kvtier.config import parse_config
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.index import identity
from vllm_kvtier.index.identity import (
    AdapterFingerprints,
    AdapterKeys,
    ModelIdentity,
    adapter_key,
    fingerprint_weights,
    safetensors_header,
)


def write_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    """A safetensors file of raw byte tensors (dtype U8), in the order given."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [off, off + len(data)]}
        off += len(data)
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"".join(tensors.values()))


def tensors(seed: int, n: int = 12, size: int = 40_000) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"layer.{i}.weight": rng.randbytes(size) for i in range(n)}


def model_dir(root: Path, seed: int = 0, config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or {"hidden_size": 256, "model_type": "llama"}))
    write_safetensors(root / "model-00001-of-00002.safetensors", tensors(seed))
    write_safetensors(root / "model-00002-of-00002.safetensors", tensors(seed + 100))
    (root / "tokenizer.json").write_text("{}")  # not an input
    return root


def test_unchanged_model_same_digest_and_copies_share_it(tmp_path):
    a = model_dir(tmp_path / "a")
    first = fingerprint_weights(a)
    os.utime(a / "config.json", ns=(1, 1))  # memo key changes: computed again
    again = fingerprint_weights(a)
    assert first.digest == again.digest
    assert fingerprint_weights(model_dir(tmp_path / "b")).digest == first.digest  # content, not path
    assert first.files == 3 and first.reads > 2 * 12 and first.total_bytes > 2 * 12 * 40_000


def test_new_weights_with_identical_headers_and_sizes_change_it(tmp_path):
    """A fine-tune: same tensor names, shapes and file sizes, other bytes."""
    a = model_dir(tmp_path / "a", seed=0)
    b = model_dir(tmp_path / "b", seed=1)
    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (a / f).stat().st_size == (b / f).stat().st_size
        with open(a / f, "rb") as fa, open(b / f, "rb") as fb:
            assert safetensors_header(fa, (a / f).stat().st_size) == safetensors_header(fb, (b / f).stat().st_size)
    assert fingerprint_weights(a).digest != fingerprint_weights(b).digest


def test_one_changed_tensor_changes_it(tmp_path):
    """Every tensor is sampled: changing only the last one's bytes (same size) is seen."""
    a = model_dir(tmp_path / "a")
    before = fingerprint_weights(a).digest
    t = tensors(100)
    t["layer.11.weight"] = bytes(40_000)
    write_safetensors(a / "model-00002-of-00002.safetensors", t)
    assert fingerprint_weights(a).digest != before


def test_config_and_quant_files_change_it(tmp_path):
    a = model_dir(tmp_path / "a")
    base = fingerprint_weights(a).digest
    (a / "config.json").write_text(json.dumps({"hidden_size": 256, "model_type": "llama", "rope_theta": 1e6}))
    changed = fingerprint_weights(a).digest
    assert changed != base
    (a / "quantize_config.json").write_text(json.dumps({"bits": 4}))
    assert fingerprint_weights(a).digest not in (base, changed)


def test_raw_and_gguf_files_are_sampled_not_parsed(tmp_path):
    """A pickled .bin is never unpickled (its bytes are sampled); a single GGUF file works."""
    d = tmp_path / "bin"
    d.mkdir()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04" + random.Random(0).randbytes(200_000))
    one = fingerprint_weights(d).digest
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04" + random.Random(1).randbytes(200_000))
    assert fingerprint_weights(d).digest != one
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF" + random.Random(2).randbytes(100_000))
    assert len(fingerprint_weights(g).digest) == 64


def test_not_a_local_model_raises_oserror(tmp_path):
    with pytest.raises(OSError):
        fingerprint_weights(tmp_path / "meta-llama/Llama-3-8B")
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError):
        fingerprint_weights(tmp_path / "empty")


def test_forged_header_length_does_not_allocate(tmp_path):
    """An 8-byte prefix saying 2**60: not a safetensors, nothing big allocated or read."""
    d = tmp_path / "forged"
    d.mkdir()
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", 2**60) + b"{" + bytes(100_000))
    with open(d / "model.safetensors", "rb") as f:
        assert safetensors_header(f, (d / "model.safetensors").stat().st_size) is None
    tracemalloc.start()
    try:
        fingerprint_weights(d)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    # a header whose length fits but whose tensors point past the file: offsets dropped
    bad = {"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 2**62]}}
    blob = json.dumps(bad).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(10))
    assert fingerprint_weights(d).reads >= 2


def test_tensor_windows_are_bounded(tmp_path, monkeypatch):
    """A header listing more tensors than MAX_TENSOR_WINDOWS: that many windows, spread."""
    monkeypatch.setattr(identity, "MAX_TENSOR_WINDOWS", 8)
    d = tmp_path / "many"
    d.mkdir()
    write_safetensors(d / "model.safetensors", {f"t{i}": bytes([i % 256]) * 5000 for i in range(200)})
    fp = fingerprint_weights(d)
    assert fp.reads <= 1 + identity.FILE_WINDOWS + 8


def ident(**change: str) -> ModelIdentity:
    base = ModelIdentity(model="", weights="ab" * 32, model_dtype="torch.bfloat16", kv_cache_dtype="auto",
                         quantization="", quant_config="null", hf_overrides="{}", rope='{"rope_theta":10000}',
                         hf_config="c" * 32, load_format="auto", salt="")
    return dataclasses.replace(base, **change)


@pytest.mark.parametrize("change", [
    {"weights": "cd" * 32}, {"model_dtype": "torch.float32"}, {"kv_cache_dtype": "fp8"},
    {"quantization": "fp8"}, {"quant_config": '{"bits":4}'}, {"hf_overrides": '{"rope_theta":500000}'},
    {"rope": '{"rope_theta":500000}'}, {"hf_config": "d" * 32}, {"load_format": "dummy:seed=0"},
    {"salt": "tenant-a"}, {"model": "meta-llama/Llama-3-8B@main"},
], ids=lambda c: next(iter(c)))
def test_each_identity_input_changes_the_digest(change):
    assert ident(**change).digest() != ident().digest()
    assert ident().digest() == ident().digest()


def test_salt_is_never_described():
    assert ident(salt="s3cret").describe()["salt"] == "set"
    assert ident().describe()["salt"] == "unset"
    assert "s3cret" not in repr(parse_config({"namespace_salt": "s3cret"}))


@pytest.mark.parametrize("bad", ["x" * 257, "a\nb", "nul\x00"])
def test_namespace_salt_is_validated(bad):
    with pytest.raises(ConfigError, match="namespace_salt"):
        parse_config({"namespace_salt": bad})


def test_adapter_keys_bind_block_hashes_to_adapter_content(tmp_path):
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    write_safetensors(adapter / "adapter_model.safetensors", tensors(5, n=4, size=8192))
    fps = AdapterFingerprints()
    fp1 = fps.get(str(adapter))
    assert fps.get(str(adapter)) == fp1
    write_safetensors(adapter / "adapter_model.safetensors", tensors(6, n=4, size=8192))
    os.utime(adapter / "adapter_model.safetensors", ns=(5, 5))
    fp2 = fps.get(str(adapter))
    assert fp2 != fp1

    class Req:
        block_hashes = [bytes([i]) * 32 for i in range(3)]

    req = Req()
    keys = AdapterKeys(req, fp1)
    assert len(keys) == 3 and keys[0] == adapter_key(fp1, req.block_hashes[0]) and len(keys[0]) == 32
    assert keys[1:3] == [adapter_key(fp1, h) for h in req.block_hashes[1:3]]
    assert set(keys[:]).isdisjoint(req.block_hashes)
    assert AdapterKeys(req, fp2)[0] != keys[0]
    req.block_hashes.append(b"\x09" * 32)  # the live list grows as vLLM computes
    assert len(keys) == 4 and keys[-1] == adapter_key(fp1, b"\x09" * 32)
    with pytest.raises(OSError):
        fps.get(str(tmp_path / "missing"))


def test_special_files_are_not_read(tmp_path):
    """A FIFO named like a weight file would block a reader: it is skipped."""
    d = model_dir(tmp_path / "a")
    before = fingerprint_weights(d).digest
    os.mkfifo(d / "extra.safetensors")
    assert fingerprint_weights(d).digest == before


def test_symlinked_weights_are_followed(tmp_path):
    """A hub snapshot's files are symlinks to its blobs."""
    a = model_dir(tmp_path / "a")
    b = tmp_path / "b"
    b.mkdir()
    for f in a.iterdir():
        (b / f.name).symlink_to(f)
    assert fingerprint_weights(b).digest == fingerprint_weights(a).digest


def test_cost_of_a_70b_layout_is_about_1200_reads(tmp_path):
    """Llama-70B's layout: 723 tensors in 30 safetensors shards (sparse files here, 1 MiB
    each: the read count depends on tensors and files, not bytes). One read per tensor,
    16 per file, one per header and config file: the figure docs/configuration.md gives."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    names += [f"model.layers.{i}.{t}.weight" for i in range(80) for t in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]
    assert len(names) == 723
    d = tmp_path / "70b"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    shard = 1 << 20
    for s in range(30):
        chunk = names[s * len(names) // 30:(s + 1) * len(names) // 30]
        step = shard // len(chunk)
        header = {n: {"dtype": "U8", "shape": [step], "data_offsets": [i * step, (i + 1) * step]}
                  for i, n in enumerate(chunk)}
        blob = json.dumps(header).encode()
        with open(d / f"model-{s + 1:05d}-of-00030.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            f.truncate(8 + len(blob) + step * len(chunk))
    fp = fingerprint_weights(d)
    assert fp.files == 31
    assert 723 + 30 <= fp.reads <= 723 + 30 * (1 + identity.FILE_WINDOWS) + 1
    assert 1100 <= fp.reads <= 1250


def test_canonical_is_stable_and_total():
    assert identity.canonical({"b": 1, "a": [1.5, None]}) == identity.canonical({"a": [1.5, None], "b": 1})
    loop: list = []
    loop.append(loop)
    assert identity.canonical(loop).startswith("repr:")
    assert identity.canonical({1, 2}) == identity.canonical({1, 2})  # by str
