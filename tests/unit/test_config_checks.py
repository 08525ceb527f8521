"""What ``check-config`` and ``doctor`` refuse before an engine would: a key file that is
missing, and a weights digest cache directory relative to each process's working directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_kvtier.cli import main
from vllm_kvtier.config import parse_config
from vllm_kvtier.errors import ConfigError


def test_check_config_and_doctor_fail_a_missing_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-key"
    extra = json.dumps({"auth": {"key_file": str(missing)}})
    assert main(["check-config", extra]) == 2
    err = capsys.readouterr().err
    assert "auth.key_file" in err and str(missing) in err
    assert main(["doctor", extra, "--gpu-kv-bytes", "10GB"]) == 1
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "auth.key_file" in ln]
    assert line.startswith("FAIL") and str(missing) in line
    key = tmp_path / "key"
    key.write_text("ab" * 32)
    key.chmod(0o600)
    ok = json.dumps({"auth": {"key_file": str(key)}})
    assert main(["check-config", ok]) == 0
    assert main(["doctor", ok, "--gpu-kv-bytes", "10GB"]) in (0, 1)
    assert any(ln.startswith("PASS") and "auth-keys" in ln for ln in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("value", ["cache", "./cache", "../x/cache"])
def test_a_relative_weights_digest_cache_dir_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="weights_digest_cache_dir"):
        parse_config({"weights_digest_cache_dir": value})


@pytest.mark.parametrize("value", ["auto", "", "/var/cache/kvtier", "~/.cache/kvtier"])
def test_an_absolute_weights_digest_cache_dir_is_accepted(value: str) -> None:
    assert parse_config({"weights_digest_cache_dir": value}).weights_digest_cache_dir == value
