"""``kvtier presets`` and ``kvtier check-config``, and the kvtier config as the commands
take it (a JSON, ``--file``, ``--preset``), which ``kvtier plan`` and ``kvtier doctor`` read too."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

import yaml

from vllm_kvtier.cli.options import subcommand
from vllm_kvtier.config import PRESET_DIR, KVTierConfig, available_presets, parse_config
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.ops.units import PlanInputError
from vllm_kvtier.sysmem import budget_overrun
from vllm_kvtier.tiers.auth import check_key_files

#: Keys of vLLM's --kv-transfer-config (KVTransferConfig) that mark a JSON as the whole flag.
_TRANSFER_KEYS = ("kv_connector", "kv_connector_extra_config", "kv_role", "kv_load_failure_policy")


def extra_of_transfer_config(obj: dict[str, Any]) -> dict[str, Any]:
    """``kv_connector_extra_config``, from itself or from the whole ``--kv-transfer-config``
    JSON as pasted from a ``vllm serve`` line; warns where that JSON would trip vLLM."""
    if not any(k in obj for k in _TRANSFER_KEYS):
        return obj
    connector = obj.get("kv_connector")
    if connector not in (None, "KVTierConnector"):
        raise ConfigError("kv_connector", f"must be 'KVTierConnector' for this plugin, got {connector!r}")
    policy = obj.get("kv_load_failure_policy", "fail")
    if policy != "recompute":
        print(f"kvtier: warning: kv_load_failure_policy is {policy!r}: a block that cannot be loaded fails its "
              "request; set \"kv_load_failure_policy\":\"recompute\"", file=sys.stderr)
    extra = obj.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config", f"must be a JSON object, not {type(extra).__name__}")
    return extra


def parse_kvtier_config(args: argparse.Namespace) -> KVTierConfig:
    try:
        extra = json.loads(args.extra) if args.extra else {}
    except json.JSONDecodeError as e:
        raise PlanInputError("kv_connector_extra_config", f"not valid JSON: {e}") from None
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config", f"must be a JSON object, not {type(extra).__name__}")
    extra = extra_of_transfer_config(extra)
    if args.file:
        extra = {**extra, "config_file": args.file}
    if getattr(args, "preset", None):
        extra = {**extra, "preset": args.preset}
    return parse_config(extra)


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The config to read: a JSON, ``--file`` or ``--preset`` (check-config and doctor)."""
    p.add_argument("extra", nargs="?", help="the JSON of kv_connector_extra_config, or the whole "
                                              "--kv-transfer-config JSON")
    p.add_argument("--file", help="a YAML file with the same fields")
    p.add_argument("--preset", help=f"a shipped preset ({', '.join(available_presets())})")


def add_presets(sub: Any) -> None:
    subcommand(sub, "presets", "list the shipped presets",
               "Lists the presets shipped with the plugin (interactive, long-context, offline-batch, ...), one per\n"
               "line with what it is for. A preset fills in every field of kv_connector_extra_config for one kind of workload; fields\n"
               "you set yourself override it. 'kvtier check-config' shows what a preset expands to.",
               "  kvtier presets\n"
               "  kvtier check-config '{\"preset\": \"long-context\"}'")


def run_presets(args: argparse.Namespace) -> int:
    names = available_presets()
    width = max(map(len, names), default=0)
    for p in names:
        print(f"{p:<{width}}  {preset_description(p)}")
    return 0


def preset_description(name: str) -> str:
    """The first sentence of a preset's header comment (``# Preset "x": ...``)."""
    lines = []
    for line in (PRESET_DIR / f"{name}.yaml").read_text().splitlines():
        if not line.startswith("#") or line.strip() == "#":
            break
        lines.append(line.lstrip("# ").strip())
    text = " ".join(lines).split(":", 1)[-1].strip()
    return re.split(r"[.;](?:\s|$)", text, maxsplit=1)[0]


def add_check_config(sub: Any) -> None:
    chk = subcommand(sub, "check-config", "validate kv_connector_extra_config and print it in full",
                     "Parses a kv_connector_extra_config exactly as the connector will at start-up, preset and\n"
                     "defaults applied, and prints the result as YAML. A bad value exits 2 with the field named\n"
                     "and the values it allows, before any engine is started.",
                     "  kvtier check-config '{\"preset\": \"interactive\", \"cpu\": {\"capacity_bytes\": 1073741824}}'\n"
                     "  kvtier check-config --file configs/long-context.yaml\n"
                     "  kvtier check-config --preset long-context '{\"nvme\": {\"capacity_bytes\": \"2TB\"}}'\n"
                     "  kvtier check-config '{\"kv_connector\": \"KVTierConnector\", \"kv_role\": \"kv_both\", "
                     "\"kv_connector_extra_config\": {\"preset\": \"interactive\"}}'\n"
                     "  kvtier check-config '{\"cpu\": {\"capacity_bytes\": 68719476736}}' --file configs/long-context.yaml")
    add_config_args(chk)


def run_check_config(args: argparse.Namespace) -> int:
    try:
        cfg = parse_kvtier_config(args)
        check_key_files(cfg.auth)  # the engine reads them at start-up: fail here first
    except (PlanInputError, ConfigError) as e:
        print(f"kvtier: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), end="")
    overrun = budget_overrun(cfg.cpu.capacity_bytes)
    if overrun is not None:  # the config may be meant for a bigger machine: a warning
        print(f"kvtier: warning: cpu.capacity_bytes: {overrun}; an engine on this machine would "
              "refuse to start",
              file=sys.stderr)
    return 0
