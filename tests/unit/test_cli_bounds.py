"""Files the ``kvtier`` commands read: each read is bounded, and bad input gets a one-line
error naming the file (and the field or line), never a hang, a traceback or an OOM kill.

The bounded-read tests run the CLI in a subprocess with its address space capped
(``RLIMIT_AS``), so a read without a bound fails the test instead of exhausting the machine,
and with a timeout, so a read that waits on a FIFO fails it too.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The CLI needs well under this; reading /dev/zero or a 10 GiB file into memory does not fit.
ADDRESS_SPACE_BYTES = 768 << 20


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vllm_kvtier.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, preexec_fn=_cap_memory)


@pytest.fixture(params=["dev-zero", "sparse-10GiB", "fifo"])
def bad_file(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str]:
    """A path no bounded read accepts, and the words the error must hold."""
    if request.param == "dev-zero":
        return Path("/dev/zero"), "not a regular file"
    if request.param == "fifo":
        p = tmp_path / "pipe.yaml"
        os.mkfifo(p)  # no writer: an open without O_NONBLOCK waits forever
        return p, "not a regular file"
    p = tmp_path / "big.json"
    with open(p, "wb") as f:
        f.truncate(10 << 30)  # sparse: no disk used
    return p, "limit"


COMMANDS = {
    "doctor --prometheus-rules": (["doctor", "--preset", "interactive", "--gpu-kv-bytes", "10GB",
                                   "--prometheus-rules"], 1),
    "check-config --file": (["check-config", "--file"], 2),
    "plan --model-config": (["plan", "--context-tokens", "1K", "--model-config"], 2),
    "plan --trace": (["plan", "--cpu-blocks", "10", "--trace"], 2),
    "doctor --file": (["doctor", "--gpu-kv-bytes", "10GB", "--file"], 2),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_file_the_cli_reads_is_bounded(command: str, bad_file: tuple[Path, str]) -> None:
    argv, rc = COMMANDS[command]
    path, words = bad_file
    out = _kvtier(*argv, str(path))
    assert out.returncode == rc, out.stderr
    assert "Traceback" not in out.stderr and "MemoryError" not in out.stderr
    error = [line for line in (out.stdout + out.stderr).splitlines() if str(path) in line]
    assert len(error) == 1 and words in error[0], out.stdout + out.stderr


def test_a_benchmark_result_is_read_with_a_bound(tmp_path: Path) -> None:
    """``kvtier bench --report-only`` reads the results directory's JSONs."""
    big = tmp_path / "cpu_tier_throughput.json"
    with open(big, "wb") as f:
        f.truncate(10 << 30)
    out = _kvtier("bench", "--report-only", "--results-dir", str(tmp_path), "cpu_tier_throughput")
    assert "Traceback" not in out.stderr and "MemoryError" not in out.stderr, out.stderr
    assert f"{big} is larger than the 64 MiB limit" in out.stdout


def test_deeply_nested_alert_rules_are_a_fail_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kvtier.cli import main

    rules = tmp_path / "rules.yaml"
    rules.write_text("[" * 100_000)
    assert main(["doctor", "--preset", "interactive", "--gpu-kv-bytes", "10GB", "--prometheus-rules", str(rules)]) == 1
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("FAIL  alerting")]
    assert str(rules) in line and ("nested" in line or "recursion" in line)
