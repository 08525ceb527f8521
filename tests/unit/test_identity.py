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
from vllm_kvtier.index import digest_cache, identity, weight_sampling
from vllm_kvtier.index.adapters import AdapterFingerprints, AdapterKeys, adapter_key
from vllm_kvtier.index.identity import ModelIdentity, fingerprint_weights
from vllm_kvtier.index.weight_sampling import safetensors_header


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
    weights = sum(f.stat().st_size for f in a.glob("*.safetensors"))
    assert first.files == 3 and first.mode == "full" and first.bytes_hashed == weights
    assert first.total_bytes > 2 * 12 * 40_000
    assert fingerprint_weights(a, mode="sampled").reads > 2 * 12  # a read per tensor at least


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
    for mode in ("sampled", "full"):
        tracemalloc.start()
        try:
            fingerprint_weights(d, mode=mode)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, mode
    # a header whose length fits but whose tensors point past the file: offsets dropped
    bad = {"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 2**62]}}
    blob = json.dumps(bad).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(10))
    assert fingerprint_weights(d, mode="sampled").reads >= 2


def test_tensor_windows_are_bounded(tmp_path, monkeypatch):
    """A header listing more tensors than MAX_TENSOR_WINDOWS: that many windows, spread."""
    monkeypatch.setattr(weight_sampling, "MAX_TENSOR_WINDOWS", 8)
    d = tmp_path / "many"
    d.mkdir()
    write_safetensors(d / "model.safetensors", {f"t{i}": bytes([i % 256]) * 5000 for i in range(200)})
    fp = fingerprint_weights(d)
    assert fp.reads <= 1 + weight_sampling.FILE_WINDOWS + 8


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


def test_cost_of_a_70b_layout_is_about_1200_reads_sampled(tmp_path):
    """``weights_fingerprint: sampled`` on Llama-70B's layout: 723 tensors in 30 safetensors shards (sparse files here, 1 MiB
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
    fp = fingerprint_weights(d, mode="sampled")
    assert fp.files == 31
    assert 723 + 30 <= fp.reads <= 723 + 30 * (1 + weight_sampling.FILE_WINDOWS) + 1
    assert 1100 <= fp.reads <= 1250


def test_canonical_is_stable_and_total():
    assert identity.canonical({"b": 1, "a": [1.5, None]}) == identity.canonical({"a": [1.5, None], "b": 1})
    loop: list = []
    loop.append(loop)
    assert identity.canonical(loop).startswith("repr:")
    assert identity.canonical({1, 2}) == identity.canonical({1, 2})  # by str


# ---- issue 31: the full content hash and its per-host cache -----------------------------

BIG = 8 << 20  # one tensor: the sampled fingerprint reads 16 windows + 1 of it


def big_model(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"hidden_size": 256, "model_type": "llama"}))
    write_safetensors(root / "model.safetensors", {"embed.weight": random.Random(7).randbytes(BIG)})
    write_safetensors(root / "small.safetensors", tensors(3, n=2))
    return root


def edit_in_place(path: Path, offset_in_data: int, data: bytes) -> None:
    """Overwrite bytes of the data section (same size, same header, same file)."""
    with open(path, "r+b") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + hlen + offset_in_data)
        f.write(data)


def test_an_edit_between_the_sampled_windows_changes_the_digest(tmp_path):
    """Issue 31: 64 KiB changed 100 KB into an 8 MiB tensor, far from the sampled windows
    (its first 4 KiB and every 8 MiB / 15): the sampled fingerprint keeps its digest, the
    full one (the default) does not."""
    a = big_model(tmp_path / "a")
    full, sampled = fingerprint_weights(a).digest, fingerprint_weights(a, mode="sampled").digest
    edit_in_place(a / "model.safetensors", 100_000, bytes(64 << 10))
    assert fingerprint_weights(a, mode="sampled").digest == sampled  # what sampling cannot see
    assert fingerprint_weights(a).digest != full
    assert full != sampled  # the two modes never share a namespace


SECOND_START = """
import json, sys
from pathlib import Path
from vllm_kvtier.index.identity import fingerprint_weights
fp = fingerprint_weights(sys.argv[1], cache_dir=Path(sys.argv[2]))
print(json.dumps({"digest": fp.digest, "hashed": fp.bytes_hashed, "cached": fp.cached_files}))
"""


def start(model: Path, cache: Path) -> dict:
    """One engine start's fingerprint, in a process of its own (no per-process memo)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", SECOND_START, str(model), str(cache)], capture_output=True,
                         text=True, check=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cached_start_reads_no_weights_and_a_touched_file_keeps_its_digest(tmp_path):
    a = big_model(tmp_path / "a")
    cache = tmp_path / "cache"
    weights = sum(f.stat().st_size for f in a.glob("*.safetensors"))
    first = start(a, cache)
    assert first["hashed"] == weights and first["cached"] == 0
    assert oct((cache / digest_cache.CACHE_FILE).stat().st_mode & 0o777) == "0o600"
    second = start(a, cache)
    assert second == {"digest": first["digest"], "hashed": 0, "cached": 2}  # not a byte read
    # touched (same content, new mtime): hashed again, same digest
    os.utime(a / "model.safetensors", ns=(10**18, 10**18))
    touched = start(a, cache)
    assert touched["digest"] == first["digest"]
    assert touched["hashed"] == (a / "model.safetensors").stat().st_size and touched["cached"] == 1
    # edited with its mtime put back: ctime moved, so hashed again, and the digest changes
    before = (a / "model.safetensors").stat()
    edit_in_place(a / "model.safetensors", 100_000, b"\x01" * 4096)
    os.utime(a / "model.safetensors", ns=(before.st_atime_ns, before.st_mtime_ns))
    edited = start(a, cache)
    assert edited["hashed"] > 0 and edited["digest"] != first["digest"]
    # another host's copy of the files, with its own cache: the same digest
    b = Path(__import__("shutil").copytree(a, tmp_path / "b"))
    assert start(b, tmp_path / "cache-b")["digest"] == edited["digest"]


def test_a_damaged_or_foreign_cache_file_is_not_believed(tmp_path):
    """The cache file is data: junk, an oversized file, malformed entries and a symlink are
    each ignored (every byte hashed again, the right digest), never followed or written
    through; a cache directory that cannot exist means no cache, not a failure."""
    a = big_model(tmp_path / "a")
    want = fingerprint_weights(a).digest  # no cache
    weights = sum(f.stat().st_size for f in a.glob("*.safetensors"))
    cache = tmp_path / "cache"
    cache.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text("keep")
    path = str((a / "model.safetensors").resolve())
    st = os.stat(path)
    state = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    junk = [b"\x00not json", b"[" * (digest_cache.MAX_CACHE_BYTES + 1),
            json.dumps({"version": 1, "files": [[path, state, "zz" * 32], [path, state[:4], "0" * 64],
                                                [path, state, 5]]}).encode(),
            json.dumps({"version": 2, "files": [[path, state, "0" * 64]]}).encode()]
    for i, blob in enumerate(junk + [None]):
        f = cache / digest_cache.CACHE_FILE
        f.unlink(missing_ok=True)
        if blob is None:
            f.symlink_to(target)
        else:
            f.write_bytes(blob)
        os.utime(a / "config.json", ns=(i + 1, i + 1))  # a new memo key: computed again
        fp = fingerprint_weights(a, cache_dir=cache)
        assert (fp.digest, fp.bytes_hashed) == (want, weights), i
    assert target.read_text() == "keep" and not (cache / digest_cache.CACHE_FILE).is_symlink()
    # the rewritten cache is used by the next call (a new memo key, same weight files)
    os.utime(a / "config.json", ns=(99, 99))
    assert fingerprint_weights(a, cache_dir=cache).bytes_hashed == 0
    (tmp_path / "a-file").write_text("")
    os.utime(a / "config.json", ns=(100, 100))
    fp = fingerprint_weights(a, cache_dir=tmp_path / "a-file" / "cache")
    assert (fp.digest, fp.bytes_hashed) == (want, weights)


def test_a_cache_directory_others_can_write_is_not_used(tmp_path):
    a = big_model(tmp_path / "a")
    weights = sum(f.stat().st_size for f in a.glob("*.safetensors"))
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)  # past the umask
    fingerprint_weights(a, cache_dir=cache)
    assert not (cache / digest_cache.CACHE_FILE).exists()
    os.utime(a / "config.json", ns=(5, 5))  # a new memo key
    assert fingerprint_weights(a, cache_dir=cache).bytes_hashed == weights
    os.chmod(cache, 0o700)
    os.utime(a / "config.json", ns=(6, 6))
    fingerprint_weights(a, cache_dir=cache)
    os.utime(a / "config.json", ns=(7, 7))
    assert fingerprint_weights(a, cache_dir=cache).bytes_hashed == 0


def test_a_start_killed_mid_hash_resumes_with_the_files_it_finished(tmp_path, monkeypatch):
    """Each file's hash is cached as it finishes: a start that dies after k files leaves them
    cached; the next start hashes only the others (and a file changed since), and its digest
    is the one a start from nothing computes."""
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for i in range(6):
        write_safetensors(a / f"model-{i:05d}.safetensors", tensors(i, n=2))
    want = fingerprint_weights(a).digest  # no cache: from nothing
    cache = tmp_path / "cache"
    real = digest_cache.hash_file
    done: list[str] = []
    lock = __import__("threading").Lock()

    def dies_after_two(path: Path) -> tuple[str, int, int]:
        with lock:
            if len(done) >= 2:
                raise OSError("killed")  # this start is over: no file is finished after it
            done.append(path.name)
        return real(path)

    monkeypatch.setattr(digest_cache, "hash_file", dies_after_two)
    os.utime(a / "config.json", ns=(1, 1))  # a new memo key
    with pytest.raises(OSError, match="killed"):
        fingerprint_weights(a, cache_dir=cache)
    assert len(done) == 2
    changed = sorted(done)[0]
    write_safetensors(a / changed, tensors(50, n=2))  # changed since: hashed again
    monkeypatch.setattr(digest_cache, "hash_file", real)
    want_changed = fingerprint_weights(a).digest
    hashed: list[str] = []
    monkeypatch.setattr(digest_cache, "hash_file", lambda path: (hashed.append(path.name), real(path))[1])
    os.utime(a / "config.json", ns=(2, 2))
    fp = fingerprint_weights(a, cache_dir=cache)
    all_files = {p.name for p in a.glob("*.safetensors")}
    assert sorted(hashed) == sorted(all_files - set(done) | {changed})
    assert fp.cached_files == 1 and fp.digest == want_changed != want
    # and a third start reads nothing
    os.utime(a / "config.json", ns=(3, 3))
    assert fingerprint_weights(a, cache_dir=cache).bytes_hashed == 0
