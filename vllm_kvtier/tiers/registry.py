"""The tier registry: tier name -> the spec of its medium, imported on first use.

Who calls it: the config parser, at start-up in every process; the planners' and the
workers' builders (:mod:`vllm_kvtier.engine.lower`). Looking a spec up may block briefly
(it imports a module); opening a store may block longer (a directory, a pool).

A spec (:class:`TierSpec`) is the shape of vLLM's ``OffloadingSpec``: one object per
medium that builds both halves of its tier. ``open_store`` gives a worker its store;
``open_catalog`` tells the scheduler what the tier holds (an NVMe scan, an S3 listing and
its rescans, Mooncake lookups). Both take the tier's config section and one context.

Optional abilities are not declared here. The caller checks them with ``isinstance``
against the protocols of :mod:`vllm_kvtier.tiers.base` (``Scannable``, ``Probeable``,
``ReportsRemoteStats``, ``Forgets``).

Errors. An unknown name is a :class:`~vllm_kvtier.errors.ConfigError` naming it. A tier
whose optional dependency does not import is an :class:`ImportError` naming the tier and
its install hint. An out-of-tree tier is named by its spec's path, ``"package.module:Spec"``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from vllm_kvtier.errors import ConfigError
from vllm_kvtier.keys import TierName
from vllm_kvtier.plugins import load_object

if TYPE_CHECKING:
    from vllm_kvtier.catalog.base import Listing
    from vllm_kvtier.chunkformat import ChunkHeader
    from vllm_kvtier.config import KVTierConfig
    from vllm_kvtier.config.lower import LowerTierSection
    from vllm_kvtier.metrics import Counters
    from vllm_kvtier.tiers.auth import ChunkAuth
    from vllm_kvtier.tiers.base import ChunkStore
    from vllm_kvtier.tiers.buffers import BufferPool

__all__ = ["TIERS", "CatalogContext", "StoreContext", "TierSpec", "install_hint", "lower_tiers", "metric_tiers",
           "open_store", "tier_spec"]


@dataclass(frozen=True)
class StoreContext:
    """What every store of one process is built with, beside its config section."""

    #: The tier's namespace (the engine's, or its digest with the storage format).
    namespace: str
    #: The store rank: whose chunks these are (directory ``r<rank>``, object prefix),
    #: within its engine (a data-parallel engine's ranks count from 0).
    rank: int
    #: Bytes of one stored block.
    block_bytes: int
    #: The worker's buffer pool, shared by its stores (None: the process default).
    buffers: BufferPool | None = None
    #: The key that signs and verifies chunks (None: unsigned chunks only).
    auth: ChunkAuth | None = None
    #: True: another rank writes these chunks; this store only reads them.
    replica: bool = False
    #: True: the scheduler's store. It only lists or looks up what exists and never
    #: moves blocks, so a medium may skip its data-path resources.
    lookup_only: bool = False
    #: The data-parallel engine (0 without data parallelism). A private medium (NVMe)
    #: keeps one directory per engine; a shared one stores every engine's chunks under
    #: the same names, as it does another instance's (only its writer id differs).
    engine: int = 0
    #: What tells this instance from another on the same host name, stable across
    #: restarts: its NVMe path, when it has one. Part of a shared tier's default writer id.
    instance: str = ""


@dataclass(frozen=True)
class CatalogContext:
    """What the scheduler's catalog of a tier is built with, beside its config section."""

    #: Rank 0's store context (lookup only); rank ``r``'s differs only by ``rank``.
    store: StoreContext
    #: Shards stored of each block, named ``r0`` .. ``r<world_size - 1>``.
    world_size: int
    counters: Counters
    #: This instance never writes a shared pool (vLLM's ``kv_consumer`` role).
    read_only_pool: bool = False


class TierSpec(Protocol):
    """One medium: its section type and how both halves of its tier are built.

    Every method runs at start-up (the scheduler's or a worker's) and may block: it
    creates directories, lists a bucket or joins a pool. None is called per step."""

    @property
    def name(self) -> str:
        """The tier's name in metrics and log lines (``tier`` label)."""
        ...

    @property
    def section_type(self) -> type:
        """The dataclass its config section parses into."""
        ...

    @property
    def shared(self) -> bool:
        """Other writers may share the medium (S3, Mooncake).

        False: only this rank writes it, under its lock (NVMe). A shared medium's chunks are
        signed when a key is set. Its worker fetches a header on a chunk's first read. A
        private one is listed and cleaned by its worker at start-up."""
        ...

    @property
    def key_named(self) -> bool:
        """Chunks of one block named by the block's key (a key-value pool): found by lookup."""
        ...

    @property
    def requires(self) -> tuple[str, ...]:
        """Modules the medium needs that the base install lacks."""
        ...

    @property
    def install_hint(self) -> str:
        """What to install when one of ``requires`` does not import."""
        ...

    def open_store(self, section: Any, ctx: StoreContext) -> ChunkStore:
        """The worker's store of ``ctx.rank``. Raises what the medium raises when it cannot
        start (OSError, ConnectionError, ImportError...), or ConfigError for a setting that
        cannot run here."""
        ...

    def open_catalog(self, section: Any, ctx: CatalogContext) -> Listing:
        """What the tier holds for the scheduler: the start-up listing and where later
        changes come from. Never raises for a tier that cannot start: logs, counts
        ``store_failures`` and returns an empty listing."""
        ...

    def start_up(self, store: ChunkStore, section: Any, ctx: StoreContext, counters: Counters,
                 ) -> dict[str, ChunkHeader]:
        """A worker's first look at its opened store, else an empty dict.

        It gives the headers it already holds. A private medium's writer lists and cleans
        it."""
        ...


#: The media of this package, by tier name (a :class:`~vllm_kvtier.keys.TierName` value),
#: fastest first. Each is also the name of its section in the config.
TIERS: dict[str, str] = {
    "nvme": "vllm_kvtier.tiers.nvme.spec:SPEC",
    "s3": "vllm_kvtier.tiers.s3.spec:SPEC",
    "mooncake": "vllm_kvtier.tiers.mooncake.spec:SPEC",
}


def tier_spec(name: str) -> TierSpec:
    """The spec of ``name``: a registered tier, or an out-of-tree spec's path
    (``"package.module:Spec"``). ConfigError for an unknown name; ImportError naming the
    tier when an out-of-tree path does not import."""
    target = TIERS.get(name)
    if target is None and ":" not in name:
        known = ", ".join(sorted(TIERS))
        raise ConfigError(name, f"no such tier (known: {known}; an out-of-tree tier is 'package.module:Spec')")
    try:
        spec: TierSpec = load_object(target or name)
    except ImportError as e:
        raise ImportError(f"tier '{name}' cannot load: {e}") from e
    return spec


def install_hint(name: str) -> str:
    """What to install for tier ``name`` ("" when it needs nothing more)."""
    return tier_spec(name).install_hint


def open_store(spec: TierSpec, section: Any, ctx: StoreContext) -> ChunkStore:
    """``spec``'s store, built from its config section and ``ctx``.

    A dependency may not import: a missing package, or a missing system library of an
    extension module. Then it raises ImportError naming the tier and its install hint.
    Else it raises what ``spec.open_store`` raises."""
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"tier '{spec.name}' cannot load: {spec.install_hint} ({e})", name=module) from e
    return spec.open_store(section, ctx)


def lower_tiers(cfg: KVTierConfig) -> list[tuple[TierSpec, LowerTierSection]]:
    """The configured tiers below CPU with their sections, fastest first.

    This package's come first, each under its own section. Then come the out-of-tree ones
    (``tiers``), in their order."""
    named = [(name, getattr(cfg, name)) for name in TIERS]
    named += list(cfg.tiers)
    return [(tier_spec(name), section) for name, section in named if section is not None]


def metric_tiers(cfg: KVTierConfig) -> list[str]:
    """The ``tier`` label values this config's counters can carry.

    They are exported at 0 from the start. They are the CPU tier, each configured tier
    below it, ``peer`` with NIXL, and ``all``."""
    tiers = [str(TierName.CPU), *(spec.name for spec, _ in lower_tiers(cfg))]
    if cfg.nixl is not None:
        tiers.append(str(TierName.PEER))
    return [*tiers, str(TierName.ALL)]
