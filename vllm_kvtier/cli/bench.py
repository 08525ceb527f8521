"""``kvtier bench``: the benchmark scripts of a source checkout (``bench/``, not in the
wheel), run one after the other, and their report."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from vllm_kvtier.cli.options import subcommand
from vllm_kvtier.ops.units import PlanInputError

#: ``kvtier bench``'s report module, in the source checkout beside the package: ``bench/`` holds the
#: scripts and their report and is not in the wheel.
BENCH_REPORT = Path(__file__).resolve().parents[2] / "bench" / "benchreport.py"


def _no_bench() -> str:
    return (f"no source checkout here ({BENCH_REPORT} is missing; bench/ is not in the wheel): kvtier bench "
            "runs the benchmark scripts of a checkout, so clone the repository and pip install -e . there")


def _bench_report() -> ModuleType | None:
    """``bench/benchreport.py`` of the checkout this package runs from, loaded once under the name
    the tests and scripts import it by (``bench.benchreport``); None when there is no checkout."""
    if not BENCH_REPORT.is_file():
        return None
    name = "bench.benchreport"
    mod = sys.modules.get(name)
    if mod is not None and Path(mod.__file__ or "").resolve() == BENCH_REPORT:
        return mod
    spec = importlib.util.spec_from_file_location(name, BENCH_REPORT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


_BENCH_EXAMPLES = (
    "  kvtier bench                             # the fast ones, a minute or two\n"
    "  kvtier bench --quick                     # the same, smaller sizes, a few seconds each\n"
    "  kvtier bench all                         # every benchmark (tens of minutes on CPU)\n"
    "  kvtier bench ttft trace_replay --quick\n"
    "  kvtier bench --report-only               # just the table and chart from bench/results\n"
    "  kvtier bench --report-only --results-dir /tmp/r --png /tmp/r/chart.png")


def add_command(sub: Any) -> None:
    br = _bench_report()
    if br is None:  # an installed wheel: the command is listed, and says why it cannot run
        b = subcommand(sub, "bench", "run the benchmarks under bench/ (a source checkout's; none here)",
                       _no_bench(), _BENCH_EXAMPLES)
    else:
        listing = "\n".join(f"  {s.name:<20} {s.about}{'' if s.fast else ' (minutes)'}" for s in br.BENCHMARKS)
        b = subcommand(sub, "bench", "run the benchmarks under bench/ and chart their ratios against the targets",
                       "Runs the benchmark scripts of a source checkout (bench/ is not in the wheel) one after the\n"
                       "other, each as a subprocess of this Python, with a progress line each (the script's own\n"
                       "output goes to <results-dir>/<name>.log). Then reads their JSONs and prints one row per\n"
                       "headline ratio (ours over the reference) with its target and PASS / FAIL / — (no target,\n"
                       "or not run), and draws the same ratios as a PNG bar chart. Compare ratios of one run: the\n"
                       "absolute figures depend on the machine and its load.\n\n"
                       f"benchmarks (default: {', '.join(br.FAST)};\n'all' runs every one, with those that start vLLM "
                       "engines):\n" + listing,
                       _BENCH_EXAMPLES)
    b.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: the fast ones; 'all')")
    b.add_argument("--quick", action="store_true",
                   help="pass each script its smaller-size options (fewer repeats, fewer MiB or tokens)")
    b.add_argument("--results-dir", metavar="DIR", help="where the JSONs and logs go (default: bench/results)")
    b.add_argument("--png", metavar="FILE", help="the chart (default: <results-dir>/summary.png)")
    b.add_argument("--report-only", action="store_true",
                   help="run nothing: render the table and chart from the JSONs already there (default: all of them)")


def run(args: argparse.Namespace) -> int:
    br = _bench_report()
    if br is None:
        print(f"kvtier bench: {_no_bench()}", file=sys.stderr)
        return 2
    try:
        # A report of what is there covers every benchmark (missing ones read "not run").
        names = br.resolve_names(args.names or (["all"] if args.report_only else []))
    except ValueError as e:
        raise PlanInputError("NAME", str(e)) from None
    bench_dir = br.find_bench_dir()
    if bench_dir is None and not (args.report_only and args.results_dir):
        print(f"kvtier bench: not every benchmark script is in {BENCH_REPORT.parent}: kvtier bench runs them "
              "from a source checkout (bench/ is not in the wheel), or renders JSONs you have with "
              "--report-only --results-dir DIR", file=sys.stderr)
        return 2
    if args.results_dir:
        results_dir = Path(args.results_dir)
    else:
        assert bench_dir is not None
        results_dir = bench_dir / "results"
    if args.report_only and not results_dir.is_dir():
        raise PlanInputError("--results-dir", f"no such directory: {results_dir}")
    try:
        results_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlanInputError("--results-dir", f"cannot create {results_dir}: {e.strerror}") from None
    stale: dict[str, str] = {}
    if not args.report_only:
        assert bench_dir is not None
        live = sys.stdout.isatty()
        for i, name in enumerate(names, 1):
            outcome = br.run_benchmark(br.BY_NAME[name], bench_dir, results_dir, quick=args.quick, index=i,
                                       total=len(names), out=sys.stdout, live=live)
            if outcome.failure:
                stale[name] = outcome.failure
        print()
    report = br.read_report(results_dir, names, stale)
    print(br.render_table(report))
    png = br.render_png(report, Path(args.png) if args.png else results_dir / "summary.png")
    print(f"chart: {png}")
    return 0 if report.ok else 1
