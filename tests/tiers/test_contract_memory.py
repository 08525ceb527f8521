"""The store contract, bound to the in-memory store (the reference implementation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.tiers.contract import BLOCK, NS, StoreContract
from vllm_kvtier.tiers.memory import MemoryStore


class TestMemoryStore(StoreContract):
    def make_store(self, tmp_path: Path, **kw: Any) -> MemoryStore:
        assert kw.pop("read_deadline_s", 5.0) == 5.0  # the memory store's own deadline
        return MemoryStore(NS, BLOCK, **kw)

    def get_raw(self, store: MemoryStore, chunk_id: str) -> bytes:  # type: ignore[override]
        raw = store.raw(chunk_id)
        assert raw is not None
        return bytes(raw)

    def put_raw(self, store: MemoryStore, chunk_id: str, data: bytes) -> None:  # type: ignore[override]
        store.forge(chunk_id, data)
