"""Building the tiers below CPU (NVMe, S3, Mooncake) from the config.

It builds the scheduler's planners and each worker's stores. Every store is opened
through the tier registry (:mod:`vllm_kvtier.tiers.registry`) from its config section and
one context. Each medium's spec builds its store (a worker's) and its catalog (the
scheduler's).

Who calls it: :class:`~vllm_kvtier.connector.KVTierConnector` at construction (scheduler
role: :func:`make_planners`; worker role: :func:`make_workers`, once the CPU pool exists).
Both may block at start-up (a directory scan; a bucket listing bounded by its deadline).
A tier that cannot start is logged and disabled (every write and read a miss); serving
goes on.

TP ranks (:class:`RankRole`): each rank stores its own shard of every chunk under its own
rank (directory ``r<rank>``, object prefix or key ``r<rank>``). The exception is a KV
cache that is the same on every rank of a TP group (MLA: the latent cache is replicated,
not sharded). Then the group stores one copy. Its first rank writes it under the group's
index. That index is the pipeline stage, 0 without PP: rank 0's names, as a TP-1 engine
uses. The other ranks read that copy. The scheduler's planners count ``copies`` shards
instead of ``world_size``. That covers existence on every copy, acknowledgements,
capacity and usage: what ``kvtier plan`` assumes. Models whose KV is sharded keep one
name and one count per rank.

Data parallelism: ranks here are ranks within one engine (``0 .. world_size - 1``), never
vLLM's world rank across data-parallel engines. Engines of one model share the namespace
and the names on the shared media (S3, Mooncake). Each finds what the others stored, as
another instance would. A private medium (NVMe) keeps one directory per engine
(``engine``): its own lock, scan and capacity.

Storage format (``storage_dtype``): both sides derive it, the stored block size and the
tier's namespace from the same facts. The facts are the config, the engine's block bytes
per rank and KV dtype. So they agree without talking; see :mod:`vllm_kvtier.transfer.fp8`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import cast

import torch

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.config.lower import ChoosesEviction, LowerTierSection
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext
from vllm_kvtier.tiers.auth import ChunkAuth, load_auth
from vllm_kvtier.tiers.buffers import DEFAULT_IDLE_BYTES, BufferPool
from vllm_kvtier.tiers.registry import CatalogContext, StoreContext, TierSpec, lower_tiers
from vllm_kvtier.tiers.spec import open_or_none
from vllm_kvtier.transfer.fp8 import (
    StorageDtype,
    StorageFormat,
    make_codec,
    storage_format,
    stored_block_bytes,
)
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.tier_io import ChunkWorker, DriverContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankRole:
    """Which chunks of the lower tiers hold one worker's blocks, and whether it writes them.

    ``store_rank``: the rank the chunks are named by (directory ``r<store_rank>``, object
    prefix); ``writes``: this worker writes (and deletes) them. False: a *replica reader*,
    whose TP group's first rank writes the bytes it would write (see the module doc)."""

    store_rank: int
    writes: bool = True


def rank_role(rank: int, *, tp_size: int, replicated: bool) -> RankRole:
    """The role of world rank ``rank``.

    ``replicated``: every rank of a TP group holds the same KV (MLA). vLLM numbers world
    ranks with TP innermost: ``rank = group * tp_size + tp_rank``. PP stages and
    context-parallel shards are the groups. LMCache's MLA handling also assumes this."""
    if not replicated or tp_size <= 1:
        return RankRole(rank)
    return RankRole(rank // tp_size, writes=rank % tp_size == 0)


def stored_copies(world_size: int, *, tp_size: int, replicated: bool) -> int:
    """How many distinct shards of each block the lower tiers store.

    It is one per rank, or one per TP group when the KV is replicated across it. This is
    the planners' ``world_size``."""
    if not replicated or tp_size <= 1:
        return world_size
    return max(1, world_size // tp_size)


def tier_namespace(namespace: str, fmt: StorageFormat) -> str:
    """The namespace a tier stores under.

    Native blocks use the engine's namespace, so native blocks already stored stay
    readable. Other formats use a 16-hex-digit digest of it and the format. So FP8 and
    native blocks of one engine never meet (a namespace mismatch is a miss)."""
    if fmt == "native":
        return namespace
    return hashlib.sha256(f"{namespace}/{fmt}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TierFormat:
    """How one tier stores this engine's blocks."""

    fmt: StorageFormat
    namespace: str
    #: Bytes of one stored block of this rank (the chunk header's block_bytes).
    block_bytes: int


def tier_format(tier: str, storage_dtype: StorageDtype, *, namespace: str, block_bytes: int,
                kv_dtype: torch.dtype | None) -> TierFormat:
    """A tier's format, namespace and stored block size, from what both sides know.

    Those are ``block_bytes`` (of this rank's shard of a block) and the KV cache's dtype."""
    fmt = storage_format(storage_dtype, kv_dtype)
    if storage_dtype != "native" and fmt == "native":
        logger.info("kvtier %s: storage_dtype %s on a %s KV cache: blocks are stored as they are",
                    tier, storage_dtype, kv_dtype)
    size = stored_block_bytes(block_bytes, kv_dtype.itemsize if kv_dtype is not None else 1, fmt)
    return TierFormat(fmt, tier_namespace(namespace, fmt), size)


@dataclass(frozen=True)
class TierContext:
    """What every tier below CPU is built from, beside its config section.

    These are the engine's facts, the same in the scheduler and in every worker. So both
    derive the same namespaces and sizes."""

    #: The engine's namespace; each tier's comes from it and its storage format.
    namespace: str
    #: Bytes of this rank's shard of one block, as the engine holds it.
    block_bytes: int
    #: The KV cache's element type (None: unknown; every tier stores native blocks).
    kv_dtype: torch.dtype | None
    counters: Counters
    #: The key that signs and verifies chunks (None: none found).
    auth: ChunkAuth | None
    #: Sign and verify the private tiers' chunks too (``auth.local_tiers``); the shared
    #: ones always are when there is a key.
    auth_local: bool
    #: What tells this instance from another on the same host (its NVMe path, or "").
    instance: str = ""

    @classmethod
    def of(cls, cfg: KVTierConfig, *, namespace: str, block_bytes: int, kv_dtype: torch.dtype | None,
           counters: Counters) -> TierContext:
        """Raises ConfigError when ``auth.required`` and no key is found."""
        # Two instances on one host never share an NVMe path (its directory locks refuse it).
        instance = os.path.realpath(cfg.nvme.path) if cfg.nvme is not None else ""
        return cls(namespace, block_bytes, kv_dtype, counters, load_auth(cfg.auth), cfg.auth.local_tiers, instance)

    def store_context(self, spec: TierSpec, section: LowerTierSection, *, rank: int,
                      buffers: BufferPool | None = None, replica: bool = False, lookup_only: bool = False,
                      engine: int = 0) -> tuple[TierFormat, StoreContext]:
        """Tier ``spec``'s format and the context its store of ``rank`` (of data-parallel
        engine ``engine``) opens with."""
        f = tier_format(spec.name, section.storage_dtype, namespace=self.namespace, block_bytes=self.block_bytes,
                        kv_dtype=self.kv_dtype)
        auth = self.auth if spec.shared or self.auth_local else None
        return f, StoreContext(f.namespace, rank, f.block_bytes, buffers=buffers, auth=auth, replica=replica,
                               lookup_only=lookup_only, engine=engine, instance=self.instance)


def make_planners(
    cfg: KVTierConfig, *, namespace: str, world_size: int, block_bytes_per_rank: int, counters: Counters,
    kv_dtype: torch.dtype | None = None, read_only_pool: bool = False, engine: int = 0,
) -> list[ChunkPlanner]:
    """Planners of the configured lower tiers, fastest first.

    ``world_size``: the shards stored of each block, named ``r0`` .. ``r<world_size - 1>``.
    See :func:`stored_copies`: the ranks, or one per TP group for a replicated KV cache.
    ``engine``: the data-parallel engine (its own NVMe directories, see the module doc).
    ``kv_dtype``: the KV cache's element type. None means unknown; then every tier stores
    native blocks. ``read_only_pool``: this instance never writes a shared pool
    (``kv_consumer``). Raises ConfigError when ``auth.required`` and no key is found. The
    scheduler only lists and indexes; the workers verify every chunk they read."""
    # The scheduler verifies what it indexes with the workers' keys: a header a read would
    # refuse (a key not accepted, a MAC that does not verify, another rank) is never indexed.
    tier_ctx = TierContext.of(cfg, namespace=namespace, block_bytes=block_bytes_per_rank, kv_dtype=kv_dtype,
                              counters=counters)
    planners = []
    for spec, section in lower_tiers(cfg):
        _, ctx = tier_ctx.store_context(spec, section, rank=0, lookup_only=True, engine=engine)
        listing = spec.open_catalog(section, CatalogContext(ctx, world_size, counters, read_only_pool))
        policy = ChunkPolicy(cast(TierName, spec.name), section.mode, section.admit_min_seen, section.chunk_blocks,
                             section.capacity_bytes, key_named=spec.key_named,
                             flush_interval_s=section.flush_interval_s, exclusive=not spec.shared,
                             eviction=section.eviction if isinstance(section, ChoosesEviction) else "lru")
        planner = ChunkPlanner(policy, PlannerContext(world_size, ctx.block_bytes, counters), listing)
        planners.append(planner)
    return planners


def make_workers(
    cfg: KVTierConfig, *, namespace: str, rank: int, slots: SlotTable, counters: Counters,
    kv_dtype: torch.dtype | None = None, role: RankRole | None = None, engine: int = 0,
) -> dict[str, ChunkWorker]:
    """This rank's data path of each configured lower tier, by tier name.

    ``rank``: within the engine. ``engine``: the data-parallel engine (see the module doc).
    ``slots``: the worker's slot table; its pool's slot size is the block size stored.
    ``kv_dtype``: the KV cache's (None: unknown, native storage). ``role``: whose chunks
    this rank's blocks are, and whether it writes them. None means its own, written by it
    (see :class:`RankRole`).

    One :class:`~vllm_kvtier.tiers.buffers.BufferPool` per call (one per worker process) is
    handed to every store and chunk driver built here. So their transfer buffers share one
    bound on idle memory. A store that cannot start is None in its driver: every write and
    read is a miss. A shared medium's headers are fetched on a chunk's first read. A
    private medium's writer lists and cleans it first (the spec's ``start_up``).

    Authentication (``auth``): with a key found, the shared tiers (s3, mooncake) sign and
    verify every chunk. So does nvme when ``auth.local_tiers`` is on. ConfigError when
    ``auth.required`` and there is none."""
    tier_ctx = TierContext.of(cfg, namespace=namespace, block_bytes=slots.pool.slot_bytes, kv_dtype=kv_dtype,
                              counters=counters)
    role = role or RankRole(rank)
    buffers = BufferPool(DEFAULT_IDLE_BYTES)
    workers = {}
    for spec, section in lower_tiers(cfg):
        f, ctx = tier_ctx.store_context(spec, section, rank=role.store_rank, buffers=buffers,
                                        replica=not role.writes, engine=engine)
        store = open_or_none(spec, section, ctx, counters, "use")
        headers = spec.start_up(store, section, ctx, counters) if store is not None else {}
        codec = make_codec(f.fmt, tier_ctx.block_bytes, tier_ctx.kv_dtype)
        driver = DriverContext(slots, counters, codec, buffers, fetches_headers=spec.shared, writes=role.writes)
        workers[spec.name] = ChunkWorker(cast(TierName, spec.name), store, section, driver, headers)
    return workers
