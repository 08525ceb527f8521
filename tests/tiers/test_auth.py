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


def test_short_keys_are_refused_by_the_signer_too() -> None:
    with pytest.raises(ValueError):
        ChunkAuth(bytes(31))


def test_signed_header_longer_than_a_page_and_the_buffer_room() -> None:
    """48 blocks: the signed header (101 B per block) outgrows one page where the unsigned
    one (69 B) does not, so a read without a header fetches it in two steps, and a write
    buffer built for the unsigned format is refused (its blocks would sit elsewhere)."""
    from tests.tiers.contract import wait_for
    from vllm_kvtier.chunkformat import header_bytes_for
    from vllm_kvtier.errors import FailureReason
    from vllm_kvtier.tiers.buffers import BufferPool, WriteBuffer
    from vllm_kvtier.tiers.memory import MemoryStore

    n, bb = 48, 512
    assert header_bytes_for(n) == 4096 < header_bytes_for(n, True)
    pool = BufferPool(16 << 20)
    store = MemoryStore("authtest00000000", bb, max_chunk_blocks=64, buffers=pool,
                        auth=ChunkAuth(bytes.fromhex(KEY_HEX)))
    try:
        keys = [bytes([i]) * 32 for i in range(n)]
        for job, signed in ((1, False), (2, True)):
            wb = WriteBuffer(keys, bb, pool, authenticated=signed)
            for i in range(n):
                with wb.block(i) as b:
                    b[:] = bytes([i]) * bb
            assert store.submit_write(job, f"c{job}", wb)
            r = wait_for(store, job)
            assert r.ok is signed and (signed or r.reason is FailureReason.BAD_REQUEST), r.reason
        store.submit_read(3, "c2", None, [47, 0], [keys[47], keys[0]])
        r = wait_for(store, 3)
        assert r.ok and r.blocks is not None and r.header is not None and r.header.header_bytes > 4096, r.reason
        assert [b.tobytes() for b in r.blocks] == [bytes([47]) * bb, bytes(bb)]
        r.release()
    finally:
        store.close()
