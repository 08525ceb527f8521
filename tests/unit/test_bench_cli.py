"""``kvtier bench``: the summary table and PNG from result JSONs, one real run, and the help texts.

The synthetic JSONs keep the shapes the scripts under bench/ write (fields copied from real
results, trimmed to what matters); the real run goes through the CLI and the script.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from bench.benchreport import BENCHMARKS, BY_NAME, Target, find_bench_dir, read_report, run_benchmark
from vllm_kvtier.cli import main

RED, GREEN = (214, 39, 40), (46, 160, 67)  # the chart's FAIL and PASS bars


def cpu_json(worst: float) -> dict[str, Any]:
    return {"benchmark": "cpu_tier_throughput", "time": "2026-11-29T12:02:01+0000", "correctness": "ok",
            "repeats_done": 10, "target_ratio": 0.8, "worst_ratio": worst, "meets_target": worst >= 0.8,
            "results": [{"case": "save/consecutive", "bytes": 134217728, "ours_gbps": 13.6, "ref_gbps": 15.4,
                         "ratio": 0.885}]}


def nvme_json(write: float, read: float) -> dict[str, Any]:
    case = {"bytes": 2147483648, "ours_MBps": 2303.1, "dd_MBps": 2295.8, "paired_ratio": 1.0}
    return {"benchmark": "nvme_throughput", "o_direct": True,
            "cases": [{**case, "case": "write", "ratio": write}, {**case, "case": "read", "ratio": read},
                      {**case, "case": "write+fill", "ratio": 0.58}],
            "targets": {"write_ratio_ge_0.8": write >= 0.8, "read_ratio_ge_0.8": read >= 0.8}}


def s3_json(store: float, load: float, requests: float) -> dict[str, Any]:
    return {"benchmark": "s3_throughput",
            "throughput": [{"case": "store", "bytes": 67108864, "ours_MBps": 129.9, "boto3_MBps": 93.9,
                            "ratio": store},
                           {"case": "load", "bytes": 67108864, "ours_MBps": 732.1, "boto3_MBps": 804.3,
                            "ratio": load}],
            "requests": [{"case": c, "ours_per_GiB": 128.0, "one_object_per_block_per_GiB": 2048.0,
                          "ratio_vs_per_block": requests} for c in ("store", "load")]}


def ttft_json(warm: float, overhead: float, failures: list[str] | None = None) -> dict[str, Any]:
    return {"prompt_tokens": 4096, "repeats": 3, "targets": {"warm_over_cold": 0.2, "cold_overhead": 1.05},
            "summary": {"warm_over_cold": warm, "cold_overhead": overhead, "nvme_warm_over_cold": 0.03},
            "failures": failures or [], "results": {}}


def trace_json(s3fifo_p99: float, lru_p99: float) -> dict[str, Any]:
    def res(p99: float, sys_hit: float) -> dict[str, Any]:
        return {"summary": {"all": {"requests": 360, "ttft_p99_s": p99}, "chat": {"sys_hit_total": sys_hit}}}
    return {"verdict": {}, "failures": [],
            "results": {"none": res(0.38, 0.74), "lru": res(lru_p99, 0.89), "s3fifo": res(s3fifo_p99, 1.0)}}


def pd_json(pool: float | None, nixl: float | None) -> dict[str, Any]:
    """bench/pd_ttft.py's summary; a path not run (--paths, or a JSON from before NIXL) has no ratio."""
    summary: dict[str, Any] = {"recompute_ttft_median_s": 1.344, "tokens_equal": True}
    if pool is not None:
        summary.update(pd_over_recompute=pool, pool_over_recompute=pool)
    if nixl is not None:
        summary["nixl_over_recompute"] = nixl
    return {"benchmark": "pd_ttft", "summary": summary, "failures": []}


def write(d: Path, name: str, data: dict[str, Any]) -> None:
    (d / f"{name}.json").write_text(json.dumps(data))


def rows(out: str) -> dict[str, list[str]]:
    """The table's rows by ratio label: [value, target, result, note...] (cells are 2+ spaces apart)."""
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if len(cells) >= 5 and cells[0] in {s.name for s in BENCHMARKS}:
            found[cells[1]] = cells[2:]
    return found


def report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, Path]:
    png = tmp_path / "chart.png"
    rc = main(["bench", "--report-only", "--results-dir", str(tmp_path), "--png", str(png)])
    return rc, capsys.readouterr().out, png


def test_report_only_table_verdicts_and_not_run(tmp_path, capsys):
    write(tmp_path, "cpu_tier_throughput", cpu_json(0.664))
    write(tmp_path, "nvme_throughput", nvme_json(1.003, 0.837))
    write(tmp_path, "s3_throughput", s3_json(1.38, 0.85, 0.0625))
    write(tmp_path, "ttft", ttft_json(0.028, 1.06))
    write(tmp_path, "trace_replay", trace_json(0.30, 0.37))
    rc, out, _ = report(tmp_path, capsys)
    assert rc == 1  # a FAIL
    r = rows(out)
    assert r["CPU tier copy / torch copy (worst case)"][:3] == ["0.664", ">= 0.8", "FAIL"]
    assert r["NVMe write / dd"][:3] == ["1.003", ">= 0.8", "PASS"]
    assert r["NVMe read / dd"][2] == "PASS"
    assert r["S3 store / boto3"][2] == "PASS"
    assert r["S3 load / boto3"][:3] == ["0.850", ">= 0.9", "FAIL"]
    assert r["S3 requests per GiB / one object per block"][:3] == ["0.062", "<= 0.1", "PASS"]
    assert r["TTFT warm (CPU tier) / cold"][2] == "PASS"
    assert r["TTFT cold with plugin / without"][:3] == ["1.060", "<= 1.05", "FAIL"]
    assert r["TTFT warm (NVMe) / cold"][2] == "—"  # reported, no target
    assert r["trace: S3-FIFO p99 TTFT / LRU"][:3] == [f"{0.30 / 0.37:.3f}", "< 1", "PASS"]
    assert r["trace: S3-FIFO+pin p99 TTFT / LRU"] == ["-", "< 1", "—", "not in the JSON"]  # config not run
    for label in ("load-or-recompute auto / always, slow tier", "FP8 payload bytes / native, bf16 KV"):
        assert r[label][0] == "-" and r[label][2] == "—" and r[label][-1] == "not run"
    assert len(r) == sum(len(s.metrics) for s in BENCHMARKS)  # every benchmark has its rows
    assert "3 fail" in out


def test_report_only_all_pass_exits_0_and_failures_are_problems(tmp_path, capsys):
    write(tmp_path, "cpu_tier_throughput", cpu_json(0.8))  # the bound itself passes (>=)
    write(tmp_path, "ttft", ttft_json(0.2, 1.0))
    rc, out, png = report(tmp_path, capsys)
    assert rc == 0, out
    assert "FAIL" not in out
    with Image.open(png) as img:
        assert RED not in {c for _, c in img.convert("RGB").getcolors(1 << 20) or []}

    write(tmp_path, "ttft", ttft_json(0.2, 1.0, failures=["kvtier: warm tokens differ from cold"]))
    rc, out, _ = report(tmp_path, capsys)
    assert rc == 1
    assert "problem: ttft: kvtier: warm tokens differ from cold" in out


def test_pd_ttft_has_a_row_per_path(tmp_path, capsys):
    write(tmp_path, "pd_ttft", pd_json(0.067, 1.2))
    rc, out, _ = report(tmp_path, capsys)
    r = rows(out)
    assert rc == 1
    assert r["P/D pool decode TTFT / recompute"][:3] == ["0.067", "< 1", "PASS"]
    assert r["P/D NIXL peer decode TTFT / recompute"][:3] == ["1.200", "< 1", "FAIL"]

    write(tmp_path, "pd_ttft", pd_json(0.067, None))  # --paths pool
    _, out, _ = report(tmp_path, capsys)
    r = rows(out)
    assert r["P/D pool decode TTFT / recompute"][2] == "PASS"
    assert r["P/D NIXL peer decode TTFT / recompute"] == ["-", "< 1", "—", "not in the JSON"]


def test_broken_json_is_a_row_not_a_crash(tmp_path, capsys):
    (tmp_path / "nvme_throughput.json").write_text("{not json")
    write(tmp_path, "s3_throughput", {"benchmark": "s3_throughput", "throughput": []})
    rc, out, _ = report(tmp_path, capsys)
    r = rows(out)
    assert rc == 1  # a result that cannot be read is a problem
    assert r["NVMe write / dd"][-1].startswith("unreadable JSON")
    assert "problem: nvme_throughput" in out
    assert r["S3 store / boto3"][-1] == "not in the JSON"


def test_png_chart_is_drawn(tmp_path, capsys):
    write(tmp_path, "cpu_tier_throughput", cpu_json(0.5))
    write(tmp_path, "nvme_throughput", nvme_json(1.0, 0.9))
    rc, _, png = report(tmp_path, capsys)
    assert rc == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as img:
        img.load()
        assert img.format == "PNG" and img.width > 400 and img.height > 300
        colours = dict((c, n) for n, c in img.convert("RGB").getcolors(1 << 20) or [])
    assert len(colours) > 10  # text, bars, rules: not a blank canvas
    assert colours.get(RED, 0) > 500  # the CPU tier's FAIL bar
    assert colours.get(GREEN, 0) > 1000  # the two NVMe PASS bars


def test_targets_compare_at_the_bound():
    assert Target(">=", 0.8).met(0.8) and not Target(">=", 0.8).met(0.799)
    assert Target("<", 1.0).met(0.99) and not Target("<", 1.0).met(1.0)
    assert Target("<=", 0.1).met(0.1) and Target(">", 1.0).met(1.01) and not Target(">", 1.0).met(1.0)


def test_bad_input_exits_2(tmp_path, capsys):
    assert main(["bench", "no_such_bench", "--report-only", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no_such_bench" in err and "cpu_tier_throughput" in err
    assert main(["bench", "--report-only", "--results-dir", str(tmp_path / "missing")]) == 2
    assert "--results-dir" in capsys.readouterr().err


def test_bench_scripts_found_in_the_checkout_only(tmp_path):
    found = find_bench_dir()
    assert found is not None and (found / "cpu_tier_throughput.py").is_file()
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "cpu_tier_throughput.py").write_text("")
    assert find_bench_dir(tmp_path) is None  # not every script: not a checkout


def test_a_failing_script_is_reported_with_its_log(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "cpu_tier_throughput.py").write_text(
        "import sys\nprint('argv', sys.argv[1:])\nprint('boom: no device', file=sys.stderr)\nsys.exit(3)\n")
    for live in (False, True):
        out = io.StringIO()
        outcome = run_benchmark(BY_NAME["cpu_tier_throughput"], bench, tmp_path / "r", quick=True, index=1,
                                total=2, out=out, live=live)
        assert outcome.returncode == 3 and not outcome.wrote_json
        assert outcome.failure is not None and "wrote no JSON (exit 3)" in outcome.failure
        log = outcome.log_path.read_text()
        assert "'--repeats', '3'" in log and "boom: no device" in log  # quick options; stderr kept too
        text = out.getvalue()
        assert "[1/2] cpu_tier_throughput" in text and "FAILED" in text
        assert "    boom: no device" in text  # echoed (plain) or the tail shown after the status line (live)
    stale = {"cpu_tier_throughput": outcome.failure}
    rep = read_report(tmp_path / "r", ["cpu_tier_throughput"], stale)
    assert not rep.ok and rep.rows[0].note == "not run"
    assert any("wrote no JSON" in p for p in rep.problems)
    write(tmp_path / "r", "cpu_tier_throughput", cpu_json(0.9))  # an older run's JSON: shown, flagged
    rep = read_report(tmp_path / "r", ["cpu_tier_throughput"], stale)
    assert rep.rows[0].value == 0.9 and rep.rows[0].note == "from an earlier run" and not rep.ok


@pytest.mark.slow  # runs a benchmark in a subprocess (~12 s)
def test_real_run_of_a_cheap_benchmark(tmp_path, capsys):
    rc = main(["bench", "cpu_tier_throughput", "--quick", "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "cpu_tier_throughput.json").read_text())
    assert data["benchmark"] == "cpu_tier_throughput" and data["correctness"] == "ok"
    assert data["args"]["repeats"] == 3  # --quick reached the script
    assert "[1/1] cpu_tier_throughput" in out and "done in" in out
    assert "    worst ratio" in out  # the script's own output, indented
    assert "worst ratio" in (tmp_path / "cpu_tier_throughput.log").read_text()
    row = rows(out)["CPU tier copy / torch copy (worst case)"]
    assert row[:2] == [f"{data['worst_ratio']:.3f}", ">= 0.8"]
    assert row[2] == ("PASS" if data["worst_ratio"] >= 0.8 else "FAIL")  # a shared CPU may miss it
    assert rc == (0 if data["worst_ratio"] >= 0.8 else 1)
    assert (tmp_path / "summary.png").stat().st_size > 0
    # Only the benchmark asked for: the others are not in the table.
    assert "NVMe" not in out


def test_help_lists_every_command_with_examples(capsys):
    out = subprocess.run([sys.executable, "-m", "vllm_kvtier.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    commands = ["presets", "check-config", "plan", "doctor", "bench"]
    for cmd in commands:
        assert f"\n    {cmd}" in out, cmd
    assert "examples:" in out
    for cmd in commands:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert f"usage: kvtier {cmd}" in text and "examples:" in text and f"kvtier {cmd}" in text.split("examples:")[1]
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    bench_help = capsys.readouterr().out
    assert all(s.name in bench_help for s in BENCHMARKS)


def test_without_a_checkout_bench_says_why_and_the_rest_works(tmp_path, monkeypatch, capsys):
    """An installed wheel has no bench/: the command is still listed, every use of it exits 2 naming
    the reason, and the other commands do not depend on it."""
    import vllm_kvtier.cli.bench as bench_cli

    monkeypatch.setattr(bench_cli, "BENCH_REPORT", tmp_path / "bench" / "benchreport.py")
    for argv in (["bench"], ["bench", "--quick", "cpu_tier_throughput"],
                 ["bench", "--report-only", "--results-dir", str(tmp_path)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "source checkout" in err and "not in the wheel" in err, err
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0 and "source checkout" in capsys.readouterr().out
    assert main(["presets"]) == 0 and "interactive" in capsys.readouterr().out


def test_the_wheel_ships_only_the_package():
    """pyproject's package discovery: vllm_kvtier and its subpackages, never the helpers
    (testkit/), the benchmarks (bench/) or the tests."""
    import tomllib

    from setuptools import find_packages

    root = Path(__file__).resolve().parents[2]
    find = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = find_packages(str(root), include=find["include"], exclude=find.get("exclude", ()))
    assert "vllm_kvtier" in shipped and "vllm_kvtier.tiers" in shipped
    assert all(p == "vllm_kvtier" or p.startswith("vllm_kvtier.") for p in shipped), shipped
    assert (root / "testkit" / "tinymodel.py").is_file() and (root / "bench" / "benchreport.py").is_file()
