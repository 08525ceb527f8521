"""Parsing ``kv_connector_extra_config`` into the frozen sections, once, at the edge.

Sources, lowest precedence first, merged section by section:

1. the built-in defaults of the sections (:mod:`vllm_kvtier.config.sections`);
2. ``preset: NAME``: the file ``configs/NAME.yaml`` shipped with the package;
3. ``config_file: PATH``: a YAML file with the same fields;
4. the fields given inline in ``kv_connector_extra_config``.

Here: unknown keys, wrong types, non-finite numbers (``.inf``, ``.nan``, ``Infinity``) and
unknown presets raise :class:`~vllm_kvtier.errors.ConfigError` naming the dotted field;
each section then checks its own values as it is built. Nothing downstream re-validates.
Secrets never live here (S3 credentials come from the environment), so ``repr`` is safe to log.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from vllm_kvtier.config.files import MAX_CONFIG_FILE_BYTES, read_small_file
from vllm_kvtier.config.lower import MooncakeTierConfig, S3TierConfig
from vllm_kvtier.config.peer import NixlTierConfig
from vllm_kvtier.config.sections import KVTierConfig, OtherTiers
from vllm_kvtier.config.stores import MooncakeConfig, NixlConfig, S3Config
from vllm_kvtier.config.units import size_bytes
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.plugins import load_object

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"

#: Fields of the flat ``s3`` / ``mooncake`` sections that belong to the tier config itself.
_S3_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(S3TierConfig)) - {"store"}
_MOONCAKE_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(MooncakeTierConfig)) - {"store"}
_NIXL_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(NixlTierConfig)) - {"store"}



def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


__all__ = ["MAX_CONFIG_FILE_BYTES", "PRESET_DIR", "available_presets", "parse_config", "read_small_file"]


def _read_yaml(path: Path, field_name: str) -> dict[str, Any]:
    try:
        text = read_small_file(path)
    except ValueError as e:
        raise ConfigError(field_name, str(e)) from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(field_name, f"{path} is not valid YAML: {e}") from e
    except RecursionError:
        raise ConfigError(field_name, f"{path} is not a config: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(field_name, f"{path} must hold a mapping, not {type(data).__name__}")
    return data


#: Pairs of fields that say the same thing two ways: one source gives one of them, and a later
#: source's choice replaces an earlier source's other one.
_EITHER_OR = (("cpu", "capacity_bytes", "capacity_fraction"),)


def _merge_source(base: dict[str, Any], over: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``over`` (one source: the preset, the config file or the inline fields) merged onto
    ``base``; refuses a source that gives both fields of an either-or pair."""
    base = dict(base)
    for section, a, b in _EITHER_OR:
        sec = over.get(section)
        if not isinstance(sec, Mapping):
            continue
        given = [f for f in (a, b) if sec.get(f) is not None]
        if len(given) == 2:
            raise ConfigError(f"{section}.{b}", f"give {section}.{a} or {section}.{b}, not both ({source})")
        if given and isinstance(base.get(section), Mapping):
            other = b if given[0] == a else a
            base[section] = {k: v for k, v in base[section].items() if k != other}
    return _merge(base, over)


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _unknown_key(path: str, key: str, names: set[str]) -> ConfigError:
    close = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.75)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(path, f"unknown key; {hint}allowed: {', '.join(sorted(names))}")


def _yaml_bool_hint(value: Any) -> str:
    """YAML 1.1 reads unquoted on/off/yes/no as booleans: say so where a string was meant."""
    return " (YAML reads unquoted on/off/yes/no as true/false: quote the value)" if isinstance(value, bool) else ""


def _check_value(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return the (possibly coerced) value."""
    if tp == OtherTiers:
        return _other_tiers(path, value)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_value(path, value, a)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(path, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}"
                                    + _yaml_bool_hint(value))
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"must be a mapping, got {type(value).__name__}")
        if tp is S3TierConfig:
            return _build_flat(S3TierConfig, S3Config, _S3_POLICY_FIELDS, value, path)
        if tp is MooncakeTierConfig:
            return _build_flat(MooncakeTierConfig, MooncakeConfig, _MOONCAKE_POLICY_FIELDS, value, path)
        if tp is NixlTierConfig:
            return _build_flat(NixlTierConfig, NixlConfig, _NIXL_POLICY_FIELDS, value, path)
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if path.endswith("_bytes") and isinstance(value, str):  # "32GiB", "512MB"
            try:
                return size_bytes(value)
            except ValueError as e:
                raise ConfigError(path, f"{e}; give bytes, or a size such as 32GiB or 512MB") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(path, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {value!r}{_yaml_bool_hint(value)}")
        return value
    if origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"must be a list, got {value!r}")
        item = typing.get_args(tp)[0]
        return tuple(_check_value(f"{path}[{i}]", v, item) for i, v in enumerate(value))
    raise TypeError(f"unsupported annotation {tp!r} for {path}")  # programming error


def _other_tiers(path: str, value: Any) -> OtherTiers:
    """Out-of-tree tiers: each name a spec's path, each section its ``section_type``'s."""
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"must be a mapping of 'package.module:Spec' to a section, got {value!r}")
    out = []
    for name, section in value.items():
        where = f"{path}.{name}"
        if not isinstance(name, str) or ":" not in name:
            raise ConfigError(where, "an out-of-tree tier is named 'package.module:Spec' (nvme, s3 and mooncake "
                                     "have sections of their own)")
        try:
            section_type = load_object(name).section_type
        except (ImportError, AttributeError) as e:
            raise ConfigError(where, f"cannot load the tier's spec: {e}") from None
        out.append((name, _check_value(where, section if section is not None else {}, section_type)))
    return tuple(out)


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise _unknown_key(path, key, names)
        kwargs[key] = _check_value(path, value, hints[key])
    for f in dataclasses.fields(cls):
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            path = f"{prefix}.{f.name}" if prefix else f.name
            raise ConfigError(path, "is required")
    return cls(**kwargs)


def _build_flat(tier_cls: type, store_cls: type, policy_fields: frozenset[str], data: Mapping[str, Any],
                path: str) -> Any:
    """A flat tier section (``s3``, ``mooncake``): policy fields are ``tier_cls``'s, the
    rest the store's config (which validates itself and names ``<section>.<field>``)."""
    store_fields = {f.name for f in dataclasses.fields(store_cls)}
    for key in data:
        if key not in store_fields and key not in policy_fields:
            raise _unknown_key(f"{path}.{key}", key, store_fields | policy_fields)
    hints = typing.get_type_hints(tier_cls)
    policy = {k: _check_value(f"{path}.{k}", v, hints[k]) for k, v in data.items() if k in policy_fields}
    store = _build(store_cls, {k: v for k, v in data.items() if k in store_fields}, path)
    return tier_cls(store, **policy)


def parse_config(extra: Mapping[str, Any] | None) -> KVTierConfig:
    """Parse ``kv_connector_extra_config`` into a frozen :class:`KVTierConfig`.

    Called once per connector instance, in the scheduler and in every worker; it is pure
    (reads only the preset and config files) so all processes agree.
    """
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError("kv_connector_extra_config", f"must be a mapping, not {type(extra).__name__}")
    extra = dict(extra or {})
    merged: dict[str, Any] = {}
    preset = extra.get("preset")
    if preset is not None:
        if not isinstance(preset, str):
            raise ConfigError("preset", f"must be a string, got {preset!r}")
        path = PRESET_DIR / f"{preset}.yaml"
        if "/" in preset or not path.is_file():
            raise ConfigError(
                "preset", f"unknown preset {preset!r}; available: {', '.join(available_presets())}"
            )
        merged = _merge_source(merged, _read_yaml(path, "preset"), f"preset {preset}")
    config_file = extra.get("config_file")
    if config_file is not None:
        if not isinstance(config_file, str):
            raise ConfigError("config_file", f"must be a string, got {config_file!r}")
        from_file = _read_yaml(Path(config_file), "config_file")
        for nested in ("preset", "config_file"):
            if nested in from_file:
                raise ConfigError(f"config_file.{nested}", "may only be given inline")
        merged = _merge_source(merged, from_file, f"config_file {config_file}")
    merged = _merge_source(merged, extra, "kv_connector_extra_config")
    return _build(KVTierConfig, merged, "")
