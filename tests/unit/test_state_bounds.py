"""Issue 14: the worker's header cache of a store that fetches headers (S3, Mooncake) and the
prefetcher's set of prefetched keys stay bounded however long the process runs."""

from __future__ import annotations

import time

from vllm_kvtier.catalog.base import Listing
from vllm_kvtier.chunkformat import chunk_id_for, header_memory_bytes, make_header
from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.jobs import ChunkRead, ChunkWriteJob, WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext
from vllm_kvtier.plan.parts import PlanParts
from vllm_kvtier.plan.prefetch import Prefetcher
from vllm_kvtier.plan.promotions import Promotions
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.tiers.memory import MemoryStore
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.tier_io import ChunkWorker, DriverContext, DriverSettings


def _settle(w: ChunkWorker, want: int) -> list[tuple[int, ChunkRead, bool]]:
    done: list[tuple[int, ChunkRead, bool]] = []
    meta = WorkerReport()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done += w.poll()
        w.take_meta(meta)
        if len(meta.written) + len(done) >= want:
            return done
        time.sleep(0.005)
    raise AssertionError("the store did not answer")


def test_worker_header_cache_of_a_fetching_store_is_bounded() -> None:
    pool = CPUPool(8, (4096,), pin=False, prefault=False)
    slots = SlotTable(pool)
    store = MemoryStore("ns", pool.slot_bytes)
    w = ChunkWorker("s3", store, DriverSettings("write-through", 1, 1.0, header_cache_entries=2), DriverContext(slots, Counters(), fetches_headers=True))
    try:
        keys = [bytes([i]) * 32 for i in range(5)]
        ids = [chunk_id_for([k]) for k in keys]
        for i, (k, fid) in enumerate(zip(keys, ids, strict=True)):
            slots.set_key(i, k)
            w.write([ChunkWriteJob("s3", fid, (i,), (k,))])
            _settle(w, 1)
            assert len(w.headers) <= 2
        assert list(w.headers) == ids[3:]
        # A chunk whose header left the cache is still read (its header fetched again).
        slots.set_key(7, None)
        w.start_read(ChunkRead("s3", ids[0], (0,), (7,), (keys[0],)))
        (_, _, ok), = _settle(w, 1)
        assert ok and len(w.headers) <= 2
    finally:
        w.close()


def test_worker_header_cache_is_bounded_by_bytes() -> None:
    """Many-block headers cost many times a one-block one: the cache holds at most
    ``max_header_bytes`` of them (by header_memory_bytes), however loose the count bound.
    Before: bounded by count only (all six 8-block headers kept)."""
    pool = CPUPool(64, (4096,), pin=False, prefault=False)
    slots = SlotTable(pool)
    store = MemoryStore("ns", pool.slot_bytes)
    one = header_memory_bytes(make_header("ns", [bytes(32)] * 8, [0] * 8, pool.slot_bytes))
    w = ChunkWorker("s3", store, DriverSettings("write-through", 8, 1.0, header_cache_entries=1000, header_cache_bytes=3 * one), DriverContext(slots, Counters(), fetches_headers=True))
    try:
        ids = []
        for c in range(6):
            keys = tuple(bytes([c, i]) * 16 for i in range(8))
            for i, k in enumerate(keys):
                slots.set_key(8 * c + i, k)
            ids.append(chunk_id_for(keys))
            w.write([ChunkWriteJob("s3", ids[-1], tuple(range(8 * c, 8 * c + 8)), keys)])
            _settle(w, 1)
            assert sum(map(header_memory_bytes, w.headers.values())) <= 3 * one
        assert list(w.headers) == ids[3:]
    finally:
        w.close()


def test_prefetched_keys_are_bounded() -> None:
    index = SlotIndex(16)
    chains = [[BlockKey(bytes([c, i]) * 16) for i in range(2)] for c in range(6)]
    bb = 4096
    found = {f"c{i}": make_header("ns", list(ch), [0, 0], bb) for i, ch in enumerate(chains)}
    tier = ChunkPlanner(ChunkPolicy("nvme", "write-back", 1, 2, None), PlannerContext(1, bb, Counters()), Listing([found]))
    promotions = Promotions(index, [tier])

    def locate(k: BlockKey) -> tuple[ChunkPlanner, str, int] | None:
        loc = tier.locate(k)
        return None if loc is None else (tier, *loc)

    p = Prefetcher(PlanParts(index, [tier], Counters(), promotions, locate), world_size=1, max_inflight_blocks=64,
                   max_age_s=60.0, max_prefetched_keys=3)
    for ch in chains:
        p.predict(ch)
        (job,) = p.take_jobs()
        p.on_worker_meta(WorkerReport(prefetched={job.prefetch_id: 1}))
        assert len(p.prefetched) <= 3
    assert set(p.prefetched) <= set(chains[-1]) | set(chains[-2])
    tier.close()
