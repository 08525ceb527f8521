"""Configuration: parsed once, typed and frozen; bad input names the field."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_kvtier.config import KVTierConfig, available_presets, parse_config
from vllm_kvtier.errors import ConfigError


def test_defaults_and_frozen():
    cfg = parse_config({})
    assert cfg == KVTierConfig()
    assert cfg.cpu.capacity_bytes is None and cfg.cpu.capacity_fraction == 0.5
    assert cfg.cpu.eviction == "kvaware" and cfg.cpu.max_pinned_fraction == 0.5
    assert parse_config({"cpu": {"eviction": "lru"}}).cpu.eviction == "lru"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.load_mode = "async"  # type: ignore[misc]


def test_io_engines_default_to_the_plain_ones():
    cfg = parse_config({"nvme": {"path": "/x", "capacity_bytes": 1}, "s3": {"bucket": "kvb"}})
    assert cfg.nvme is not None and cfg.nvme.io_engine == "posix"
    assert cfg.s3 is not None and cfg.s3.store.io_engine == "boto3"
    cfg = parse_config({"nvme": {"path": "/x", "capacity_bytes": 1, "io_engine": "nixl"},
                        "s3": {"bucket": "kvb", "io_engine": "nixl"}})  # parsing never imports nixl
    assert cfg.nvme is not None and cfg.nvme.io_engine == "nixl"
    assert cfg.s3 is not None and cfg.s3.store.io_engine == "nixl"


def test_interactive_preset_exists_and_inline_overrides_it():
    assert "interactive" in available_presets()
    cfg = parse_config({"preset": "interactive", "cpu": {"capacity_bytes": 1 << 30}})
    assert cfg.cpu.capacity_bytes == 1 << 30
    assert cfg.load_mode == "sync"
    # Other fields of the preset's cpu section survive the partial override.
    assert cfg.cpu.capacity_fraction == 0.5


def test_config_file(tmp_path):
    f = tmp_path / "kvtier.yaml"
    f.write_text("cpu:\n  capacity_bytes: 4096\nload_mode: async\n")
    cfg = parse_config({"config_file": str(f), "load_mode": "sync"})
    assert cfg.cpu.capacity_bytes == 4096
    assert cfg.load_mode == "sync"  # inline wins over the file


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"cpux": {}}, "cpux", "unknown key"),
        ({"cpu": {"capacity": 1}}, "cpu.capacity", "unknown key"),
        ({"cpu": {"capacity_bytes": -1}}, "cpu.capacity_bytes", "> 0"),
        ({"cpu": {"capacity_bytes": "8G"}}, "cpu.capacity_bytes", "a size such as 32GiB"),
        ({"cpu": {"capacity_bytes": True}}, "cpu.capacity_bytes", "integer"),
        ({"cpu": {"capacity_fraction": 1.5}}, "cpu.capacity_fraction", "0.9"),
        ({"cpu": {"eviction": "lfu"}}, "cpu.eviction", "'lru', 's3fifo', 'arc', 'kvaware'"),
        ({"cpu": {"max_pinned_fraction": 0.95}}, "cpu.max_pinned_fraction", "[0, 0.9]"),
        ({"cpu": {"max_pinned_fraction": -0.1}}, "cpu.max_pinned_fraction", "[0, 0.9]"),
        ({"cpu": []}, "cpu", "mapping"),
        ({"load_mode": "lazy"}, "load_mode", "'sync', 'async'"),
        ({"preset": "nope"}, "preset", "unknown preset"),
        ({"preset": "../etc/passwd"}, "preset", "unknown preset"),
        ({"config_file": "/nonexistent/kvtier.yaml"}, "config_file", "cannot read"),
        ({"min_load_blocks": 0}, "min_load_blocks", ">= 1"),
        ({"fault_injection": {"load_error_rate": 2}}, "fault_injection.load_error_rate", "[0, 1]"),
        ({"nvme": {"path": "/x"}}, "nvme.capacity_bytes", "required"),
        ({"nixl": {"backends": "UCX"}}, "nixl.backends", "must be a list"),
        ({"nixl": {"hold_s": 0}}, "nixl.hold_s", "> 0"),
        ({"cpu": {"request_pins": "yes"}}, "cpu.request_pins", "true or false"),
        ({"cpu": {"max_pin_ttl_s": 0}}, "cpu.max_pin_ttl_s", "> 0"),
        ({"cpu": {"max_pin_ttl_s": 8 * 86400}}, "cpu.max_pin_ttl_s", "<= 604800"),
        ({"mooncake": {"master": "m:50051", "accept_handoffs": 1}}, "mooncake.accept_handoffs", "true or false"),
        ({"nixl": {"agent_name": "pre fill"}}, "nixl.agent_name", "letters"),
        ({"nixl": {"allowed_peers": "prefill-*"}}, "nixl.allowed_peers", "must be a list"),
        ({"nixl": {"allowed_peers": ["ok-*", "bad pattern"]}}, "nixl.allowed_peers[1]", "agent-name pattern"),
        ({"nixl": {"trusted_peers": [""]}}, "nixl.trusted_peers[0]", "agent-name pattern"),
        ({"nixl": {"allowed_peers": ["p"] * 257}}, "nixl.allowed_peers", "at most 256"),
        ({"nixl": {"max_peers": 0}}, "nixl.max_peers", ">= 1"),
        ({"nixl": {"max_peers": 5000}}, "nixl.max_peers", "<= 1024"),
        ({"nixl": {"max_offered_fraction": 0}}, "nixl.max_offered_fraction", "(0, 0.9]"),
        ({"mooncake": {}}, "mooncake.master", "is required"),
        ({"mooncake": {"master": "m:50051", "protocol": "ib"}}, "mooncake.protocol", "must be one of"),
        ({"mooncake": {"master": "m:50051", "handoff_wait_s": -1}}, "mooncake.handoff_wait_s", ">= 0"),
        ({"s3": {}}, "s3.bucket", "is required"),
        ({"s3": {"bucket": "kvb", "aws_secret_access_key": "x"}}, "s3.aws_secret_access_key", "unknown key"),
        ({"s3": {"bucket": "kvb", "chunk_blocks": 0}}, "s3.chunk_blocks", ">= 1"),
        ({"s3": {"bucket": "kvb", "mode": "later"}}, "s3.mode", "must be one of"),
        ({"s3": {"bucket": "kvb", "endpoint_url": "http://u:p@minio:9000"}}, "s3.endpoint_url", "credentials"),
        ({"nvme": {"path": "/x", "capacity_bytes": 1, "io_engine": "spdk"}}, "nvme.io_engine",
         "'posix', 'nixl', 'nixl-gds'"),
        ({"nvme": {"path": "/x", "capacity_bytes": 1, "eviction": "fifo"}}, "nvme.eviction",
         "'lru', 's3fifo', 'arc', 'kvaware'"),
        ({"s3": {"bucket": "kvb", "io_engine": "curl"}}, "s3.io_engine", "'boto3', 'nixl'"),
        ({"s3": {"bucket": "kvb", "io_engine": "nixl", "profile": "team"}}, "s3.io_engine", "AWS_PROFILE"),
        # Non-finite numbers: Infinity used to reach the scheduler thread (OverflowError).
        ({"mooncake": {"master": "m:50051", "lookup_timeout_s": float("inf")}}, "mooncake.lookup_timeout_s",
         "finite"),
        ({"s3": {"bucket": "kvb", "deadline_s": float("nan")}}, "s3.deadline_s", "finite"),
        ({"prefetch": {"max_age_s": float("-inf")}}, "prefetch.max_age_s", "finite"),
        # Upper bounds and bytes a path cannot hold.
        ({"s3": {"bucket": "kvb", "io_threads": 100000}}, "s3.io_threads", "<= 256"),
        ({"mooncake": {"master": "m:50051", "io_threads": 100000}}, "mooncake.io_threads", "<= 256"),
        ({"nvme": {"path": "/x", "capacity_bytes": 1, "io_threads": 1000}}, "nvme.io_threads", "<= 256"),
        ({"nvme": {"path": "/x\0y", "capacity_bytes": 1}}, "nvme.path", "NUL"),
        ({"nvme": {"path": "kv/nvme", "capacity_bytes": 1}}, "nvme.path", "absolute"),
        ({"s3": {"bucket": "kvb", "ca_bundle": "ca.pem"}}, "s3.ca_bundle", "absolute"),
        ({"s3": {"bucket": "kvb", "ca_bundle": "/ca\0.pem"}}, "s3.ca_bundle", "NUL"),
        # Deadlines, intervals and queues: sane maxima (one day; 4096 queued writes).
        ({"nvme": {"path": "/x", "capacity_bytes": 1, "flush_interval_s": 1e9}}, "nvme.flush_interval_s",
         "one day"),
        ({"nvme": {"path": "/x", "capacity_bytes": 1, "flush_on_shutdown_s": 86401}}, "nvme.flush_on_shutdown_s",
         "<= 86400"),
        ({"nvme": {"path": "/x", "capacity_bytes": 1, "max_queued_writes": 10**6}}, "nvme.max_queued_writes",
         "<= 4096"),
        ({"s3": {"bucket": "kvb", "max_queued_writes": 10**6}}, "s3.max_queued_writes", "<= 4096"),
        ({"s3": {"bucket": "kvb", "deadline_s": 1e7}}, "s3.deadline_s", "one day"),
        ({"s3": {"bucket": "kvb", "rescan_interval_s": 1e7}}, "s3.rescan_interval_s", "one day"),
        ({"s3": {"bucket": "kvb", "max_attempts": 1000}}, "s3.max_attempts", "<= 100"),
        ({"s3": {"bucket": "kvb", "manifest_max_entries": 10**11}}, "s3.manifest_max_entries", "<= 1048576"),
        ({"mooncake": {"master": "m:50051", "lookup_timeout_s": 1e6}}, "mooncake.lookup_timeout_s", "one day"),
        ({"mooncake": {"master": "m:50051", "max_queued_writes": 10**5}}, "mooncake.max_queued_writes", "<= 4096"),
        ({"mooncake": {"master": "m:50051", "deadline_s": 1e6}}, "mooncake.deadline_s", "one day"),
        ({"nixl": {"hold_s": 1e6}}, "nixl.hold_s", "one day"),
        ({"nixl": {"deadline_s": 1e6}}, "nixl.deadline_s", "one day"),
        ({"nixl": {"num_threads": 10**4}}, "nixl.num_threads", "<= 256"),
        ({"prefetch": {"max_age_s": 1e6}}, "prefetch.max_age_s", "one day"),
        ({"prefetch": {"max_inflight_blocks": 10**9}}, "prefetch.max_inflight_blocks", "<= 1048576"),
        ({"load_or_recompute": {"probe_interval_s": 1e6}}, "load_or_recompute.probe_interval_s", "one day"),
        ({"events": {"max_queued_blocks": 0}}, "events.max_queued_blocks", "in [1,"),
        ({"events": {"max_block_info": -1}}, "events.max_block_info", "in [0,"),
        ({"events": {"max_queued": 10}}, "events.max_queued", "unknown"),
    ],
)
def test_bad_input_names_the_field(extra, field, words):
    with pytest.raises(ConfigError) as e:
        parse_config(extra)
    assert e.value.field == field
    assert field in str(e.value) and words in str(e.value)


def test_bad_yaml_file_names_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("cpu: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config({"config_file": str(f)})
    f.write_text("cpu:\n  capacity_bytes: 10\n  bogus: 1\n")
    with pytest.raises(ConfigError, match="cpu.bogus"):
        parse_config({"config_file": str(f)})


def test_a_section_validates_itself_wherever_it_is_built():
    """Sections check their own values on construction, not only through the parser, so a
    section built by a benchmark or a test is valid or not built at all."""
    from vllm_kvtier.config import CPUTierConfig, NVMeTierConfig, PrefetchConfig

    with pytest.raises(ConfigError) as e:
        NVMeTierConfig(path="/x", capacity_bytes=1, chunk_blocks=257)
    assert e.value.field == "nvme.chunk_blocks"
    with pytest.raises(ConfigError) as e:
        CPUTierConfig(capacity_fraction=0.95)
    assert e.value.field == "cpu.capacity_fraction"
    with pytest.raises(ConfigError) as e:
        PrefetchConfig(max_inflight_blocks=0)
    assert e.value.field == "prefetch.max_inflight_blocks"
    assert NVMeTierConfig(path="/x", capacity_bytes=1).chunk_blocks == 16


def test_exporter_listens_on_loopback_unless_told_otherwise():
    assert parse_config({"exporter": {"port": 9400}}).exporter.addr == "127.0.0.1"
    assert parse_config({"exporter": {"port": 9400, "addr": "0.0.0.0"}}).exporter.addr == "0.0.0.0"


def test_a_near_miss_key_gets_a_suggestion():
    with pytest.raises(ConfigError, match="did you mean 'capacity_bytes'") as e:
        parse_config({"cpu": {"capacty_bytes": 10}})
    assert e.value.field == "cpu.capacty_bytes"
    with pytest.raises(ConfigError, match="did you mean 'bucket'"):  # a flat tier section too
        parse_config({"s3": {"bukcet": "b"}})
    with pytest.raises(ConfigError) as e:
        parse_config({"cpu": {"zzz": 1}})
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize(("text", "n"), [("32GiB", 32 * 2**30), ("512MB", 512 * 10**6), ("1.5TB", 1.5e12),
                                         ("4096", 4096)])
def test_sizes_take_the_units_plan_takes(text, n):
    assert parse_config({"cpu": {"capacity_bytes": text}}).cpu.capacity_bytes == n
    cfg = parse_config({"nvme": {"path": "/x", "capacity_bytes": text}})
    assert cfg.nvme is not None and cfg.nvme.capacity_bytes == n


def test_an_ambiguous_size_names_the_field():
    with pytest.raises(ConfigError, match="bare G is ambiguous") as e:
        parse_config({"cpu": {"capacity_bytes": "32G"}})
    assert e.value.field == "cpu.capacity_bytes"


def test_yaml_booleans_in_a_string_field_say_what_happened(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("load_mode: on\n")  # YAML 1.1: unquoted on is true
    with pytest.raises(ConfigError, match="unquoted on/off/yes/no") as e:
        parse_config({"config_file": str(f)})
    assert e.value.field == "load_mode"


def test_capacity_bytes_and_fraction_together_are_refused():
    with pytest.raises(ConfigError, match="not both") as e:
        parse_config({"cpu": {"capacity_bytes": 2**30, "capacity_fraction": 0.3}})
    assert e.value.field == "cpu.capacity_fraction"


def test_a_later_source_chooses_bytes_or_fraction(tmp_path):
    """The long-context preset sizes DRAM by fraction: bytes given inline replace it, and a
    fraction given inline replaces bytes from a config file (it used to be ignored)."""
    cfg = parse_config({"preset": "long-context", "cpu": {"capacity_bytes": 2**30}})
    assert cfg.cpu.capacity_bytes == 2**30
    f = tmp_path / "c.yaml"
    f.write_text("cpu:\n  capacity_bytes: 1073741824\n")
    cfg = parse_config({"config_file": str(f), "cpu": {"capacity_fraction": 0.3}})
    assert cfg.cpu.capacity_bytes is None and cfg.cpu.capacity_fraction == 0.3
