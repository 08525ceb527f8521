from __future__ import annotations

import subprocess
import sys

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
    assert "interactive" in out.split()
