from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vllm_kvtier.cli import main


def test_check_config_ok_and_bad(capsys):
    assert main(["check-config", '{"preset": "interactive", "cpu": {"capacity_bytes": 1024}}']) == 0
    assert "capacity_bytes: 1024" in capsys.readouterr().out
    assert main(["check-config", '{"cpu": {"capacity_bytes": -1}}']) == 2
    assert "cpu.capacity_bytes" in capsys.readouterr().err
    assert main(["check-config", "{not json"]) == 2


def test_presets_listed_by_installed_script():
    out = subprocess.run([sys.executable, "-m", "vllm_kvtier.cli", "presets"], capture_output=True,
                         text=True, check=True).stdout
    rows = dict(line.split(None, 1) for line in out.splitlines())
    assert rows["interactive"] == "chatbots and agents with a TTFT target under a second"
    assert rows["long-context"].startswith("long documents and agent traces")
    assert all(rows.values()) and "Preset" not in out


def test_version():
    from vllm_kvtier import __version__

    out = subprocess.run([sys.executable, "-m", "vllm_kvtier.cli", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"kvtier {__version__}"


def test_a_closed_pipe_ends_without_a_traceback():
    """`kvtier plan ... --json | head`: the reader is gone before the output is written."""
    trace = str(Path(__file__).parent / "data" / "mooncake_conversation_first500.jsonl")
    p = subprocess.Popen([sys.executable, "-m", "vllm_kvtier.cli", "plan", "--trace", trace, "--cpu-blocks", "30",
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # nobody reads: the first write fails with EPIPE
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_check_config_of_a_json_array_is_a_usage_error(capsys):
    """Valid JSON that is not an object: exit 2 with a message naming the field, no traceback."""
    assert main(["check-config", "[1, 2]"]) == 2
    err = capsys.readouterr().err
    assert "kv_connector_extra_config" in err and "Traceback" not in err


def test_files_that_are_not_small_regular_files_are_refused(tmp_path, capsys):
    """A device or a FIFO given as a model config or a config file is refused at once:
    /dev/zero used to be read until the process was killed, and a FIFO blocks an open()."""
    import os

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        assert main(["plan", "--model-config", path, "--context-tokens", "1K"]) == 2
        assert "not a regular file" in capsys.readouterr().err
        assert main(["check-config", "--file", path]) == 2
        assert "config_file" in capsys.readouterr().err
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (5 << 20))
    assert main(["plan", "--model-config", str(big), "--context-tokens", "1K"]) == 2
    assert "larger than" in capsys.readouterr().err


def test_check_config_warns_when_the_cpu_budget_exceeds_this_machine(capsys):
    """A budget this machine cannot hold is a warning (the config may be for a bigger
    machine; an engine here refuses to start with the same sentence), still exit 0."""
    assert main(["check-config", '{"cpu": {"capacity_bytes": 1125899906842624}}']) == 0
    err = capsys.readouterr().err
    assert "warning: cpu.capacity_bytes" in err and "refuse to start" in err
    assert main(["check-config", '{"cpu": {"capacity_bytes": 1048576}}']) == 0
    assert "warning" not in capsys.readouterr().err


def test_check_config_takes_the_whole_kv_transfer_config(capsys):
    pasted = ('{"kv_connector":"KVTierConnector","kv_role":"kv_both","kv_load_failure_policy":"recompute",'
              '"kv_connector_extra_config":{"preset":"interactive","cpu":{"capacity_bytes":"1GiB"}}}')
    assert main(["check-config", pasted]) == 0
    out, err = capsys.readouterr()
    assert "capacity_bytes: 1073741824" in out and "preset: interactive" in out and err == ""
    assert main(["check-config", '{"kv_connector":"KVTierConnector","kv_connector_extra_config":{}}']) == 0
    assert "kv_load_failure_policy is 'fail'" in capsys.readouterr().err
    assert main(["check-config", '{"kv_connector":"LMCacheConnectorV1"}']) == 2
    assert "kv_connector" in capsys.readouterr().err


def test_check_config_takes_a_preset(capsys):
    assert main(["check-config", "--preset", "long-context", '{"nvme": {"capacity_bytes": "2TB"}}']) == 0
    out = capsys.readouterr().out
    assert "preset: long-context" in out and "capacity_bytes: 2000000000000" in out
