"""An out-of-tree tier that lives only in the tests: chunk files on a shelf directory.

It is configured as any third-party medium would be, by its spec's path::

    {"tiers": {"tests.tiers.shelf:SPEC": {"path": "/some/dir"}}}

The store is the package's kernel over a medium of ten lines; the scheduler's catalog lists
nothing at start-up (it learns what this engine writes), as a pool's would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vllm_kvtier.catalog.base import Listing
from vllm_kvtier.chunkformat import ChunkFormatError
from vllm_kvtier.errors import ConfigError, FailureReason
from vllm_kvtier.tiers.buffers import shared_pool
from vllm_kvtier.tiers.kernel import KernelSettings, KernelStore, ReadShape, StoreKernel
from vllm_kvtier.tiers.registry import CatalogContext, StoreContext
from vllm_kvtier.tiers.spec import MediumSpec


@dataclass(frozen=True)
class ShelfConfig:
    """The shelf's section: the settings every lower tier has, and its directory."""

    path: str
    mode: Literal["write-back", "write-through"] = "write-back"
    admit_min_seen: int = 1
    chunk_blocks: int = 4
    capacity_bytes: int | None = None
    flush_interval_s: float = 0.0
    flush_on_shutdown_s: float = 5.0
    storage_dtype: Literal["native", "fp8"] = "native"
    header_cache_entries: int = 1024
    header_cache_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not os.path.isabs(self.path):
            raise ConfigError("shelf.path", f"must be an absolute path, got {self.path!r}")

    @property
    def endpoint(self) -> str:
        return f"shelf {self.path}"


class ShelfMedium:
    """One file per chunk; ``put`` writes a temporary file and renames it (atomic)."""

    name = "shelf"
    read_shape: ReadShape = "span"

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, chunk_id: str) -> Path:
        return self.root / f"{chunk_id}.shelf"

    def put(self, chunk_id: str, view: memoryview, deadline: float) -> None:
        tmp = self.root / f".tmp-{chunk_id}"
        tmp.write_bytes(view)
        os.replace(tmp, self.path(chunk_id))

    def read_into(self, chunk_id: str, offset: int, dst: memoryview, deadline: float) -> None:
        with open(self.path(chunk_id), "rb") as f:
            f.seek(offset)
            got = f.readinto(dst)
        if got != dst.nbytes:
            raise ChunkFormatError(f"truncated: {got} of {dst.nbytes} bytes", FailureReason.TRUNCATED)

    def delete(self, chunk_id: str) -> None:
        self.path(chunk_id).unlink(missing_ok=True)

    def classify(self, exc: BaseException) -> FailureReason:
        return FailureReason.MISSING if isinstance(exc, FileNotFoundError) else FailureReason.ERROR

    def close(self) -> None:
        pass


class ShelfStore(KernelStore[ShelfMedium]):
    """Chunk files under ``root/<namespace>/r<rank>``: the kernel does the rest."""

    def __init__(self, section: ShelfConfig, ctx: StoreContext) -> None:
        medium = ShelfMedium(Path(section.path) / ctx.namespace / f"r{ctx.rank}")
        settings = KernelSettings(ctx.namespace, ctx.rank, ctx.block_bytes, section.chunk_blocks, read_deadline_s=5.0)
        super().__init__(medium, StoreKernel(medium, settings, buffers=ctx.buffers or shared_pool(), auth=ctx.auth))


class ShelfSpec(MediumSpec):
    name = "shelf"
    section_type = ShelfConfig

    def open_store(self, section: ShelfConfig, ctx: StoreContext) -> ShelfStore:
        return ShelfStore(section, ctx)

    def open_catalog(self, section: ShelfConfig, ctx: CatalogContext) -> Listing:
        return Listing.empty(ctx.world_size)


SPEC = ShelfSpec()
