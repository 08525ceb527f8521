"""``kvtier``: operator commands.

One module per command group: :mod:`.configs` (``presets``, ``check-config``), :mod:`.plan`
and :mod:`.plan_trace` (``plan``), :mod:`.doctor` and :mod:`.bench`. ``kvtier --help``
lists the commands, with examples.

Exit status: 0 when valid (doctor: no FAIL; bench: every run finished and no FAIL), 1 when
doctor or bench found a FAIL, 2 with the offending field, option or file named when the
input is bad.
"""

from __future__ import annotations

import argparse
import os
import sys

from vllm_kvtier import __version__
from vllm_kvtier.cli import bench, configs, doctor, plan
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.ops.units import PlanInputError

_DESCRIPTION = """\
Operator commands for vllm_kvtier, the vLLM KV-connector plugin that tiers the KV cache to CPU
DRAM, NVMe, S3 and Mooncake: check a kv_connector_extra_config before deploying it, size the KV
cache of a model tier by tier, run the pre-deployment checklist on this machine, and run the
benchmarks of a source checkout. 'kvtier COMMAND --help' explains each command, with examples."""

_EPILOG = """\
examples:
  kvtier presets
  kvtier check-config '{"preset": "interactive", "cpu": {"capacity_bytes": 34359738368}}'
  kvtier plan --model-config ./Llama-3-70B/config.json --context-tokens 128K --kv-dtype fp8
  kvtier doctor --preset interactive --model-config ./config.json --context-tokens 32K --ttft-slo-s 2
  kvtier bench --quick

exit status: 0 when all is well, 1 when doctor or bench found a FAIL, 2 when the input is bad
(the message names the field, option or file)."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtier", description=_DESCRIPTION, epilog=_EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    configs.add_presets(sub)
    configs.add_check_config(sub)
    plan.add_command(sub)
    doctor.add_command(sub)
    bench.add_command(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`kvtier plan ... --json | head`): stop quietly. Point stdout
        # at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "presets":
        return configs.run_presets(args)
    if args.cmd in ("plan", "doctor", "bench"):
        run = {"plan": plan.run, "doctor": doctor.run, "bench": bench.run}[args.cmd]
        try:
            return run(args)
        except (PlanInputError, ConfigError) as e:
            print(f"kvtier {args.cmd}: {e}", file=sys.stderr)
            return 2
    return configs.run_check_config(args)
