"""Every workload preset of the brief's table ships, documents itself, and parses with the
fields it says the operator must add; each makes the decisions it documents."""

from __future__ import annotations

import pytest

from vllm_kvtier.cli import main as cli_main
from vllm_kvtier.config import PRESET_DIR, available_presets, parse_config
from vllm_kvtier.errors import ConfigError

#: preset -> what the operator must add (as its header says)
REQUIRED = {
    "interactive": {},
    "long-context": {},
    "shared-prompt": {},
    "offline-batch": {"s3": {"bucket": "kv-batch", "endpoint_url": "http://127.0.0.1:9000", "path_style": True}},
    "pd-disagg": {"mooncake": {"master": "127.0.0.1:50051"}},
}


def test_the_five_presets_ship_with_a_header():
    assert set(available_presets()) == set(REQUIRED)
    for name in REQUIRED:
        text = (PRESET_DIR / f"{name}.yaml").read_text()
        assert text.startswith(f'# Preset "{name}":'), name
        assert "Decisions this preset makes for you" in text or name == "interactive"


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_preset_parses_with_its_required_fields(name):
    cfg = parse_config({"preset": name, **REQUIRED[name]})
    assert cfg.preset == name
    assert cli_main(["check-config", f'{{"preset": "{name}"}}']) == (0 if not REQUIRED[name] else 2)


def test_presets_make_their_documented_choices():
    inter = parse_config({"preset": "interactive"})
    assert inter.nvme is None and inter.s3 is None and inter.load_mode == "sync"
    lc = parse_config({"preset": "long-context"})
    assert lc.nvme is not None and lc.nvme.admit_min_seen == 2 and lc.s3 is None
    ob = parse_config({"preset": "offline-batch", **REQUIRED["offline-batch"]})
    assert ob.nvme is not None and ob.s3 is not None and ob.load_mode == "async"
    assert ob.s3.mode == "write-through" and ob.cpu.capacity_fraction == 0.7
    sp = parse_config({"preset": "shared-prompt"})
    assert sp.cpu.eviction == "kvaware" and sp.cpu.max_pinned_fraction == 0.5
    assert sp.cpu.request_pins and sp.cpu.max_pin_ttl_s == 3600  # the preset's point, capped
    assert not inter.cpu.request_pins and not lc.cpu.request_pins and not ob.cpu.request_pins
    pd = parse_config({"preset": "pd-disagg", **REQUIRED["pd-disagg"]})
    assert pd.mooncake is not None and pd.mooncake.mode == "write-through" and pd.mooncake.store.master
    assert pd.mooncake.accept_handoffs


def test_missing_required_fields_are_named():
    with pytest.raises(ConfigError, match="s3.bucket"):
        parse_config({"preset": "offline-batch"})
    with pytest.raises(ConfigError, match="mooncake.master"):
        parse_config({"preset": "pd-disagg"})
    # Inline fields override the preset's, field by field.
    cfg = parse_config({"preset": "long-context", "nvme": {"path": "/mnt/x", "capacity_bytes": 10**9}})
    assert cfg.nvme is not None and cfg.nvme.path == "/mnt/x" and cfg.nvme.chunk_blocks == 32
