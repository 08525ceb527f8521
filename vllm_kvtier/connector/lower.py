"""Building the tiers below CPU (NVMe, S3) from the config: the scheduler's planners and
each worker's stores. The one place that knows which medium backs which tier name.

Who calls it: :class:`~vllm_kvtier.connector.KVTierConnector` at construction (scheduler
role: :func:`make_planners`; worker role: :func:`make_workers`, once the CPU pool exists).
Both may block at start-up (a directory scan; a bucket listing bounded by its deadline).
A tier that cannot start is logged and disabled (every write and read a miss); serving
goes on.
"""

from __future__ import annotations

import logging

from vllm_kvtier.config import KVTierConfig, S3TierConfig
from vllm_kvtier.connector.chunk_plan import ChunkPlanner, ChunkPolicy, Found, Rescanner
from vllm_kvtier.connector.chunk_worker import ChunkWorker
from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.chunkfile import ChunkHeader
from vllm_kvtier.tiers.nvme import NVMeStore, rank_dir, scan_dir

logger = logging.getLogger(__name__)


def make_planners(
    cfg: KVTierConfig, *, namespace: str, world_size: int, block_bytes_per_rank: int, counters: Counters
) -> list[ChunkPlanner]:
    """Planners of the configured lower tiers, fastest first."""
    planners = []
    n = cfg.nvme
    if n is not None:
        found = [scan_dir(rank_dir(n.path, namespace, r), namespace)[0] for r in range(world_size)]
        policy = ChunkPolicy("nvme", n.mode, n.admit_min_seen, n.chunk_blocks, n.capacity_bytes)
        planners.append(ChunkPlanner(policy, world_size=world_size, block_bytes_per_rank=block_bytes_per_rank,
                                     counters=counters, found=found))
    if cfg.s3 is not None:
        planners.append(_s3_planner(cfg.s3, namespace, world_size, block_bytes_per_rank, counters))
    return planners


def _s3_planner(
    s3: S3TierConfig, namespace: str, world_size: int, block_bytes: int, counters: Counters
) -> ChunkPlanner:
    policy = ChunkPolicy("s3", s3.mode, s3.admit_min_seen, s3.chunk_blocks, s3.capacity_bytes)
    try:
        from vllm_kvtier.tiers.s3 import S3Store

        stores = [S3Store(s3.store, namespace, r, block_bytes) for r in range(world_size)]
    except Exception as e:
        logger.error("kvtier s3: tier disabled, cannot reach bucket %r: %s", s3.store.bucket, e)
        counters.add("store_failures", "s3")
        return ChunkPlanner(policy, world_size=world_size, block_bytes_per_rank=block_bytes,
                            counters=counters, found=[{} for _ in range(world_size)])

    def scan() -> Found:
        return [st.scan() for st in stores]

    found = scan()
    for st in stores:
        r = st.last_scan
        logger.info("kvtier s3: rank %d: %d objects in the bucket (%d LIST, %d manifest GET, %d header GET)%s",
                    st.rank, r.objects, r.list_requests, r.manifest_gets, r.header_gets,
                    f"; problems {r.problems}" if r.problems else "")
    rescanner = Rescanner("s3", scan, s3.rescan_interval_s) if s3.rescan_interval_s > 0 else None

    def close() -> None:
        for st in stores:
            st.close(timeout_s=1.0)

    return ChunkPlanner(policy, world_size=world_size, block_bytes_per_rank=block_bytes, counters=counters,
                        found=found, rescanner=rescanner, on_close=close)


def make_workers(
    cfg: KVTierConfig, *, namespace: str, rank: int, block_bytes: int, counters: Counters
) -> dict[str, ChunkWorker]:
    """This rank's data path of each configured lower tier, by tier name."""
    workers: dict[str, ChunkWorker] = {}
    n = cfg.nvme
    if n is not None:
        nvme_store: NVMeStore | None = None
        headers: dict[str, ChunkHeader] = {}
        try:
            nvme_store = NVMeStore(n.path, namespace, rank, block_bytes, direct_io=n.direct_io,
                                   io_threads=n.io_threads, max_queued_writes=n.max_queued_writes)
        except OSError as e:
            # Serving goes on without the tier: every NVMe write and read is a miss.
            logger.error("kvtier nvme: tier disabled, cannot use %s: %s", n.path, e)
            counters.add("store_failures", "nvme")
        if nvme_store is not None:
            headers, problems = scan_dir(nvme_store.dir, namespace, cleanup=True)
            for reason, count in problems.items():
                logger.warning("kvtier nvme: %d file(s) dropped at start-up: %s", count, reason)
                counters.add("load_failures", "nvme", count)
        workers["nvme"] = ChunkWorker("nvme", nvme_store, counters=counters, mode=n.mode,
                                      chunk_blocks=n.chunk_blocks, flush_on_shutdown_s=n.flush_on_shutdown_s,
                                      headers=headers)
    s3 = cfg.s3
    if s3 is not None:
        s3_store = None
        try:
            from vllm_kvtier.tiers.s3 import S3Store

            s3_store = S3Store(s3.store, namespace, rank, block_bytes)
        except Exception as e:
            logger.error("kvtier s3: tier disabled, cannot use bucket %r: %s", s3.store.bucket, e)
            counters.add("store_failures", "s3")
        # No listing here: the scheduler lists the bucket; a chunk's header is fetched on
        # its first read (one ranged GET) and kept.
        workers["s3"] = ChunkWorker("s3", s3_store, counters=counters, mode=s3.mode,
                                    chunk_blocks=s3.chunk_blocks, flush_on_shutdown_s=s3.flush_on_shutdown_s,
                                    fetches_headers=True,
                                    remote_stats=s3_store.stats if s3_store is not None else None)
    return workers
