"""The store contract, bound to a tier from outside the package (:mod:`tests.tiers.shelf`),
and that tier found, parsed and opened by its spec's path as the config names it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.tiers.contract import BLOCK, NS, StoreContract
from tests.tiers.shelf import ShelfConfig, ShelfStore
from vllm_kvtier.config import parse_config
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.tiers.registry import StoreContext, lower_tiers, metric_tiers, open_store

SHELF = "tests.tiers.shelf:SPEC"


class TestShelfStore(StoreContract):
    def make_store(self, tmp_path: Path, **kw: Any) -> ShelfStore:
        assert kw.pop("read_deadline_s", 5.0) == 5.0  # the shelf's own deadline
        section = ShelfConfig(str(tmp_path / "shelf"), chunk_blocks=kw.pop("max_chunk_blocks", 16))
        return ShelfStore(section, StoreContext(NS, kw.pop("rank", 0), BLOCK, **kw))

    def get_raw(self, store: ShelfStore, chunk_id: str) -> bytes:  # type: ignore[override]
        return store.medium.path(chunk_id).read_bytes()

    def put_raw(self, store: ShelfStore, chunk_id: str, data: bytes) -> None:  # type: ignore[override]
        store.medium.path(chunk_id).write_bytes(data)


def test_the_config_names_an_out_of_tree_tier_by_its_spec_path(tmp_path: Path) -> None:
    cfg = parse_config({"nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 1 << 20},
                        "tiers": {SHELF: {"path": str(tmp_path), "chunk_blocks": 2}}})
    assert cfg.tiers == ((SHELF, ShelfConfig(str(tmp_path), chunk_blocks=2)),)
    assert [spec.name for spec, _ in lower_tiers(cfg)] == ["nvme", "shelf"]  # after the package's own
    assert metric_tiers(cfg) == ["cpu", "nvme", "shelf", "all"]
    spec, section = lower_tiers(cfg)[1]
    store = open_store(spec, section, StoreContext(NS, 1, BLOCK))
    try:
        assert isinstance(store, ShelfStore) and store.medium.root == tmp_path / NS / "r1"
    finally:
        store.close()


@pytest.mark.parametrize(("tiers", "field", "why"), [
    ({SHELF: {"path": "relative"}}, "shelf.path", "absolute"),
    ({SHELF: {"path": "/x", "chunk_blocks": "two"}}, f"tiers.{SHELF}.chunk_blocks", "integer"),
    ({SHELF: {"path": "/x", "colour": 1}}, f"tiers.{SHELF}.colour", "unknown key"),
    ({"tests.tiers.shelf:NOPE": {}}, "tiers.tests.tiers.shelf:NOPE", "has no NOPE"),
    ({"nvme": {}}, "tiers.nvme", "package.module:Spec"),
    ([SHELF], "tiers", "must be a mapping"),
])
def test_a_bad_out_of_tree_section_names_its_field(tiers: Any, field: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as e:
        parse_config({"tiers": tiers})
    assert e.value.field == field
