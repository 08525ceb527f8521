"""Building the tiers below CPU (NVMe, S3, Mooncake) from the config: the scheduler's
planners and each worker's stores. Every store is opened through the tier registry
(:mod:`vllm_kvtier.tiers.registry`) from its config section and one context; optional
abilities are found with ``isinstance`` on the protocols of :mod:`vllm_kvtier.tiers.base`.

Who calls it: :class:`~vllm_kvtier.connector.KVTierConnector` at construction (scheduler
role: :func:`make_planners`; worker role: :func:`make_workers`, once the CPU pool exists).
Both may block at start-up (a directory scan; a bucket listing bounded by its deadline).
A tier that cannot start is logged and disabled (every write and read a miss); serving
goes on.

TP ranks (:class:`RankRole`): each rank stores its own shard of every chunk under its own
rank (directory ``r<rank>``, object prefix or key ``r<rank>``), except when the KV cache is
the same on every rank of a TP group (MLA: the latent cache is replicated, not sharded).
Then the group stores one copy: its first rank writes it under the group's index (the
pipeline stage, 0 without PP: rank 0's names, as a TP-1 engine uses), the other ranks read
that copy, and the scheduler's planners count ``copies`` shards instead of ``world_size``
(existence on every copy, acknowledgements, capacity and usage): what ``kvtier plan``
assumes. Models whose KV is sharded keep their names and counts exactly as before.

Data parallelism: ranks here are ranks within one engine (``0 .. world_size - 1``), never
vLLM's world rank across data-parallel engines. Engines of one model share the namespace
and the names on the shared media (S3, Mooncake): each finds what the others stored, as
another instance would. A private medium (NVMe) keeps one directory per engine
(``engine``): its own lock, scan and capacity.

Storage format (``storage_dtype``): both sides derive it, the stored block size and the
tier's namespace from the same facts (the config, the engine's block bytes per rank and
KV dtype), so they agree without talking; see :mod:`vllm_kvtier.transfer.fp8`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from vllm_kvtier.catalog.base import Found, Listed, common_chunks
from vllm_kvtier.catalog.pool import PoolLookup
from vllm_kvtier.catalog.rescan import Rescanner
from vllm_kvtier.chunkformat import ChunkHeader
from vllm_kvtier.config import KVTierConfig, MooncakeTierConfig, NVMeTierConfig, S3TierConfig
from vllm_kvtier.config.sections import LowerTierSection
from vllm_kvtier.errors import ConfigError, run_all
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters, GaugeName
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy
from vllm_kvtier.tiers.auth import ChunkAuth, load_auth, refusal_reason
from vllm_kvtier.tiers.base import ChunkStore, Probeable, Scannable
from vllm_kvtier.tiers.buffers import DEFAULT_IDLE_BYTES, BufferPool
from vllm_kvtier.tiers.nvme.dirs import (
    collect_namespace,
    foreign_namespaces,
    lock_holder,
    uncreatable_reason,
    unsafe_reason,
)
from vllm_kvtier.tiers.nvme.store import UNREADABLE_KEPT, other_bytes, rank_dir, scan_dir
from vllm_kvtier.tiers.registry import StoreContext, open_store, tier_entry
from vllm_kvtier.transfer.fp8 import (
    StorageDtype,
    StorageFormat,
    make_codec,
    storage_format,
    stored_block_bytes,
)
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.tier_io import ChunkWorker

if TYPE_CHECKING:
    from vllm_kvtier.tiers.s3.store import S3Store

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
    """The role of world rank ``rank``. ``replicated``: every rank of a TP group holds the
    same KV (MLA). vLLM numbers world ranks with TP innermost (``rank = group * tp_size +
    tp_rank``; PP stages and context-parallel shards are the groups), as LMCache's MLA
    handling also assumes."""
    if not replicated or tp_size <= 1:
        return RankRole(rank)
    return RankRole(rank // tp_size, writes=rank % tp_size == 0)


def stored_copies(world_size: int, *, tp_size: int, replicated: bool) -> int:
    """How many distinct shards of each block the lower tiers store: one per rank, or one
    per TP group when the KV is replicated across it (the planners' ``world_size``)."""
    if not replicated or tp_size <= 1:
        return world_size
    return max(1, world_size // tp_size)


def tier_namespace(namespace: str, fmt: StorageFormat) -> str:
    """The namespace a tier stores under: the engine's for native blocks (what earlier
    versions stored stays readable), else a 16-hex-digit digest of it and the format, so
    FP8 and native blocks of one engine never meet (a namespace mismatch is a miss)."""
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
    """A tier's format, namespace and stored block size, from what both sides know:
    ``block_bytes`` (of this rank's shard of a block) and the KV cache's dtype."""
    fmt = storage_format(storage_dtype, kv_dtype)
    if storage_dtype != "native" and fmt == "native":
        logger.info("kvtier %s: storage_dtype %s on a %s KV cache: blocks are stored as they are",
                    tier, storage_dtype, kv_dtype)
    size = stored_block_bytes(block_bytes, kv_dtype.itemsize if kv_dtype is not None else 1, fmt)
    return TierFormat(fmt, tier_namespace(namespace, fmt), size)


@dataclass(frozen=True)
class TierContext:
    """What every tier below CPU is built from, beside its config section: the engine's
    facts, the same in the scheduler and in every worker (so both derive the same
    namespaces and sizes)."""

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

    @classmethod
    def of(cls, cfg: KVTierConfig, *, namespace: str, block_bytes: int, kv_dtype: torch.dtype | None,
           counters: Counters) -> TierContext:
        """Raises ConfigError when ``auth.required`` and no key is found."""
        return cls(namespace, block_bytes, kv_dtype, counters, load_auth(cfg.auth), cfg.auth.local_tiers)

    def store_context(self, tier: str, section: LowerTierSection, *, rank: int, buffers: BufferPool | None = None,
                      replica: bool = False, lookup_only: bool = False, engine: int = 0,
                      ) -> tuple[TierFormat, StoreContext]:
        """Tier ``tier``'s format and the context its store of ``rank`` (of data-parallel
        engine ``engine``) opens with."""
        f = tier_format(tier, section.storage_dtype, namespace=self.namespace, block_bytes=self.block_bytes,
                        kv_dtype=self.kv_dtype)
        auth = self.auth if tier_entry(tier).shared or self.auth_local else None
        return f, StoreContext(f.namespace, rank, f.block_bytes, buffers=buffers, auth=auth, replica=replica,
                               lookup_only=lookup_only, engine=engine)


def _open(tier: str, section: LowerTierSection, ctx: StoreContext, counters: Counters, verb: str) -> ChunkStore | None:
    """Tier ``tier``'s store, or None when it cannot start here: logged and counted
    (``store_failures``), and serving goes on without it. A ConfigError (a setting that
    cannot run here) stops start-up."""
    try:
        return open_store(tier, section, ctx)
    except ConfigError:
        raise
    except Exception as e:  # OSError, ConnectionError, ImportError with the install hint...
        # Nothing is touched: an unsafe or locked NVMe directory (another engine's) stays as it is.
        logger.error("kvtier %s: tier disabled, cannot %s %s: %s", tier, verb, section.endpoint, e)
        counters.add(CounterName.STORE_FAILURES, tier)
        return None


# ---- the scheduler's planners ------------------------------------------------------


@dataclass(frozen=True)
class _Planning:
    """What each tier's planner is built with, beside its section."""

    #: Rank 0's store context (the tier's namespace, stored block size, key, engine).
    ctx: StoreContext
    #: Shards stored of each block (:func:`stored_copies`), named ``r0`` ..
    world_size: int
    counters: Counters
    #: This instance never writes the Mooncake pool (``kv_consumer``).
    read_only_pool: bool

    def empty(self, policy: ChunkPolicy) -> ChunkPlanner:
        """A planner that knows no chunk (a tier disabled at start)."""
        return ChunkPlanner(policy, world_size=self.world_size, block_bytes_per_rank=self.ctx.block_bytes,
                            counters=self.counters, found=[{} for _ in range(self.world_size)])

    def open_ranks(self, tier: str, section: LowerTierSection) -> list[ChunkStore] | None:
        """Every rank's store, opened for lookups; None (logged, counted) if one cannot."""
        stores: list[ChunkStore] = []
        for r in range(self.world_size):
            st = _open(tier, section, dataclasses.replace(self.ctx, rank=r), self.counters, "reach")
            if st is None:
                run_all(functools.partial(s.close, timeout_s=1.0) for s in stores)
                return None
            stores.append(st)
        return stores


def make_planners(
    cfg: KVTierConfig, *, namespace: str, world_size: int, block_bytes_per_rank: int, counters: Counters,
    kv_dtype: torch.dtype | None = None, read_only_pool: bool = False, engine: int = 0,
) -> list[ChunkPlanner]:
    """Planners of the configured lower tiers, fastest first. ``world_size``: the shards
    stored of each block (:func:`stored_copies`: the ranks, or one per TP group for a
    replicated KV cache), named ``r0`` .. ``r<world_size - 1>``. ``engine``: the
    data-parallel engine (its own NVMe directories, see the module doc). ``kv_dtype``: the KV
    cache's element type (None: unknown, then every tier stores native blocks).
    ``read_only_pool``: this instance never writes the Mooncake pool (``kv_consumer``).
    Raises ConfigError when ``auth.required`` and no key is found (the scheduler only lists
    and indexes; the workers verify every chunk they read)."""
    # The scheduler verifies what it indexes with the workers' keys: a header a read would
    # refuse (a key not accepted, a MAC that does not verify, another rank) is never indexed.
    tier_ctx = TierContext.of(cfg, namespace=namespace, block_bytes=block_bytes_per_rank, kv_dtype=kv_dtype,
                              counters=counters)
    planners = []
    for tier, section in cfg.lower_tiers():
        _, ctx = tier_ctx.store_context(tier, section, rank=0, lookup_only=True, engine=engine)
        planners.append(_PLANNERS[tier](section, _Planning(ctx, world_size, counters, read_only_pool)))
    return planners


def _nvme_planner(n: NVMeTierConfig, p: _Planning) -> ChunkPlanner:
    """The NVMe planner from a read-only scan of every rank's directory. A directory held
    by another engine (its lock), one the worker will refuse as unsafe (another user's,
    writable by others), or one it cannot create (a path under a file, a read-only
    parent), turns the tier off here too: nothing of it is indexed, nothing is written
    (the worker's tier is off as well). No store is opened: that takes the lock.

    The scheduler usually runs on the workers' host, so it sees the path as they will. A path
    that only a worker's host lacks still fails there alone: each failed write is counted,
    and the write breaker pauses the tier."""
    ns, world_size, engine = p.ctx.namespace, p.world_size, p.ctx.engine
    dirs = [rank_dir(n.path, ns, r, engine) for r in range(world_size)]
    policy = ChunkPolicy(TierName.NVME, n.mode, n.admit_min_seen, n.chunk_blocks, n.capacity_bytes,
                         flush_interval_s=n.flush_interval_s, exclusive=True)
    held = [(d, who) for d in dirs if (who := lock_holder(d)) is not None]
    unsafe = [why for r in range(world_size)
              if (why := unsafe_reason(n.path, ns, r, engine) or uncreatable_reason(n.path, ns, r, engine)) is not None]
    if held or unsafe:
        if held:
            d, who = held[0]
            logger.error("kvtier nvme: tier disabled: %s is held by another engine (%s); two engines must not "
                         "share one NVMe directory (give each its own nvme.path); serving goes on without it", d, who)
        else:
            logger.error("kvtier nvme: tier disabled: %s; serving goes on without it", unsafe[0])
        p.counters.add(CounterName.STORE_FAILURES, TierName.NVME)
        return p.empty(dataclasses.replace(policy, mode="read-only"))
    refuses = functools.partial(refusal_reason, p.ctx.auth)
    # A chunk some rank could not read (EMFILE, EIO...) may be whole: never reclaimed.
    unread: set[str] = set()
    found = [scan_dir(d, ns, max_blocks=n.chunk_blocks, block_bytes=p.ctx.block_bytes, rank=r, refuses=refuses,
                      kept=unread)[0]
             for r, d in enumerate(dirs)]
    # Capacity covers every byte the tier leaves in its directories, not only the chunks.
    reserved = max(other_bytes(d) for d in dirs)
    return ChunkPlanner(policy, world_size=world_size, block_bytes_per_rank=p.ctx.block_bytes, counters=p.counters,
                        found=found, reserved_bytes_per_rank=reserved, unread=frozenset(unread))


def _foreign_namespaces(n: NVMeTierConfig, own: str, counters: Counters) -> None:
    """Report (and with ``nvme.gc_foreign_namespaces``, collect) the directories other
    namespaces left under ``nvme.path``: rank 0's worker of data-parallel engine 0 (one
    report per host), at start, once its own lock is held."""
    left = 0
    for ns in foreign_namespaces(n.path, {own}):
        age = "no file" if ns.newest_age_s is None else f"newest file {ns.newest_age_s / 3600:.1f} h old"
        if n.gc_foreign_namespaces and not ns.keep_reason:
            freed = collect_namespace(ns)
            if freed or not ns.path.exists():
                logger.warning("kvtier nvme: collected namespace directory %s (%d files, %d bytes, %s)",
                               ns.path, ns.files, freed, age)
                counters.add(CounterName.RECLAIMED_BYTES, TierName.NVME, freed)
                continue
        left += ns.nbytes
        why = ns.keep_reason or "set nvme.gc_foreign_namespaces: true to delete it"
        logger.warning("kvtier nvme: another namespace's directory %s holds %d files, %d bytes (%s): KV this "
                       "engine never reads; kept: %s", ns.path, ns.files, ns.nbytes, age, why)
    counters.set_gauge(GaugeName.FOREIGN_BYTES, TierName.NVME, left)


def _mooncake_planner(mc: MooncakeTierConfig, p: _Planning) -> ChunkPlanner:
    """One object per block, named by its key: the planner's lookups ask the master which
    exist (a pool cannot be listed), on the lookup thread
    (:class:`~vllm_kvtier.catalog.pool.PoolLookup`), each bounded by ``lookup_timeout_s``."""
    policy = ChunkPolicy(TierName.MOONCAKE, "read-only" if p.read_only_pool else mc.mode, mc.admit_min_seen,
                         mc.chunk_blocks, None, key_named=True)
    # The scheduler only asks what exists: a pure client (no pool memory of its own).
    opened = p.open_ranks(TierName.MOONCAKE, mc)
    if opened is None:
        return p.empty(policy)
    stores = [cast(Probeable, st) for st in opened]

    def exists_everywhere(ids: list[str]) -> list[bool]:
        per_rank = [st.exists(ids) for st in stores]
        return [all(col) for col in zip(*per_rank, strict=True)]

    def close() -> None:
        run_all(functools.partial(st.close, timeout_s=1.0) for st in opened)

    lookups = PoolLookup(TierName.MOONCAKE, exists_everywhere, timeout_s=mc.lookup_timeout_s, counters=p.counters,
                         on_close=close)
    return ChunkPlanner(policy, world_size=p.world_size, block_bytes_per_rank=p.ctx.block_bytes,
                        counters=p.counters, found=[{} for _ in range(p.world_size)], catalog=lookups)


def _s3_planner(s3: S3TierConfig, p: _Planning) -> ChunkPlanner:
    """The bucket listed at start-up (every rank's prefix), then rescanned on a thread to
    find what other instances stored. Its stores only list and read headers (boto3)."""
    policy = ChunkPolicy(TierName.S3, s3.mode, s3.admit_min_seen, s3.chunk_blocks, s3.capacity_bytes,
                         flush_interval_s=s3.flush_interval_s)
    opened = p.open_ranks(TierName.S3, s3)
    if opened is None:
        return p.empty(policy)
    stores = cast("list[S3Store]", opened)

    def scan() -> Found:
        """The start-up scan, within ``s3.scan_deadline_s`` for every rank together (each
        rank gets an equal share of what is left when its turn comes)."""
        end = time.monotonic() + s3.store.scan_deadline_s
        out = []
        for i, st in enumerate(stores):
            now = time.monotonic()
            out.append(st.scan(deadline=now + max(0.0, end - now) / (len(stores) - i)).found)
        return out

    def rescan_counts() -> dict[CounterName, int]:
        return {CounterName.MANIFESTS_COLLECTED: sum(st.last_scan.manifests_collected for st in stores),
                CounterName.MANIFESTS_REFUSED: sum(st.last_scan.manifests_refused for st in stores)}

    def rescan() -> Found:
        """A live instance's rescan (the rescan thread): collects stale manifests, and
        raises if a listing failed (a failed listing is not "everything was deleted")."""
        out = []
        for st in stores:
            got = st.scan(collect=True).found
            r = st.last_scan
            if not r.complete:
                raise RuntimeError(f"listing rank {st.rank} failed: {r.problems}")
            if r.manifests_collected:
                logger.info("kvtier s3: rank %d: deleted %d stale manifest(s)", st.rank, r.manifests_collected)
            out.append(got)
        return out

    found = scan()
    p.counters.add(CounterName.MANIFESTS_REFUSED, TierName.S3, sum(st.last_scan.manifests_refused for st in stores))
    cut = [st.rank for st in stores if st.last_scan.cut_short]
    if cut:
        p.counters.add(CounterName.SCAN_CUT_SHORT, TierName.S3, len(cut))
        logger.warning("kvtier s3: start-up scan of rank(s) %s cut short by s3.scan_deadline_s (%.0f s): "
                       "indexed what it reached, the rescans find the rest", cut, s3.store.scan_deadline_s)
    # Chunks on only some ranks (a write in flight, a crashed one) are never indexed; those
    # our own manifest names (this host, rank and namespace before the restart: no other
    # live writer) are deleted, unless a scan was cut short (then they may be on every rank).
    partial = set().union(*found) - set(common_chunks(found))
    p.counters.set_gauge(GaugeName.PARTIAL_CHUNKS, TierName.S3, len(partial))
    own: set[str] = set().union(*(st.take_own_objects() for st in stores))
    ours = [] if cut else sorted(partial & own)
    for st in stores:
        r = st.last_scan
        logger.info("kvtier s3: rank %d: %d objects in the bucket (%d LIST, %d manifest GET, %d header GET)%s",
                    st.rank, r.objects, r.list_requests, r.manifest_gets, r.header_gets,
                    f"; problems {r.problems}" if r.problems else "")

    def close() -> None:
        run_all(functools.partial(st.close, timeout_s=1.0) for st in stores)

    catalog = (Rescanner(TierName.S3, rescan, s3.rescan_interval_s, initial=found, counts=rescan_counts,
                         on_close=close)
               if s3.rescan_interval_s > 0 else Listed(close))
    planner = ChunkPlanner(policy, world_size=p.world_size, block_bytes_per_rank=p.ctx.block_bytes,
                           counters=p.counters, found=found, catalog=catalog,
                           local_chunks=frozenset(own))  # KV events: the rest is REMOTE
    if ours:
        logger.info("kvtier s3: deleting %d chunk(s) a previous run left on only some ranks", len(ours))
        planner.reclaim(ours)
    return planner


#: The scheduler's half of each medium: how its planner learns what the tier holds (a
#: directory scan, a bucket listing and rescans, lookups by key).
_PLANNERS: dict[TierName, Callable[[Any, _Planning], ChunkPlanner]] = {
    TierName.NVME: _nvme_planner,
    TierName.S3: _s3_planner,
    TierName.MOONCAKE: _mooncake_planner,
}


# ---- the workers' data paths -------------------------------------------------------


def make_workers(
    cfg: KVTierConfig, *, namespace: str, rank: int, slots: SlotTable, counters: Counters,
    kv_dtype: torch.dtype | None = None, role: RankRole | None = None, engine: int = 0,
) -> dict[str, ChunkWorker]:
    """This rank's data path of each configured lower tier, by tier name. ``rank``: within
    the engine; ``engine``: the data-parallel engine (see the module doc). ``slots``: the
    worker's slot table (its pool's slot size is the block size stored); ``kv_dtype``: the
    KV cache's (None: unknown, native storage). ``role``: whose chunks this rank's blocks
    are and whether it writes them (None: its own, written by it; see :class:`RankRole`).

    One :class:`~vllm_kvtier.tiers.buffers.BufferPool` per call (one per worker process)
    is handed to every store and chunk driver built here: their transfer buffers share one
    bound on idle memory.

    Authentication (``auth``): with a key found, the shared tiers (s3, mooncake) sign and
    verify every chunk, and nvme too when ``auth.local_tiers``; ConfigError when
    ``auth.required`` and there is none."""
    tier_ctx = TierContext.of(cfg, namespace=namespace, block_bytes=slots.pool.slot_bytes, kv_dtype=kv_dtype,
                              counters=counters)
    role = role or RankRole(rank)
    buffers = BufferPool(DEFAULT_IDLE_BYTES)
    return {tier: _worker(tier, section, tier_ctx, rank=rank, role=role, slots=slots, buffers=buffers,
                          dp_engine=engine)
            for tier, section in cfg.lower_tiers()}


def _worker(tier: TierName, section: LowerTierSection, tier_ctx: TierContext, *, rank: int, role: RankRole,
            slots: SlotTable, buffers: BufferPool, dp_engine: int) -> ChunkWorker:
    """One tier's chunk driver over its store (None if the store cannot start: every
    write and read is a miss). A shared medium's headers are fetched on a chunk's first
    read (one ranged GET, then kept): no listing here, the scheduler lists. A private
    medium's writer lists and cleans it first, once its lock is held."""
    shared = tier_entry(tier).shared
    f, ctx = tier_ctx.store_context(tier, section, rank=role.store_rank, buffers=buffers, replica=not role.writes,
                                  engine=dp_engine)
    store = _open(tier, section, ctx, tier_ctx.counters, "use")
    headers: dict[str, ChunkHeader] = {}
    if not shared and role.writes and isinstance(store, Scannable):  # a replica reader fetches them
        headers = _start_up_scan(tier, store, tier_ctx.counters)
        if rank == 0 and dp_engine == 0 and isinstance(section, NVMeTierConfig):
            _foreign_namespaces(section, f.namespace, tier_ctx.counters)
    return ChunkWorker(tier, store, slots=slots, counters=tier_ctx.counters, mode=section.mode,
                       chunk_blocks=section.chunk_blocks, flush_on_shutdown_s=section.flush_on_shutdown_s,
                       headers=headers, fetches_headers=shared,
                       codec=make_codec(f.fmt, tier_ctx.block_bytes, tier_ctx.kv_dtype), buffers=buffers,
                       max_headers=section.header_cache_entries, max_header_bytes=section.header_cache_bytes,
                       writes=role.writes)


def _start_up_scan(tier: str, store: Scannable, counters: Counters) -> dict[str, ChunkHeader]:
    """Every chunk a private medium holds, its debris deleted; what was dropped or kept
    unread is logged and counted."""
    scanned = store.scan(cleanup=True)
    for reason, count in scanned.problems.items():
        kept = reason in ("not_regular", UNREADABLE_KEPT)  # neither is deleted (see scan_dir)
        logger.warning("kvtier %s: %d file(s) %s at start-up: %s", tier, count,
                       "skipped (kept)" if kept else "dropped", reason)
        counters.add(CounterName.LOAD_FAILURES, tier, count)
        if not kept:
            counters.add(CounterName.RECLAIMED_FILES, tier, count)
    return scanned.found
