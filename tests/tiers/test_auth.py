"""Where the auth key comes from (``auth`` section, vllm_kvtier.tiers.auth.load_auth): the
environment or a mounted secret, never the config; every bad key a clear ConfigError that
names the field or variable and never quotes the key. The MAC itself is proven for every
medium by the contract suite (tests/tiers/contract.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from vllm_kvtier.config import AuthConfig, parse_config
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.tiers.auth import ChunkAuth, load_auth

KEY_HEX = "8f" * 32


def test_key_from_the_default_environment_variable(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vllm_kvtier.tiers.auth"):
        auth = load_auth(AuthConfig(), {"KVTIER_AUTH_KEY": f" {KEY_HEX[:40]}\n{KEY_HEX[40:]} "})
    assert isinstance(auth, ChunkAuth) and auth.key_id == ChunkAuth(bytes.fromhex(KEY_HEX)).key_id
    assert KEY_HEX not in repr(auth) and KEY_HEX not in caplog.text
    assert auth.key_id.hex() in caplog.text  # the id is what is logged


def test_no_key_is_unauthenticated_unless_required() -> None:
    assert load_auth(AuthConfig(), {}) is None
    assert load_auth(AuthConfig(), {"KVTIER_AUTH_KEY": "  "}) is None
    with pytest.raises(ConfigError, match="auth.required.*KVTIER_AUTH_KEY"):
        load_auth(AuthConfig(required=True), {})
    with pytest.raises(ConfigError, match="auth.required.*MY_KEY"):
        load_auth(AuthConfig(key_env="MY_KEY", required=True), {"KVTIER_AUTH_KEY": KEY_HEX})


@pytest.mark.parametrize("value", ["ab" * 31, "zz" * 32, "abc"])
def test_bad_keys_name_the_variable_and_never_quote_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match="MY_KEY") as e:
        load_auth(AuthConfig(key_env="MY_KEY"), {"MY_KEY": value})
    assert value not in str(e.value)


def test_key_file(tmp_path: Path) -> None:
    p = tmp_path / "key"
    p.write_text(KEY_HEX + "\n")
    p.chmod(0o600)
    auth = load_auth(AuthConfig(key_file=str(p)), {"KVTIER_AUTH_KEY": "11" * 32})
    assert auth is not None and auth.key_id == ChunkAuth(bytes.fromhex(KEY_HEX)).key_id  # the file wins
    p.chmod(0o644)
    with pytest.raises(ConfigError, match="auth.key_file.*group or other"):
        load_auth(AuthConfig(key_file=str(p)), {})
    assert load_auth(AuthConfig(key_file=str(p), allow_readable_key_file=True), {}) is not None
    with pytest.raises(ConfigError, match="auth.key_file"):
        load_auth(AuthConfig(key_file=str(tmp_path / "missing")), {})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="auth.key_file.*not a regular file"):
        load_auth(AuthConfig(key_file=str(fifo)), {})  # never waits for a writer
    big = tmp_path / "big"
    big.write_text("ab" * 100_000)
    big.chmod(0o600)
    with pytest.raises(ConfigError, match="auth.key_file.*larger"):
        load_auth(AuthConfig(key_file=str(big)), {})


def test_auth_section_is_parsed_and_validated() -> None:
    cfg = parse_config({"auth": {"key_env": "FLEET_KEY", "required": True, "local_tiers": True}})
    assert cfg.auth == AuthConfig(key_env="FLEET_KEY", required=True, local_tiers=True)
    with pytest.raises(ConfigError, match="auth.key"):
        parse_config({"auth": {"key": KEY_HEX}})  # no field for the key itself
    with pytest.raises(ConfigError, match="auth.key_file"):
        parse_config({"auth": {"key_file": "relative/key"}})
    with pytest.raises(ConfigError, match="auth.key_env"):
        parse_config({"auth": {"key_env": "NOT A NAME"}})
