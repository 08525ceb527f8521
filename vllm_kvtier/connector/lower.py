"""Building the tiers below CPU (NVMe, S3) from the config: the scheduler's planners and
each worker's stores. The one place that knows which medium backs which tier name.

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
from dataclasses import dataclass

import torch

from vllm_kvtier.config import KVTierConfig, MooncakeTierConfig, NVMeTierConfig, S3TierConfig
from vllm_kvtier.errors import ConfigError, run_all
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters, GaugeName
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, Found, Rescanner, common_chunks
from vllm_kvtier.tiers.auth import ChunkAuth, load_auth, refusal_reason
from vllm_kvtier.tiers.buffers import DEFAULT_IDLE_BYTES, BufferPool
from vllm_kvtier.tiers.chunkfile import ChunkHeader
from vllm_kvtier.tiers.nvme import UNREADABLE_KEPT, NVMeStore, other_bytes, rank_dir, scan_dir
from vllm_kvtier.tiers.nvme_dir import collect_namespace, foreign_namespaces, lock_holder, unsafe_reason
from vllm_kvtier.transfer.fp8 import (
    StorageDtype,
    StorageFormat,
    make_codec,
    storage_format,
    stored_block_bytes,
)
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.tier_io import ChunkWorker

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


def make_planners(
    cfg: KVTierConfig, *, namespace: str, world_size: int, block_bytes_per_rank: int, counters: Counters,
    kv_dtype: torch.dtype | None = None, read_only_pool: bool = False,
) -> list[ChunkPlanner]:
    """Planners of the configured lower tiers, fastest first. ``world_size``: the shards
    stored of each block (:func:`stored_copies`: the ranks, or one per TP group for a
    replicated KV cache), named ``r0`` .. ``r<world_size - 1>``. ``kv_dtype``: the KV
    cache's element type (None: unknown, then every tier stores native blocks).
    ``read_only_pool``: this instance never writes the Mooncake pool (``kv_consumer``).
    Raises ConfigError when ``auth.required`` and no key is found (the scheduler only lists
    and indexes; the workers verify every chunk they read)."""
    # The scheduler verifies what it indexes with the workers' keys: a header a read would
    # refuse (a key not accepted, a MAC that does not verify, another rank) is never indexed.
    auth = load_auth(cfg.auth)
    planners = []
    n = cfg.nvme
    if n is not None:
        f = tier_format(TierName.NVME, n.storage_dtype, namespace=namespace, block_bytes=block_bytes_per_rank,
                        kv_dtype=kv_dtype)
        planners.append(_nvme_planner(n, f, world_size, counters, auth if cfg.auth.local_tiers else None))
    if cfg.s3 is not None:
        f = tier_format(TierName.S3, cfg.s3.storage_dtype, namespace=namespace, block_bytes=block_bytes_per_rank,
                        kv_dtype=kv_dtype)
        planners.append(_s3_planner(cfg.s3, f.namespace, world_size, f.block_bytes, counters, auth))
    if cfg.mooncake is not None:
        planners.append(_mooncake_planner(cfg.mooncake, namespace, world_size, block_bytes_per_rank, counters,
                                          read_only_pool))
    return planners


def _nvme_planner(n: NVMeTierConfig, f: TierFormat, world_size: int, counters: Counters,
                  auth: ChunkAuth | None) -> ChunkPlanner:
    """The NVMe planner from a read-only scan of every rank's directory. A directory held
    by another engine (its lock), or one the worker will refuse as unsafe (another user's,
    writable by others), turns the tier off here too: nothing of it is indexed, nothing is
    written (the worker refuses it as well)."""
    dirs = [rank_dir(n.path, f.namespace, r) for r in range(world_size)]
    policy = ChunkPolicy(TierName.NVME, n.mode, n.admit_min_seen, n.chunk_blocks, n.capacity_bytes,
                         flush_interval_s=n.flush_interval_s, exclusive=True)
    held = [(d, who) for d in dirs if (who := lock_holder(d)) is not None]
    unsafe = [why for r in range(world_size) if (why := unsafe_reason(n.path, f.namespace, r)) is not None]
    if held or unsafe:
        if held:
            d, who = held[0]
            logger.error("kvtier nvme: tier disabled: %s is held by another engine (%s); two engines must not "
                         "share one NVMe directory (give each its own nvme.path); serving goes on without it", d, who)
        else:
            logger.error("kvtier nvme: tier disabled: %s; serving goes on without it", unsafe[0])
        counters.add(CounterName.STORE_FAILURES, TierName.NVME)
        return ChunkPlanner(dataclasses.replace(policy, mode="read-only"), world_size=world_size,
                            block_bytes_per_rank=f.block_bytes, counters=counters, found=[{} for _ in dirs])
    refuses = functools.partial(refusal_reason, auth)
    found = [scan_dir(d, f.namespace, max_blocks=n.chunk_blocks, block_bytes=f.block_bytes, rank=r, refuses=refuses)[0]
             for r, d in enumerate(dirs)]
    # Capacity covers every byte the tier leaves in its directories, not only the chunks.
    reserved = max(other_bytes(d) for d in dirs)
    return ChunkPlanner(policy, world_size=world_size, block_bytes_per_rank=f.block_bytes, counters=counters,
                        found=found, reserved_bytes_per_rank=reserved)


def _foreign_namespaces(n: NVMeTierConfig, own: str, counters: Counters) -> None:
    """Report (and with ``nvme.gc_foreign_namespaces``, collect) the directories other
    namespaces left under ``nvme.path``: rank 0's worker, at start, once its own lock is held."""
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


def _mooncake_planner(
    mc: MooncakeTierConfig, namespace: str, world_size: int, block_bytes: int, counters: Counters,
    read_only: bool,
) -> ChunkPlanner:
    """One object per block, named by its key: lookups ask the master which exist (a pool
    cannot be listed), in a background thread bounded by ``lookup_timeout_s``."""
    from concurrent.futures import Future, ThreadPoolExecutor
    from concurrent.futures import TimeoutError as FutureTimeout

    policy = ChunkPolicy(TierName.MOONCAKE, "read-only" if read_only else mc.mode, mc.admit_min_seen, 1, None,
                         key_named=True)
    common = {"world_size": world_size, "block_bytes_per_rank": block_bytes, "counters": counters,
              "found": [{} for _ in range(world_size)]}
    try:
        from vllm_kvtier.tiers.mooncake import MooncakeStore

        # The scheduler only asks what exists: a pure client (no pool memory of its own).
        light = dataclasses.replace(mc.store, global_segment_bytes=0, transfer_buffer_bytes=1 << 20, io_threads=1)
        stores = [MooncakeStore(light, namespace, r, block_bytes) for r in range(world_size)]
    except Exception as e:
        logger.error("kvtier mooncake: tier disabled, cannot reach master %s: %s", mc.store.master, e)
        counters.add(CounterName.STORE_FAILURES, TierName.MOONCAKE)
        return ChunkPlanner(policy, **common)  # type: ignore[arg-type]
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-mooncake-lookup")
    #: a lookup that timed out: the ids it asked about, and its answer to come
    inflight: list[tuple[list[str], Future[list[bool]]]] = []

    def exists_everywhere(ids: list[str]) -> list[bool]:
        per_rank = [st.exists(ids) for st in stores]
        return [all(col) for col in zip(*per_rank, strict=True)]

    def oracle(ids: list[str]) -> list[bool] | None:
        if inflight:
            asked, fut = inflight[0]
            if not fut.done():
                # The previous lookup still hangs (master gone?): a miss, not counted again. Its
                # timeout was; vLLM steps a waiting request thousands of times a second, and a
                # count per step would say more about the step rate than about the pool.
                return None
            inflight.clear()
            if asked == ids and fut.exception() is None:
                # It timed out here but has answered since: use that answer (on a loaded host
                # every lookup may take longer than lookup_timeout_s; asking afresh each time
                # would never see one, and a P/D decode request would wait out its hand-off).
                return fut.result()
        fut = pool.submit(exists_everywhere, ids)
        try:
            return fut.result(timeout=mc.lookup_timeout_s)
        except FutureTimeout:
            inflight[:] = [(ids, fut)]
            counters.add(CounterName.LOOKUP_TIMEOUTS, TierName.MOONCAKE)
            return None

    def close() -> None:
        pool.shutdown(wait=False)
        run_all(functools.partial(st.close, timeout_s=1.0) for st in stores)

    return ChunkPlanner(policy, oracle=oracle, on_close=close, **common)  # type: ignore[arg-type]


def _s3_planner(
    s3: S3TierConfig, namespace: str, world_size: int, block_bytes: int, counters: Counters, auth: ChunkAuth | None,
) -> ChunkPlanner:
    policy = ChunkPolicy(TierName.S3, s3.mode, s3.admit_min_seen, s3.chunk_blocks, s3.capacity_bytes,
                         flush_interval_s=s3.flush_interval_s)
    try:
        # The scheduler only lists and reads headers, which always go through boto3: no
        # NIXL agent here whatever s3.io_engine says (the workers check that it runs).
        import dataclasses

        from vllm_kvtier.tiers.s3 import S3Store

        listing = dataclasses.replace(s3.store, io_engine="boto3")
        stores = [S3Store(listing, namespace, r, block_bytes, max_chunk_blocks=s3.chunk_blocks, auth=auth)
                  for r in range(world_size)]
    except Exception as e:
        logger.error("kvtier s3: tier disabled, cannot reach bucket %r: %s", s3.store.bucket, e)
        counters.add(CounterName.STORE_FAILURES, TierName.S3)
        return ChunkPlanner(policy, world_size=world_size, block_bytes_per_rank=block_bytes,
                            counters=counters, found=[{} for _ in range(world_size)])

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
        return {CounterName.MANIFESTS_COLLECTED: sum(st.last_scan.manifests_collected for st in stores)}

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
    cut = [st.rank for st in stores if st.last_scan.cut_short]
    if cut:
        counters.add(CounterName.SCAN_CUT_SHORT, TierName.S3, len(cut))
        logger.warning("kvtier s3: start-up scan of rank(s) %s cut short by s3.scan_deadline_s (%.0f s): "
                       "indexed what it reached, the rescans find the rest", cut, s3.store.scan_deadline_s)
    # Chunks on only some ranks (a write in flight, a crashed one) are never indexed; those
    # our own manifest names (this host, rank and namespace before the restart: no other
    # live writer) are deleted, unless a scan was cut short (then they may be on every rank).
    partial = set().union(*found) - set(common_chunks(found))
    counters.set_gauge(GaugeName.PARTIAL_CHUNKS, TierName.S3, len(partial))
    own: set[str] = set().union(*(st.take_own_objects() for st in stores))
    ours = [] if cut else sorted(partial & own)
    for st in stores:
        r = st.last_scan
        logger.info("kvtier s3: rank %d: %d objects in the bucket (%d LIST, %d manifest GET, %d header GET)%s",
                    st.rank, r.objects, r.list_requests, r.manifest_gets, r.header_gets,
                    f"; problems {r.problems}" if r.problems else "")
    rescanner = (Rescanner(TierName.S3, rescan, s3.rescan_interval_s, initial=found, counts=rescan_counts)
                 if s3.rescan_interval_s > 0 else None)

    def close() -> None:
        run_all(functools.partial(st.close, timeout_s=1.0) for st in stores)

    planner = ChunkPlanner(policy, world_size=world_size, block_bytes_per_rank=block_bytes, counters=counters,
                           found=found, rescanner=rescanner, on_close=close,
                           local_chunks=frozenset(own))  # KV events: the rest is REMOTE
    if ours:
        logger.info("kvtier s3: deleting %d chunk(s) a previous run left on only some ranks", len(ours))
        planner.reclaim(ours)
    return planner


def make_workers(
    cfg: KVTierConfig, *, namespace: str, rank: int, slots: SlotTable, counters: Counters,
    kv_dtype: torch.dtype | None = None, role: RankRole | None = None,
) -> dict[str, ChunkWorker]:
    """This rank's data path of each configured lower tier, by tier name. ``slots``: the
    worker's slot table (its pool's slot size is the block size stored); ``kv_dtype``: the
    KV cache's (None: unknown, native storage). ``role``: whose chunks this rank's blocks
    are and whether it writes them (None: its own, written by it; see :class:`RankRole`).

    One :class:`~vllm_kvtier.tiers.buffers.BufferPool` per call (one per worker process)
    is handed to every store and chunk driver built here: their transfer buffers share one
    bound on idle memory.

    Authentication (``auth``): with a key found, the shared tiers (s3, mooncake) sign and
    verify every chunk, and nvme too when ``auth.local_tiers``; ConfigError when
    ``auth.required`` and there is none."""
    auth = load_auth(cfg.auth)
    role = role or RankRole(rank)
    workers: dict[str, ChunkWorker] = {}
    block_bytes = slots.pool.slot_bytes
    buffers = BufferPool(DEFAULT_IDLE_BYTES)
    n = cfg.nvme
    if n is not None:
        f = tier_format(TierName.NVME, n.storage_dtype, namespace=namespace, block_bytes=block_bytes, kv_dtype=kv_dtype)
        nvme_store: NVMeStore | None = None
        headers: dict[str, ChunkHeader] = {}
        try:
            nvme_store = NVMeStore(n.path, f.namespace, role.store_rank, f.block_bytes, direct_io=n.direct_io,
                                   io_threads=n.io_threads, max_queued_writes=n.max_queued_writes,
                                   io_engine=n.io_engine, max_chunk_blocks=n.chunk_blocks, buffers=buffers,
                                   auth=auth if cfg.auth.local_tiers else None, replica=not role.writes)
        except OSError as e:  # a ConfigError (nvme.io_engine cannot run here) stops start-up
            # Serving goes on without the tier: every NVMe write and read is a miss. An
            # unsafe or locked directory (another engine's) is left exactly as it is.
            logger.error("kvtier nvme: tier disabled, cannot use %s: %s", n.path, e)
            counters.add(CounterName.STORE_FAILURES, TierName.NVME)
        if nvme_store is not None and role.writes:  # a replica reader fetches headers as it reads
            scanned = nvme_store.scan(cleanup=True)  # only now: the directory's lock is held
            headers = scanned.found
            for reason, count in scanned.problems.items():
                kept = reason in ("not_regular", UNREADABLE_KEPT)  # neither is deleted (see scan_dir)
                logger.warning("kvtier nvme: %d file(s) %s at start-up: %s", count,
                               "skipped (kept)" if kept else "dropped", reason)
                counters.add(CounterName.LOAD_FAILURES, TierName.NVME, count)
                if not kept:
                    counters.add(CounterName.RECLAIMED_FILES, TierName.NVME, count)
            if rank == 0:
                _foreign_namespaces(n, f.namespace, counters)
        workers[TierName.NVME] = ChunkWorker(TierName.NVME, nvme_store, slots=slots, counters=counters, mode=n.mode,
                                      chunk_blocks=n.chunk_blocks, flush_on_shutdown_s=n.flush_on_shutdown_s,
                                      headers=headers, codec=make_codec(f.fmt, block_bytes, kv_dtype),
                                      buffers=buffers, writes=role.writes)
    s3 = cfg.s3
    if s3 is not None:
        f = tier_format(TierName.S3, s3.storage_dtype, namespace=namespace, block_bytes=block_bytes, kv_dtype=kv_dtype)
        s3_store = None
        try:
            from vllm_kvtier.tiers.s3 import S3Store

            s3_store = S3Store(s3.store, f.namespace, role.store_rank, f.block_bytes, buffers=buffers,
                               max_chunk_blocks=s3.chunk_blocks, auth=auth)
        except ConfigError:  # s3.io_engine cannot run here: a configuration mistake stops start-up
            raise
        except Exception as e:
            logger.error("kvtier s3: tier disabled, cannot use bucket %r: %s", s3.store.bucket, e)
            counters.add(CounterName.STORE_FAILURES, TierName.S3)
        # No listing here: the scheduler lists the bucket; a chunk's header is fetched on
        # its first read (one ranged GET) and kept.
        workers[TierName.S3] = ChunkWorker(TierName.S3, s3_store, slots=slots, counters=counters, mode=s3.mode,
                                    chunk_blocks=s3.chunk_blocks, flush_on_shutdown_s=s3.flush_on_shutdown_s,
                                    fetches_headers=True, codec=make_codec(f.fmt, block_bytes, kv_dtype),
                                    remote_stats=s3_store.stats if s3_store is not None else None,
                                    buffers=buffers, max_headers=s3.store.header_cache_entries,
                                    max_header_bytes=s3.store.header_cache_bytes, writes=role.writes)
    mc = cfg.mooncake
    if mc is not None:
        mc_store = None
        try:
            from vllm_kvtier.tiers.mooncake import MooncakeStore

            mc_store = MooncakeStore(mc.store, namespace, role.store_rank, block_bytes, max_chunk_blocks=1, buffers=buffers,
                                     auth=auth)
        except Exception as e:  # ImportError (with its install hint), ConnectionError, ...
            logger.error("kvtier mooncake: tier disabled, cannot join the pool at %s: %s", mc.store.master, e)
            counters.add(CounterName.STORE_FAILURES, TierName.MOONCAKE)
        workers[TierName.MOONCAKE] = ChunkWorker(TierName.MOONCAKE, mc_store, slots=slots, counters=counters, mode=mc.mode, chunk_blocks=1,
                                          flush_on_shutdown_s=0.0, fetches_headers=True,
                                          remote_stats=mc_store.stats if mc_store is not None else None,
                                          buffers=buffers, writes=role.writes)
    return workers
