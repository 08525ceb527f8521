"""``kvtier bench``: run the scripts under ``bench/``, read their JSONs, render a table and a PNG.

Who calls it: ``vllm_kvtier.cli`` in the operator's shell, one benchmark at a time, loading this
file from the source checkout it runs from (``bench/`` is not in the wheel: an installed package
has no ``kvtier bench``, and the CLI says so). Nothing in the serving path imports this module,
and it imports neither vllm nor torch (the scripts do, in their own processes). The scripts stay
the source of truth: each one prints its own detailed table and writes
``<results dir>/<name>.json``; this module only picks the headline ratio(s) out of each JSON and
judges them against the targets the scripts and docs/benchmarks.md state.

Failure: a script that exits non-zero is reported (its log kept next to the JSONs) and the next
one runs; a missing JSON is "not run"; a JSON without an expected field gives a row with no value,
never an exception.
"""

from __future__ import annotations

import enum
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from vllm_kvtier.config.files import read_small_file

#: A benchmark's result JSON is a few KiB to a few MiB (timelines); larger is not one.
MAX_RESULT_BYTES = 64 << 20

# ---- what each benchmark reports -------------------------------------------------------------


class Verdict(enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    NONE = "—"  # no value (not run, field missing) or no target (reported only)


@dataclass(frozen=True)
class Target:
    """``value <op> bound`` passes; ``op`` is one of ``<=``, ``>=``, ``<``, ``>``."""

    op: str
    bound: float

    def met(self, value: float) -> bool:
        return {"<=": value <= self.bound, ">=": value >= self.bound,
                "<": value < self.bound, ">": value > self.bound}[self.op]

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


@dataclass(frozen=True)
class Metric:
    """One headline figure of a benchmark: ``get`` reads it from the JSON (KeyError when absent)."""

    label: str
    get: Callable[[dict[str, Any]], float]
    target: Target | None = None
    note: str = ""


@dataclass(frozen=True)
class BenchSpec:
    name: str
    about: str
    fast: bool  # run by default (seconds to a minute); the others start vLLM engines (minutes)
    quick_args: tuple[str, ...]  # the script's own options for a smaller run (--quick)
    metrics: tuple[Metric, ...]


@dataclass(frozen=True)
class Row:
    bench: str
    label: str
    value: float | None
    target: Target | None
    note: str = ""

    @property
    def verdict(self) -> Verdict:
        if self.value is None or self.target is None:
            return Verdict.NONE
        return Verdict.PASS if self.target.met(self.value) else Verdict.FAIL


@dataclass(frozen=True)
class Report:
    rows: tuple[Row, ...]
    problems: tuple[str, ...] = ()  # correctness failures the scripts recorded, runs that failed

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.verdict is not Verdict.FAIL for r in self.rows)


def _case(key: str, case: str, field_: str) -> Callable[[dict[str, Any]], float]:
    return lambda d: next(float(c[field_]) for c in d[key] if c["case"] == case)


def _p99_vs_lru(config: str) -> Callable[[dict[str, Any]], float]:
    def get(d: dict[str, Any]) -> float:
        r = d["results"]
        return float(r[config]["summary"]["all"]["ttft_p99_s"] / r["lru"]["summary"]["all"]["ttft_p99_s"])
    return get


def _sys_hits_vs_lru(d: dict[str, Any]) -> float:
    r = d["results"]
    return float(r["s3fifo+pin"]["summary"]["chat"]["sys_hit_total"] / r["lru"]["summary"]["chat"]["sys_hit_total"])


def _fp8_bytes(model: str) -> Callable[[dict[str, Any]], float]:
    def get(d: dict[str, Any]) -> float:
        res = next(r for r in d["results"] if r["model"] == model)
        return float(res["fp8"]["payload_bytes_per_block"] / res["native"]["payload_bytes_per_block"])
    return get


def _nixl_io(tier: str, case: str, ratio: str) -> Callable[[dict[str, Any]], float]:
    return lambda d: next(float(c[ratio]) for c in d[tier]["cases"] if c["case"] == case)


def _max_requests_ratio(d: dict[str, Any]) -> float:
    return max(float(r["ratio_vs_per_block"]) for r in d["requests"])


BENCHMARKS: tuple[BenchSpec, ...] = (
    BenchSpec("cpu_tier_throughput", "CPU tier save/load against a plain torch copy", True,
              ("--repeats", "3", "--warmup", "1"),
              (Metric("CPU tier copy / torch copy (worst case)", lambda d: float(d["worst_ratio"]),
                      Target(">=", 0.8)),)),
    BenchSpec("nvme_throughput", "NVMe tier write/read against dd with O_DIRECT", True,
              ("--total-mib", "256", "--repeats", "3", "--index-blocks", "10000"),
              (Metric("NVMe write / dd", _case("cases", "write", "ratio"), Target(">=", 0.8)),
               Metric("NVMe read / dd", _case("cases", "read", "ratio"), Target(">=", 0.8)))),
    BenchSpec("s3_throughput", "S3 tier store/load and requests against boto3 (local moto server)", True,
              ("--total-mib", "16", "--repeats", "3", "--load-passes", "2"),
              (Metric("S3 store / boto3", _case("throughput", "store", "ratio"), Target(">=", 0.9)),
               Metric("S3 load / boto3", _case("throughput", "load", "ratio"), Target(">=", 0.9)),
               Metric("S3 requests per GiB / one object per block", _max_requests_ratio, Target("<=", 0.1)))),
    BenchSpec("ttft", "TTFT of a long prompt, warm over cold, with vLLM on CPU", False,
              ("--prompt-tokens", "2048", "--repeats", "2"),
              (Metric("TTFT warm (CPU tier) / cold", lambda d: float(d["summary"]["warm_over_cold"]),
                      Target("<=", 0.2)),
               Metric("TTFT cold with plugin / without", lambda d: float(d["summary"]["cold_overhead"]),
                      Target("<=", 1.05)),
               Metric("TTFT warm (NVMe) / cold", lambda d: float(d["summary"]["nvme_warm_over_cold"]),
                      note="reported"))),
    BenchSpec("load_or_recompute", "TTFT with a throttled S3 tier: load-or-recompute against always load", False,
              ("--prompts", "2"),
              (Metric("load-or-recompute auto / always, slow tier", lambda d: float(d["auto_over_always_slow"]),
                      Target("<", 1.0)),
               Metric("load-or-recompute auto / always, fast tier", lambda d: float(d["auto_over_always_fast"]),
                      note="expected ~1"))),
    BenchSpec("trace_replay", "shared prompts, chats and document floods: S3-FIFO against LRU", False,
              ("--requests", "120"),
              (Metric("trace: S3-FIFO p99 TTFT / LRU", _p99_vs_lru("s3fifo"), Target("<", 1.0)),
               Metric("trace: S3-FIFO+pin p99 TTFT / LRU", _p99_vs_lru("s3fifo+pin"), Target("<", 1.0)),
               Metric("trace: S3-FIFO+pin system-prompt hits / LRU", _sys_hits_vs_lru, Target(">", 1.0)))),
    BenchSpec("fp8_drift", "FP8 storage in the NVMe tier: bytes per block and output drift", False,
              ("--models", "tiny", "--prompts", "8"),
              (Metric("FP8 payload bytes / native, bf16 KV", _fp8_bytes("bench"), Target("<=", 0.55)),
               Metric("FP8 payload bytes / native, fp32 KV", _fp8_bytes("tiny"), Target("<=", 0.3)))),
    BenchSpec("pool_throughput", "Mooncake pool tier store/load against plain Mooncake batch calls", False,
              ("--total-mib", "64", "--repeats", "3"),
              (Metric("pool store / plain Mooncake", _case("throughput", "store", "ratio"), Target(">=", 0.8)),
               Metric("pool load / plain Mooncake", _case("throughput", "load", "ratio"), Target(">=", 0.8)))),
    BenchSpec("nixl_throughput", "NIXL block reads (P/D peer path) against raw NIXL transfers", False,
              ("--total-mib", "64", "--repeats", "3"),
              (Metric("NIXL 64 KiB blocks / raw NIXL", _case("throughput", "64KiB", "ratio"), Target(">=", 0.8)),
               Metric("NIXL 2 MiB blocks / raw NIXL", _case("throughput", "2048KiB", "ratio"), Target(">=", 0.8)))),
    BenchSpec("nixl_io", "NIXL as the NVMe and S3 tiers' I/O engine against their defaults", False,
              ("--repeats", "3", "--total-mib", "128", "--s3-total-mib", "16", "--load-passes", "1"),
              (Metric("NVMe nixl engine / posix, write 2 MiB blocks", _nixl_io("nvme", "write/2048KiB", "nixl/posix"),
                      note="reported"),
               Metric("NVMe nixl engine / posix, read 2 MiB blocks", _nixl_io("nvme", "read/2048KiB", "nixl/posix"),
                      note="reported"),
               Metric("S3 nixl engine / boto3, store", _nixl_io("s3", "store", "nixl/boto3"), note="reported"),
               Metric("S3 nixl engine / boto3, load", _nixl_io("s3", "load", "nixl/boto3"), note="reported"))),
    BenchSpec("serving", "vLLM's API server driven by vLLM's bench serve and AIPerf multi-turn: plugin / no plugin",
              False, ("--quick",),
              (Metric("serving: request throughput / baseline (prefix repetition)",
                      lambda d: float(d["ratios"]["interactive.prefix-repetition"]["request_throughput"]),
                      Target(">=", 1.0)),
               Metric("serving: worst p99 TTFT / baseline", lambda d: max(
                   float(v["p99_ttft_ms"]) for v in d["ratios"].values()), Target("<=", 1.0)),
               Metric("serving: low-load request throughput / baseline", lambda d: min(
                   float(v["request_throughput"]) for k, v in d["ratios"].items() if k.endswith(".low-load") and not k.startswith("noop.")),
                      Target(">=", 0.98)),
               Metric("serving: low-load mean TTFT / baseline", lambda d: max(
                   float(v["mean_ttft_ms"]) for k, v in d["ratios"].items() if k.endswith(".low-load") and not k.startswith("noop.")),
                      Target("<=", 1.02)))),
    BenchSpec("pd_ttft", "decode-instance TTFT with P/D (Mooncake pool, NIXL peer) against recompute", False,
              ("--prompt-tokens", "2048", "--repeats", "2"),
              (Metric("P/D pool decode TTFT / recompute", lambda d: float(d["summary"]["pd_over_recompute"]),
                      Target("<", 1.0)),
               Metric("P/D NIXL peer decode TTFT / recompute", lambda d: float(d["summary"]["nixl_over_recompute"]),
                      Target("<", 1.0)))),
)
BY_NAME: dict[str, BenchSpec] = {s.name: s for s in BENCHMARKS}
FAST: tuple[str, ...] = tuple(s.name for s in BENCHMARKS if s.fast)


def resolve_names(names: Sequence[str]) -> list[str]:
    """The benchmarks to run, in the registry's order; ``all`` = every one. ValueError names an unknown one."""
    chosen = set(names) if names else set(FAST)
    if "all" in chosen:
        return [s.name for s in BENCHMARKS]
    unknown = sorted(chosen - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown benchmark {unknown[0]!r}; choose from: all, {', '.join(BY_NAME)}")
    return [s.name for s in BENCHMARKS if s.name in chosen]


def find_bench_dir(root: Path | None = None) -> Path | None:
    """``<root>/bench`` when it holds every script (root: the checkout this file is in), else None."""
    root = Path(__file__).resolve().parent.parent if root is None else root
    d = root / "bench"
    return d if all((d / f"{s.name}.py").is_file() for s in BENCHMARKS) else None


# ---- reading the JSONs ----------------------------------------------------------------------


def _problems(name: str, data: dict[str, Any]) -> list[str]:
    out = [f"{name}: {f}" for f in data.get("failures") or []]
    if data.get("tokens_equal") is False:
        out.append(f"{name}: first tokens differ from the run without the plugin")
    if data.get("correctness") not in (None, "ok"):
        out.append(f"{name}: correctness {data['correctness']}")
    return out


def read_report(results_dir: Path, names: Sequence[str], stale: Mapping[str, str] | None = None) -> Report:
    """Rows for ``names`` from ``results_dir/<name>.json``; ``stale`` maps a name to why its JSON is old."""
    rows: list[Row] = []
    problems: list[str] = []
    for name in names:
        spec = BY_NAME[name]
        path = results_dir / f"{name}.json"
        data: dict[str, Any] | None = None
        note = "not run"
        if path.is_file():
            try:
                data = json.loads(read_small_file(path, MAX_RESULT_BYTES))
                if not isinstance(data, dict):
                    data = None
                    raise ValueError("not a JSON object")
                note = ""
            except (OSError, ValueError, RecursionError) as e:
                note = f"unreadable JSON: {e}"
                problems.append(f"{name}: {path}: {note}")
        if data is not None:
            problems += _problems(name, data)
        if stale and name in stale:
            problems.append(f"{name}: {stale[name]}")
            note = "from an earlier run" if data is not None else note
        for m in spec.metrics:
            value, why = None, note
            if data is not None:
                try:
                    value = m.get(data)
                except (KeyError, StopIteration, TypeError, ZeroDivisionError):
                    why = "not in the JSON"
            rows.append(Row(name, m.label, value, m.target, why or m.note))
    return Report(tuple(rows), tuple(problems))


def render_table(report: Report) -> str:
    """The summary table, one row per headline ratio, then the problems the runs recorded."""
    head = ("benchmark", "ratio", "value", "target", "result", "")
    body = [(r.bench, r.label, "-" if r.value is None else f"{r.value:.3f}", str(r.target or "-"),
             r.verdict.value, r.note) for r in report.rows]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]

    def fmt(line: tuple[str, ...]) -> str:
        cells = [c.rjust(w) if i == 2 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        return "  ".join(cells).rstrip()

    out = [fmt(head), "-" * len(fmt(head)), *(fmt(line) for line in body)]
    n = {v: sum(r.verdict is v for r in report.rows) for v in Verdict}
    out.append(f"{n[Verdict.PASS]} pass, {n[Verdict.FAIL]} fail, {n[Verdict.NONE]} without a verdict")
    out += [f"problem: {p}" for p in report.problems]
    return "\n".join(out)


# ---- the PNG ----------------------------------------------------------------------------------

_COLOURS = {Verdict.PASS: (46, 160, 67), Verdict.FAIL: (214, 39, 40), Verdict.NONE: (150, 150, 150)}
_INK, _GRID, _BG = (20, 20, 20), (225, 225, 225), (255, 255, 255)


@dataclass(frozen=True)
class _Layout:
    width: int = 1180
    row_h: int = 34
    top: int = 70
    label_w: int = 400
    plot_w: int = 460
    gap: int = 14
    bottom: int = 60
    x_max: float = 1.5
    rows: int = 0

    @property
    def x0(self) -> int:
        return self.label_w + self.gap

    def x(self, v: float) -> int:
        return self.x0 + round(self.plot_w * min(max(v, 0.0), self.x_max) / self.x_max)

    @property
    def height(self) -> int:
        return self.top + self.rows * self.row_h + self.bottom


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # FreeType: a scalable font shipped with Pillow
    except (TypeError, ValueError, OSError, ImportError):
        return ImageFont.load_default()


def _fit(draw: Any, text: str, font: Any, width: int) -> str:
    """``text``, cut to ``width`` pixels with "..." when it is longer."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."


def render_png(report: Report, path: Path, title: str = "kvtier bench: ours / reference") -> Path:
    """A horizontal bar per row (colour = verdict), the target as a black tick, the value and verdict on the right."""
    from PIL import Image, ImageDraw

    top_value = max([r.value for r in report.rows if r.value is not None]
                    + [r.target.bound for r in report.rows if r.target is not None] + [1.0])
    x_max = 1.5 if top_value <= 1.4 else top_value * 1.1
    lay = _Layout(rows=len(report.rows), x_max=x_max)
    img = Image.new("RGB", (lay.width, lay.height), _BG)
    draw = ImageDraw.Draw(img)
    font, small, big = _font(15), _font(12), _font(20)
    draw.text((16, 16), title, fill=_INK, font=big)
    bottom_y = lay.top + lay.rows * lay.row_h
    step = 0.25 if x_max <= 2 else (0.5 if x_max <= 5 else float(round(x_max / 5)))
    tick = 0.0
    while tick <= x_max + 1e-9:
        x = lay.x(tick)
        draw.line([(x, lay.top - 6), (x, bottom_y)], fill=_GRID)
        draw.text((x, bottom_y + 6), f"{tick:g}", fill=_INK, font=small, anchor="mt")
        tick += step
    for i, r in enumerate(report.rows):
        y = lay.top + i * lay.row_h
        mid = y + lay.row_h // 2
        if i and r.bench != report.rows[i - 1].bench:  # a rule between benchmarks
            draw.line([(16, y), (lay.width - 16, y)], fill=_GRID)
        draw.text((16, mid), _fit(draw, r.label, font, lay.label_w - 20), fill=_INK, font=font, anchor="lm")
        if r.value is None:
            draw.text((lay.x0 + 6, mid), r.note or "no value", fill=_COLOURS[Verdict.NONE], font=font, anchor="lm")
        else:
            draw.rectangle([(lay.x0, y + 7), (max(lay.x(r.value), lay.x0 + 2), y + lay.row_h - 7)],
                           fill=_COLOURS[r.verdict])
            if r.value > x_max:  # clipped: say so with an arrow head
                draw.polygon([(lay.x(x_max), y + 7), (lay.x(x_max) + 8, mid), (lay.x(x_max), y + lay.row_h - 7)],
                             fill=_COLOURS[r.verdict])
        if r.target is not None:
            tx = lay.x(r.target.bound)
            draw.line([(tx, y + 3), (tx, y + lay.row_h - 3)], fill=_INK, width=3)
        value = "-" if r.value is None else f"{r.value:.3f}"
        right = f"{value}   target {r.target}" if r.target else f"{value}   (no target)"
        xr = lay.x0 + lay.plot_w + 24
        draw.text((xr, mid), right, fill=_INK, font=font, anchor="lm")
        draw.text((lay.width - 16, mid), r.verdict.value if r.verdict is not Verdict.NONE else "-",
                  fill=_COLOURS[r.verdict], font=font, anchor="rm")
    legend = "bar: measured ratio (green PASS, red FAIL, grey no target)    black tick: target"
    draw.text((16, lay.height - 22), legend, fill=_INK, font=small, anchor="lm")
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format="PNG")
    return path


# ---- running the scripts ------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOutcome:
    name: str
    returncode: int
    elapsed_s: float
    log_path: Path
    wrote_json: bool

    @property
    def failure(self) -> str | None:
        """Why this run's figures are not to be trusted, or None."""
        if not self.wrote_json:
            return f"the script wrote no JSON (exit {self.returncode}); see {self.log_path}"
        if self.returncode != 0:
            return f"the script exited {self.returncode}; see {self.log_path}"
        return None


def bench_command(spec: BenchSpec, bench_dir: Path, json_path: Path, quick: bool) -> list[str]:
    """The same Python as this process, unbuffered, the script's own quick options, its JSON redirected."""
    return [sys.executable, "-u", str(bench_dir / f"{spec.name}.py"), *(spec.quick_args if quick else ()),
            "--json", str(json_path)]


def _pump(stream: TextIO, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_benchmark(spec: BenchSpec, bench_dir: Path, results_dir: Path, *, quick: bool, index: int, total: int,
                  out: TextIO, live: bool) -> RunOutcome:
    """Run one script to completion, its output to ``<results_dir>/<name>.log``.

    ``live`` (a terminal): one status line rewritten in place every half second (index/total, elapsed,
    the script's last line). Otherwise every line of the script's output is echoed, indented. Blocks
    until the script exits; Ctrl-C terminates it.
    """
    results_dir.mkdir(parents=True, exist_ok=True)
    json_path, log_path = results_dir / f"{spec.name}.json", results_dir / f"{spec.name}.log"
    cmd = bench_command(spec, bench_dir, json_path, quick)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING", **os.environ,
           "PYTHONUNBUFFERED": "1"}
    tag = f"[{index}/{total}] {spec.name}"
    out.write(f"{tag}: {shlex.join(cmd)}\n" if not live else f"{tag}: running, log {log_path}\n")
    out.flush()
    start_wall, t0, last = time.time(), time.monotonic(), ""
    tail: deque[str] = deque(maxlen=12)  # shown when a live run fails: the error is at the end
    lines: queue.Queue[str | None] = queue.Queue()
    # Its own session, so that Ctrl-C here can end the script and the engines it starts, and nothing else.
    with open(log_path, "w") as log, subprocess.Popen(cmd, cwd=bench_dir.parent, env=env, stdout=subprocess.PIPE,
                                                        stderr=subprocess.STDOUT, text=True, bufsize=1,
                                                        start_new_session=True) as proc:
        assert proc.stdout is not None
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        try:
            while True:
                try:
                    line = lines.get(timeout=0.5)
                except queue.Empty:
                    line = ""
                if line is None:
                    break
                if line:
                    log.write(line)
                    tail.append(line)
                    last = line.strip() or last
                    if not live:
                        out.write(f"    {line}")
                if live:
                    status = f"{tag} {time.monotonic() - t0:5.0f} s | {last}"
                    out.write("\r\x1b[K" + status[:_columns() - 1])
                out.flush()
            rc = proc.wait()
        except BaseException:
            _stop(proc)
            raise
    elapsed = time.monotonic() - t0
    wrote = json_path.is_file() and json_path.stat().st_mtime >= start_wall - 1
    outcome = RunOutcome(spec.name, rc, elapsed, log_path, wrote)
    if live:
        out.write("\r\x1b[K")
        if outcome.failure:
            out.writelines(f"    {line}" for line in tail)
    out.write(f"{tag}: {'done' if outcome.failure is None else 'FAILED'} in {elapsed:.1f} s"
              + (f" ({outcome.failure})" if outcome.failure else "") + "\n")
    out.flush()
    return outcome


def _stop(proc: subprocess.Popen[str]) -> None:
    """End the script's process group (the script and what it started), politely, then not."""
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _columns() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 120
