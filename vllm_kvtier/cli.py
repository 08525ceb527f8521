"""``kvtier``: operator commands.

    kvtier presets                         list the shipped presets
    kvtier check-config '<extra json>'     validate kv_connector_extra_config (or --file X.yaml)

Exit status 0 when valid, 2 with the offending field named when not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import yaml

from vllm_kvtier.config import available_presets, parse_config
from vllm_kvtier.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("presets", help="list the shipped presets")
    chk = sub.add_parser("check-config", help="validate kv_connector_extra_config")
    chk.add_argument("extra", nargs="?", help="the JSON of kv_connector_extra_config")
    chk.add_argument("--file", help="a YAML file with the same fields")
    args = ap.parse_args(argv)
    if args.cmd == "presets":
        for p in available_presets():
            print(p)
        return 0
    try:
        extra = json.loads(args.extra) if args.extra else {}
        if args.file:
            extra = {**extra, "config_file": args.file}
        cfg = parse_config(extra)
    except json.JSONDecodeError as e:
        print(f"kvtier: not valid JSON: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"kvtier: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
