"""The model's identity, read from vLLM's resolved configuration objects (by attribute:
nothing here imports vLLM): what the namespace digest is made of.

Who calls it: :func:`~vllm_kvtier.connector.wiring.engine_namespace`, once per role at
start-up. It may block: the weights are fingerprinted (hashed once, then cached).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from vllm_kvtier.errors import ConfigError
from vllm_kvtier.index.identity import (
    FingerprintMode,
    ModelIdentity,
    WeightsFingerprint,
    canonical,
    fingerprint_weights,
)

logger = logging.getLogger("vllm_kvtier")


#: Keys of the resolved HF config that name files or versions, not what is computed.
_VOLATILE_HF_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash", "name_or_path",
                               "_attn_implementation_autoset"})
#: Resolved HF config fields logged as the rope settings (all of the config is hashed).
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings",
              "partial_rotary_factor", "original_max_position_embeddings")


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    try:
        raw = hf_config.to_dict()
    except Exception:  # not a transformers config: its public attributes
        raw = {k: v for k, v in vars(hf_config).items() if not k.startswith("_")}
    # A value printed with its address would differ between processes (scheduler and
    # workers must agree on the namespace): such values are left out.
    return {k: v for k, v in raw.items()
            if k not in _VOLATILE_HF_KEYS and " at 0x" not in canonical(v)}


def _local_model_path(model_config: Any, load_config: Any) -> Path | None:
    """The local directory (or file) vLLM loads the weights from: the model path itself,
    or a hub id's snapshot already in the local HF cache (never downloaded here)."""
    path = Path(str(model_config.model))
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(str(model_config.model), revision=model_config.revision,
                                  cache_dir=getattr(load_config, "download_dir", None), local_files_only=True)
        return Path(found)
    except Exception:
        return None


def digest_cache_dir(setting: str) -> Path | None:
    """``weights_digest_cache_dir`` as a directory: "auto" is $XDG_CACHE_HOME/vllm_kvtier
    (else ~/.cache/vllm_kvtier), "" none."""
    import os

    if setting == "auto":
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "vllm_kvtier"
    return Path(setting).expanduser() if setting else None


def model_identity(vllm_config: Any, salt: str, *, fingerprint: FingerprintMode = "full",
                   cache_dir: Path | None = None,
                   require_fingerprint: bool = False) -> tuple[ModelIdentity, WeightsFingerprint | None]:
    """The :class:`ModelIdentity` of this engine, read from vLLM's resolved configuration,
    and the weights fingerprint it used (None when the weights could not be fingerprinted:
    then the model id and revision stand for them, with a WARNING; with
    ``require_fingerprint``, :class:`ConfigError` instead). ``fingerprint`` and
    ``cache_dir``: :func:`~vllm_kvtier.index.identity.fingerprint_weights`'s."""
    model = vllm_config.model_config
    load = vllm_config.load_config
    cache = vllm_config.cache_config
    hf = getattr(model, "hf_config", None)
    text = getattr(model, "hf_text_config", hf)
    fp: WeightsFingerprint | None = None
    local = _local_model_path(model, load)
    if local is not None:
        try:
            fp = fingerprint_weights(local, mode=fingerprint, cache_dir=cache_dir)
        except (OSError, ValueError) as e:  # unreadable: fall back to the id, never fail the start
            logger.warning("kvtier: cannot fingerprint the weights at %s (%s)", local, e)
    if fp is None and require_fingerprint:
        raise ConfigError("require_weights_fingerprint",
                          f"the weights of {model.model!r} cannot be fingerprinted (not a readable local model "
                          "directory or file): load the model from a local directory, or set this to false")
    if fp is None:
        logger.warning("kvtier: the weights of %r cannot be fingerprinted (not a readable local model); the "
                       "namespace uses its id and revision only: set namespace_salt when the weights behind "
                       "them can change", model.model)
    overrides: Any = model.hf_overrides
    if callable(overrides):  # a function: only its name can be seen
        overrides = f"callable:{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}"
    rope = {k: getattr(text, k) for k in _ROPE_KEYS if getattr(text, k, None) is not None}
    identity = ModelIdentity(
        model="" if fp is not None else f"{model.model}@{model.revision or ''}",
        weights=fp.digest if fp is not None else "",
        model_dtype=str(model.dtype),
        kv_cache_dtype=str(cache.cache_dtype),
        quantization=str(model.quantization or ""),
        quant_config=canonical(getattr(hf, "quantization_config", None)),
        hf_overrides=canonical(overrides),
        rope=canonical(rope),
        hf_config=hashlib.sha256(canonical(_hf_dict(hf) if hf is not None else {}).encode()).hexdigest()[:32],
        load_format=str(getattr(load, "load_format", "")) + (
            f":seed={model.seed}" if str(getattr(load, "load_format", "")) == "dummy" else ""),
        salt=salt,
    )
    return identity, fp
