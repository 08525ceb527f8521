"""The tier registry: tier name -> the store class of its medium, imported on first use.

Who calls it: the connector (:mod:`vllm_kvtier.connector.lower`), at start-up, in the
scheduler and in every worker. It may block: opening a store creates a directory or
joins a pool.

Every medium is built the same way: ``store_class(name).from_config(section, ctx)``.
``section`` is the tier's config section (``cfg.nvme``, ``cfg.s3``, ``cfg.mooncake``).
``ctx`` is a :class:`StoreContext`: what every store of one process shares.

Optional abilities are not declared here. The caller checks them with ``isinstance``
against the protocols of :mod:`vllm_kvtier.tiers.base` (``Scannable``, ``Probeable``,
``ReportsRemoteStats``, ``Forgets``).

Errors. An unknown name is a :class:`~vllm_kvtier.errors.ConfigError` naming it. A tier
whose optional dependency does not import is an :class:`ImportError` naming the tier and
its install hint. An out-of-tree store is named by its path, ``"package.module:Class"``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from vllm_kvtier.errors import ConfigError

if TYPE_CHECKING:
    from vllm_kvtier.tiers.auth import ChunkAuth
    from vllm_kvtier.tiers.base import ChunkStore
    from vllm_kvtier.tiers.buffers import BufferPool

__all__ = ["TIERS", "StoreContext", "TierEntry", "TierStore", "install_hint", "open_store", "store_class", "tier_entry"]


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


class TierStore(Protocol):
    """A store class the registry can build: one constructor signature for every medium."""

    @classmethod
    def from_config(cls, section: Any, ctx: StoreContext) -> ChunkStore:
        """Open the store of ``ctx.rank`` as ``section`` configures it. Blocks briefly.
        Raises what the medium raises when it cannot start (OSError, ConnectionError,
        ImportError...), or ConfigError for a setting that cannot run here."""
        ...


@dataclass(frozen=True)
class TierEntry:
    """One medium in the registry."""

    name: str
    #: ``"package.module:Class"``, a :class:`TierStore`.
    target: str
    #: Modules the medium needs that the base install lacks.
    requires: tuple[str, ...] = ()
    #: What to install when one of ``requires`` does not import.
    install_hint: str = ""
    #: Whether other writers may share the medium (S3, Mooncake), or only this rank
    #: writes it, under its lock (NVMe). A shared medium's chunks are always signed when
    #: a key is set, and its worker fetches a header on a chunk's first read. A private
    #: one is listed and cleaned by its worker at start-up. Known before the class loads,
    #: so a tier whose dependency is missing keeps its policy. An out-of-tree store is
    #: taken as shared: the safe choice.
    shared: bool = True


#: The media of this package, by tier name (a :class:`~vllm_kvtier.keys.TierName` value).
TIERS: dict[str, TierEntry] = {
    entry.name: entry
    for entry in (
        TierEntry("nvme", "vllm_kvtier.tiers.nvme.store:NVMeStore", shared=False),
        TierEntry("s3", "vllm_kvtier.tiers.s3.store:S3Store", requires=("boto3",),
                  install_hint="the S3 tier needs boto3: pip install 'vllm-kvtier[s3]'"),
        TierEntry("mooncake", "vllm_kvtier.tiers.mooncake.store:MooncakeStore", requires=("mooncake.store",),
                  install_hint=(
                      "the Mooncake tier needs the mooncake-transfer-engine package and libibverbs: "
                      "pip install mooncake-transfer-engine (GPU hosts) or mooncake-transfer-engine-non-cuda "
                      "(CPU-only), and apt-get install libibverbs1 (tools/setup-remote.sh does both for tests)")),
    )
}


def tier_entry(name: str) -> TierEntry:
    """The entry of ``name``: a registered tier, or an out-of-tree store's path
    (``"package.module:Class"``). ConfigError naming ``name`` otherwise."""
    entry = TIERS.get(name)
    if entry is not None:
        return entry
    if ":" in name:
        return TierEntry(name, name)
    known = ", ".join(sorted(TIERS))
    raise ConfigError(name, f"no such tier (known: {known}; an out-of-tree store is 'package.module:Class')")


def install_hint(name: str) -> str:
    """What to install for tier ``name`` ("" when it needs nothing more)."""
    return tier_entry(name).install_hint


def store_class(name: str) -> type[TierStore]:
    """The store class of tier ``name``, imported now. ConfigError for an unknown name;
    ImportError naming the tier and its install hint when a dependency does not import
    (a missing package, or a missing system library of an extension module)."""
    entry = tier_entry(name)
    for module in entry.requires:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"tier '{name}' cannot load: {entry.install_hint} ({e})", name=module) from e
    module_name, _, class_name = entry.target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except AttributeError as e:
        raise ImportError(f"tier '{name}' cannot load: {module_name} has no {class_name}") from e
    return cast("type[TierStore]", cls)


def open_store(name: str, section: Any, ctx: StoreContext) -> ChunkStore:
    """Tier ``name``'s store, built from its config section and ``ctx``. Raises what
    :func:`store_class` and the medium's ``from_config`` raise."""
    return store_class(name).from_config(section, ctx)
