"""The vLLM glue of model identity (``connector/wiring.py``): what it reads from vLLM's
resolved configuration, the hub-id fallback with its WARNING, a hub snapshot already in the
local HF cache, and the namespace's inputs logged once. vLLM's config objects are stood in
for by plain namespaces with the attributes the glue reads."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tests.unit.test_identity import model_dir
from vllm_kvtier.connector.wiring import engine_namespace
from vllm_kvtier.engine.identity import model_identity
from vllm_kvtier.index.identity import fingerprint_weights


def fake_config(model: str, *, revision: str | None = None, download_dir: str | None = None,
                hf_overrides: object = None, dtype: str = "torch.bfloat16") -> SimpleNamespace:
    text = SimpleNamespace(rope_theta=10000.0, max_position_embeddings=4096,
                           to_dict=lambda: {"hidden_size": 256, "_name_or_path": model, "rope_theta": 10000.0})
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=revision, dtype=dtype, quantization=None,
                                     hf_overrides=hf_overrides if hf_overrides is not None else {},
                                     hf_config=text, hf_text_config=text, seed=0),
        load_config=SimpleNamespace(load_format="auto", download_dir=download_dir),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=32, prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def test_a_local_model_is_named_by_its_weights(tmp_path):
    a = model_dir(tmp_path / "a")
    ident, fp = model_identity(fake_config(str(a)), "")
    assert fp is not None and ident.weights == fingerprint_weights(a).digest and ident.model == ""
    # the same weights elsewhere: the same identity (the path is not part of it)
    other, _ = model_identity(fake_config(str(model_dir(tmp_path / "b"))), "")
    assert other.digest() == ident.digest()
    assert model_identity(fake_config(str(a), dtype="torch.float32"), "")[0].digest() != ident.digest()
    assert model_identity(fake_config(str(a)), "salt")[0].digest() != ident.digest()
    over, _ = model_identity(fake_config(str(a), hf_overrides={"rope_theta": 5e5}), "")
    assert over.digest() != ident.digest()
    fn, _ = model_identity(fake_config(str(a), hf_overrides=lambda c: c), "")
    assert fn.hf_overrides.startswith('"callable:') and fn.digest() != ident.digest()


def test_a_hub_id_not_on_disk_falls_back_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_kvtier"):
        ident, fp = model_identity(fake_config("org/not-here", revision="abc123",
                                               download_dir=str(tmp_path / "hf")), "")
    assert fp is None and ident.weights == "" and ident.model == "org/not-here@abc123"
    assert "namespace_salt" in caplog.text
    other, _ = model_identity(fake_config("org/not-here", revision="def456", download_dir=str(tmp_path / "hf")), "")
    assert other.digest() != ident.digest()


def test_a_hub_snapshot_in_the_local_cache_is_fingerprinted(tmp_path):
    """A hub id whose snapshot is in the HF cache (as vLLM downloaded it): its files are
    read there, nothing is downloaded."""
    cache = tmp_path / "hf"
    repo = cache / "models--org--cached"
    commit = "0123456789abcdef0123456789abcdef01234567"
    model_dir(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    ident, fp = model_identity(fake_config("org/cached", download_dir=str(cache)), "")
    assert fp is not None and ident.weights == fingerprint_weights(repo / "snapshots" / commit).digest
    assert ident.weights == fingerprint_weights(model_dir(tmp_path / "local")).digest


def test_the_inputs_are_logged_once_without_the_salt(tmp_path, caplog):
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"],
                                                          kv_cache_spec=SimpleNamespace(num_kv_heads=2, head_size=64))])
    cfg = fake_config(str(model_dir(tmp_path / "a")))
    with caplog.at_level(logging.INFO, logger="vllm_kvtier"):
        ns = engine_namespace(cfg, kv, salt="s3cret-salt", log=True)
        assert engine_namespace(cfg, kv, salt="s3cret-salt") == ns  # the worker's: same, not logged
    lines = [r.getMessage() for r in caplog.records if "namespace" in r.getMessage()]
    assert len(lines) == 1 and ns in lines[0]
    assert "salt=set" in lines[0] and "s3cret" not in caplog.text
    assert "weights=" + fingerprint_weights(tmp_path / "a").digest in lines[0] and "num_kv_heads=2" in lines[0]
    assert engine_namespace(cfg, kv, salt="") != ns


def layout_kv(layout: str | None) -> SimpleNamespace:
    spec = SimpleNamespace(num_kv_heads=2, head_size=64)
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec=spec)],
                           kv_cache_layout=layout)


def test_the_resolved_kv_layout_is_in_the_namespace(tmp_path):
    """Issue 31: two engines of one model whose vLLM resolved different physical KV layouts
    (NHD on Hopper, HND on Blackwell or the CPU backend, ``VLLM_KV_CACHE_LAYOUT``) have
    the same block size and sizes but not the same bytes: never the same namespace."""
    cfg = fake_config(str(model_dir(tmp_path / "a")))
    by_layout = {name: engine_namespace(cfg, layout_kv(name)) for name in ("LBHNC", "LBNHC", "BLHNC", "BLNHC")}
    assert len(set(by_layout.values())) == 4
    # vLLM's older names are the same layouts
    assert engine_namespace(cfg, layout_kv("HND")) == by_layout["LBHNC"]
    assert engine_namespace(cfg, layout_kv("NHD")) == by_layout["LBNHC"]
    # where the KVCacheConfig has none, cache_config's (the same value vLLM recorded there)
    cfg.cache_config.kv_cache_layout = "LBNHC"
    assert engine_namespace(cfg, layout_kv(None)) == by_layout["LBNHC"]
    # nothing resolved: a namespace of its own, never a resolved layout's
    cfg.cache_config.kv_cache_layout = None
    assert engine_namespace(cfg, layout_kv(None)) not in by_layout.values()


def test_an_edit_inside_a_large_tensor_changes_the_namespace(tmp_path):
    """Issue 31: 64 KiB rewritten 100 KB into an 8 MiB tensor (between the windows the
    sampled fingerprint reads) is a new namespace: the weights are hashed whole."""
    from tests.unit.test_identity import big_model, edit_in_place

    a = big_model(tmp_path / "a")
    cfg, kv = fake_config(str(a)), layout_kv("LBHNC")
    before = engine_namespace(cfg, kv)
    edit_in_place(a / "model.safetensors", 100_000, bytes(64 << 10))
    assert engine_namespace(cfg, kv) != before


def test_require_weights_fingerprint_refuses_a_model_named_by_id_only(tmp_path):
    """``require_weights_fingerprint``: a model that cannot be fingerprinted stops the start
    with an error naming the field and the model; a local model starts as before."""
    from vllm_kvtier.config import parse_config
    from vllm_kvtier.errors import ConfigError

    cfg = parse_config({"require_weights_fingerprint": True})
    assert cfg.require_weights_fingerprint and not parse_config({}).require_weights_fingerprint
    hub = fake_config("org/not-here", revision="abc123", download_dir=str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="require_weights_fingerprint.*org/not-here"):
        model_identity(hub, "", require_fingerprint=cfg.require_weights_fingerprint)
    a = model_dir(tmp_path / "a")
    ident, fp = model_identity(fake_config(str(a)), "", require_fingerprint=True)
    assert fp is not None and ident.weights == fp.digest and ident.model == ""
