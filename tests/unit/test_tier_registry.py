"""The tier registry (:mod:`vllm_kvtier.tiers.registry`): a name gives its medium's spec or
an error that says what to do; every store opens from its section and one context; optional
abilities are found by protocol, by the registry's callers as by the worker's driver."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_kvtier.config import MooncakeTierConfig, parse_config
from vllm_kvtier.engine.lower import make_planners, make_workers
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.base import Forgets, Probeable, ReportsRemoteStats, Scannable
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.tiers.memory import MemoryStore
from vllm_kvtier.tiers.mooncake.store import MooncakeStore
from vllm_kvtier.tiers.registry import TIERS, StoreContext, install_hint, lower_tiers, open_store, tier_spec
from vllm_kvtier.tiers.resilience import BreakerSnapshot, BreakerState, RemoteStats
from vllm_kvtier.tiers.spec import MediumSpec
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.tier_io import ChunkWorker, DriverContext, DriverSettings

BLOCK = 4096


class OutOfTreeStore(MemoryStore):
    """A store this package does not know."""


class OutOfTreeSpec(MediumSpec):
    """Its spec, named by its path."""

    name = "oot"

    def open_store(self, section: Any, ctx: StoreContext) -> OutOfTreeStore:
        return OutOfTreeStore(ctx.namespace, ctx.block_bytes, rank=ctx.rank, auth=ctx.auth)


OUT_OF_TREE = OutOfTreeSpec()


class RemoteMemoryStore(MemoryStore):
    """The reference store with a remote store's figures (one request sent)."""

    def stats(self) -> RemoteStats:
        return RemoteStats({"get": 1}, 0, {}, BreakerSnapshot(BreakerState.OPEN, 5, 1, 0))


def test_an_unknown_tier_is_named_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="'tape'.*no such tier.*mooncake, nvme, s3"):
        tier_spec("tape")


def test_a_missing_dependency_names_the_tier_and_its_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # `import boto3` raises ImportError
    ctx = StoreContext("ns", 0, BLOCK)
    with pytest.raises(ImportError, match=r"tier 's3' cannot load: .*pip install 'vllm-kvtier\[s3\]'"):
        open_store(tier_spec("s3"), None, ctx)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError, match="tier 'mooncake' cannot load: .*pip install mooncake-transfer-engine"):
        open_store(tier_spec("mooncake"), None, ctx)
    assert install_hint("nvme") == ""  # nothing beyond the base install


def test_a_tier_whose_dependency_is_missing_is_disabled_and_serving_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Worker and scheduler alike: the tier is logged (with the hint) and counted, and
    its driver and planner exist, every write and read a miss."""
    monkeypatch.setitem(sys.modules, "boto3", None)
    cfg = parse_config({"s3": {"bucket": "kv-cache", "region": "us-east-1"}})
    counters = Counters()
    with caplog.at_level(logging.ERROR, logger="vllm_kvtier.tiers.spec"):
        workers = make_workers(cfg, namespace="ns", rank=0, counters=counters,
                               slots=SlotTable(CPUPool(2, (BLOCK,), pin=False, prefault=False)))
        (planner,) = make_planners(cfg, namespace="ns", world_size=2, block_bytes_per_rank=BLOCK, counters=counters)
    try:
        assert list(workers) == ["s3"] and workers["s3"].store is None
        assert counters.totals["store_failures|s3"] == 2
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2
        for line, verb in zip(said, ("use", "reach"), strict=True):
            assert line.startswith(f"kvtier s3: tier disabled, cannot {verb} bucket 'kv-cache': "
                                   f"tier 's3' cannot load: {install_hint('s3')} ("), line
    finally:
        planner.close()
        workers["s3"].close()


def test_an_out_of_tree_tier_is_named_by_its_spec_path() -> None:
    spec = tier_spec(f"{__name__}:OUT_OF_TREE")
    assert spec.shared  # the default: the safe choice for a medium we know nothing of
    store = open_store(spec, None, StoreContext("ns", 3, BLOCK))
    try:
        assert isinstance(store, OutOfTreeStore) and store.block_bytes == BLOCK
    finally:
        store.close()
    with pytest.raises(ImportError, match="has no Missing"):
        tier_spec(f"{__name__}:Missing")


def test_every_store_opens_from_its_section_and_its_abilities_are_found_by_protocol(tmp_path: Path) -> None:
    """NVMe and S3 open here (S3 sends no request when it opens); Mooncake needs a
    master, so only its class is checked."""
    cfg = parse_config({"nvme": {"path": str(tmp_path), "capacity_bytes": 1 << 20},
                        "s3": {"bucket": "kv-cache", "region": "us-east-1", "endpoint_url": "http://127.0.0.1:9"}})
    assert [spec.name for spec, _ in lower_tiers(cfg)] == ["nvme", "s3"]
    ctx = StoreContext("ns", 0, BLOCK)
    nvme, s3 = (open_store(spec, section, ctx) for spec, section in lower_tiers(cfg))
    try:
        assert isinstance(nvme, Scannable)
        assert not any(isinstance(nvme, p) for p in (Probeable, ReportsRemoteStats, Forgets))
        assert isinstance(s3, Scannable) and isinstance(s3, ReportsRemoteStats) and isinstance(s3, Forgets)
        assert not isinstance(s3, Probeable)
    finally:
        nvme.close()
        s3.close()
    assert issubclass(MooncakeStore, Probeable) and issubclass(MooncakeStore, ReportsRemoteStats)
    assert not issubclass(MooncakeStore, Scannable)
    specs = [tier_spec(name) for name in TIERS]
    assert [(s.name, s.shared) for s in specs] == [("nvme", False), ("s3", True), ("mooncake", True)]
    assert [s.section_type for s in specs] == [type(cfg.nvme), type(cfg.s3), MooncakeTierConfig]


@pytest.mark.parametrize("store_type", [MemoryStore, RemoteMemoryStore])
def test_the_driver_reports_remote_figures_only_of_a_store_that_has_them(store_type: type[MemoryStore]) -> None:
    slots = SlotTable(CPUPool(2, (BLOCK,), pin=False, prefault=False))
    counters = Counters()
    w = ChunkWorker("t", store_type("ns", BLOCK), DriverSettings("write-through", 1, 0.0), DriverContext(slots, counters))
    try:
        w.poll()
        drained = counters.drain() or {"counters": {}, "gauges": {}}
        remote = store_type is RemoteMemoryStore
        assert drained["counters"] == ({"requests|t": 1, "breaker_opens|t": 1} if remote else {})
        assert drained["gauges"] == ({"breaker_state|t": int(BreakerState.OPEN)} if remote else {})
    finally:
        w.close()
