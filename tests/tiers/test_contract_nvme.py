"""The store contract, bound to the NVMe store: chunk files in tmp_path, through the
``posix`` I/O engine and NIXL's POSIX backend (``nixl``; skipped with the reason where
nixl is missing). Damage is done to the files themselves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testkit.stores import nvme_section
from tests.nixl_env import nixl_engine_env, nixl_env, or_skip, requires_nixl
from tests.tiers.contract import BLOCK, NS, FileMediumContract, StoreContract
from vllm_kvtier.tiers.nvme.dirs import DirectoryLocked
from vllm_kvtier.tiers.nvme.store import NVMeStore
from vllm_kvtier.tiers.registry import StoreContext

nixl_env = nixl_env  # fixtures: the UCX/NIXL environment of the nixl binding
nixl_engine_env = nixl_engine_env


class NVMeBinding(FileMediumContract, StoreContract):
    io_engine = "posix"

    def make_store(self, tmp_path: Path, **kw: Any) -> NVMeStore:
        """A store on ``tmp_path/nvme``; when a store of this test still holds that
        directory's lock (a second store: another key, a reader without one), on the next
        free ``nvme-<n>`` (one engine per directory: the lock refuses a second one). A store
        reopened after the first closed gets the first directory back. ``rank``: its rank
        directory under the root (``r<rank>``)."""
        ctx = StoreContext(NS, kw.pop("rank", 0), BLOCK, buffers=kw.pop("buffers", None), auth=kw.pop("auth", None))
        if "max_chunk_blocks" in kw:
            kw["chunk_blocks"] = kw.pop("max_chunk_blocks")
        deadline = {"read_deadline_s": kw.pop("read_deadline_s")} if "read_deadline_s" in kw else {}
        for n in range(8):
            path = tmp_path / ("nvme" if n == 0 else f"nvme-{n}")
            try:
                return or_skip(lambda p=path: NVMeStore(nvme_section(p, io_engine=self.io_engine, **kw), ctx,
                                                        **deadline))
            except DirectoryLocked:
                continue
        raise AssertionError("8 stores of one test hold their directories")

    def path_of(self, store: NVMeStore, chunk_id: str) -> Path:  # type: ignore[override]
        return store.path(chunk_id)

    def get_raw(self, store: NVMeStore, chunk_id: str) -> bytes:  # type: ignore[override]
        return store.path(chunk_id).read_bytes()

    def put_raw(self, store: NVMeStore, chunk_id: str, data: bytes) -> None:  # type: ignore[override]
        store.path(chunk_id).write_bytes(data)


class TestNVMePosix(NVMeBinding):
    io_engine = "posix"


@pytest.mark.nixl
@requires_nixl
class TestNVMeNixl(NVMeBinding):
    io_engine = "nixl"
