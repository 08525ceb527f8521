"""The worker's slot table and a tier driver that reads it (no engine): what each CPU slot
holds decides what may be written to a lower tier, loaded, or flushed at shutdown."""

from __future__ import annotations

import errno
import threading
import time

import torch

from vllm_kvtier.chunkformat import chunk_id_for
from vllm_kvtier.jobs import ChunkRead, ChunkWriteJob, WorkerReport
from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.buffers import AlignedBuffer, BufferPool
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.tiers.memory import MemoryStore
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.tier_io import ChunkWorker, DriverContext, DriverSettings

PLANES = (4096, 4096)


class _Stamps:
    def __init__(self) -> None:
        self.seen: list[tuple[int, bytes | None]] = []

    def stamp(self, slot: int, key: bytes | None) -> None:
        self.seen.append((slot, key))


def _pool() -> CPUPool:
    pool = CPUPool(8, PLANES, pin=False, prefault=False)
    for i, p in enumerate(pool.planes):
        p.copy_(torch.arange(p.numel(), dtype=torch.uint8).view(p.shape) + i)
    return pool


def _driver(slots: SlotTable, store: MemoryStore, mode: str = "write-back") -> ChunkWorker:
    return ChunkWorker("nvme", store, DriverSettings(mode, 4, 5.0), DriverContext(slots, Counters()))


def _settle(w: ChunkWorker, want: int) -> tuple[WorkerReport, list[tuple[int, ChunkRead, bool]]]:
    meta, done = WorkerReport(), []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done += w.poll()
        w.take_meta(meta)
        if len(meta.written) + len(meta.failed) + len(meta.refused) + len(done) >= want:
            break
        time.sleep(0.005)
    return meta, done


def test_keys_and_stamps():
    slots = SlotTable(_pool())
    st = _Stamps()
    slots.stamp_with(st)
    slots.set_key(1, b"k1")
    slots.set_key(2, b"k2", "later")  # bytes still in flight: readers hear None first
    slots.set_key(3, b"k3", "unchanged")
    assert slots.holds(1, b"k1") and slots.holds(2, b"k2") and not slots.holds(1, b"k2")
    slots.stamp(2)
    assert st.seen == [(1, b"k1"), (2, None), (2, b"k2")]
    slots.record_crc(1)
    assert slots.crc_matches(1)
    slots.pool.planes[0][1][0] ^= 0xFF
    assert not slots.crc_matches(1)


def test_a_slot_that_lost_its_key_is_not_written_and_a_read_refills_slots():
    slots = SlotTable(_pool())
    store = MemoryStore("ns", slots.pool.slot_bytes)
    w = _driver(slots, store, mode="write-through")
    keys = (b"a" * 32, b"b" * 32)
    slots.set_key(0, keys[0])
    slots.set_key(1, None)  # its save failed
    bad = chunk_id_for(keys)
    w.write([ChunkWriteJob("nvme", bad, (0, 1), keys)])
    slots.set_key(1, keys[1])
    good = chunk_id_for(keys)
    w.write([ChunkWriteJob("nvme", good, (0, 1), keys)])
    meta, _ = _settle(w, 2)
    assert meta.failed == {("nvme", bad)} and meta.written == {("nvme", good): 1}
    assert store.chunk_ids() == [good]
    # Read the chunk back into two other slots: the driver fills them and reports them.
    rid = w.start_read(ChunkRead("nvme", good, (0, 1), (5, 6), keys))
    _, done = _settle(w, 1)
    assert [(r, ok) for r, _, ok in done] == [(rid, True)]
    for p in slots.pool.planes:
        assert torch.equal(p[5], p[0]) and torch.equal(p[6], p[1])
    w.close()


def test_shutdown_flushes_dirty_slots_that_still_hold_a_key():
    slots = SlotTable(_pool())
    store = MemoryStore("ns", slots.pool.slot_bytes)
    w = _driver(slots, store)
    for s in (2, 3, 4):
        slots.set_key(s, bytes([s]) * 32)
    w.mark_dirty([2, 3, 4])
    w.clean([3])  # saved over since
    slots.set_key(4, None)  # and this one no longer holds anything valid
    w.close()
    (cid,) = store.chunk_ids()
    assert cid.startswith((bytes([2]) * 32).hex()[:32])


def _gated_copy(slots: SlotTable) -> tuple[threading.Event, threading.Event, list[int]]:
    """Make the pool's copy out of a slot stop halfway until ``go`` is set (a copy the
    engine thread's next write overlaps); the threads that copied are listed."""
    entered, go, threads = threading.Event(), threading.Event(), []
    copy = slots.pool.copy_slot_out

    def gated(slot: int, out: memoryview) -> None:
        threads.append(threading.get_ident())
        entered.set()
        assert go.wait(10)
        copy(slot, out)

    slots.pool.copy_slot_out = gated  # type: ignore[method-assign]
    return entered, go, threads


def test_a_lower_tier_write_copies_on_the_store_thread_and_drops_a_slot_claimed_meanwhile():
    slots = SlotTable(_pool())
    store = MemoryStore("ns", slots.pool.slot_bytes)
    w = _driver(slots, store, mode="write-through")
    keys = (b"a" * 32, b"b" * 32)
    for s, k in zip((0, 1), keys, strict=True):
        slots.set_key(s, k)
    want = [slots.pool.planes[0][s].clone() for s in (0, 1)]
    entered, go, threads = _gated_copy(slots)
    good = chunk_id_for(keys)
    w.write([ChunkWriteJob("nvme", good, (0, 1), keys)])
    assert entered.wait(10) and threading.get_ident() not in threads  # not the engine thread's copy
    go.set()
    meta, _ = _settle(w, 1)
    assert meta.written == {("nvme", good): 1}
    stored = bytes(store.raw(good))
    assert all(bytes(p.numpy()) in stored for p in want)
    # The same blocks again, but a save claims slot 1 while the copy is under way: the
    # chunk may be torn, so nothing is written; back-pressure-like, not a failing tier.
    entered.clear()
    go.clear()
    torn = chunk_id_for(keys[::-1])  # another id, so that nothing of the first write counts
    w.write([ChunkWriteJob("nvme", torn, (0, 1), keys)])
    assert entered.wait(10)
    slots.claim((1,))
    slots.pool.planes[0][1].fill_(0xEE)  # the save's bytes
    slots.set_key(1, keys[1])  # the same key again: only the generation tells
    go.set()
    meta, _ = _settle(w, 1)
    assert meta.refused == {("nvme", torn)} and not meta.written and not meta.failed
    assert store.chunk_ids() == [good]
    assert w.counters.totals["store_skipped|nvme"] == 2 and not w.counters.totals["store_failures|nvme"]
    w.close()


def test_a_demotion_is_copied_at_once():
    slots = SlotTable(_pool())
    store = MemoryStore("ns", slots.pool.slot_bytes)
    w = _driver(slots, store)
    key = b"d" * 32
    slots.set_key(3, key)
    before = bytes(slots.pool.planes[1][3].numpy())
    cid = chunk_id_for((key,))
    w.write([ChunkWriteJob("nvme", cid, (3,), (key,))], copy_now=True)
    slots.claim((3,))  # this step's save reuses the slot at once
    slots.pool.planes[1][3].fill_(0x11)
    meta, _ = _settle(w, 1)
    assert meta.written == {("nvme", cid): 1} and before in bytes(store.raw(cid))
class _NoMemory(BufferPool):
    """A buffer pool on a host out of memory while ``broke`` (mmap's ENOMEM)."""

    broke = False

    def take(self, nbytes: int) -> AlignedBuffer:
        if self.broke:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return super().take(nbytes)


def test_out_of_memory_for_a_buffer_is_a_miss_and_a_counter():
    """ENOMEM when a write or a read takes its transfer buffer never raises into the step:
    the write is skipped (refused, as back-pressure), the read fails ``no_buffer`` (a miss),
    each counted in ``no_buffer``; with memory back, both work."""
    slots = SlotTable(_pool())
    pool = _NoMemory(64 << 20)
    store = MemoryStore("ns", slots.pool.slot_bytes, buffers=pool)
    w = ChunkWorker("nvme", store, DriverSettings("write-through", 4, 5.0), DriverContext(slots, Counters(), buffers=pool))
    keys = (b"a" * 32, b"b" * 32)
    slots.set_key(0, keys[0])
    slots.set_key(1, keys[1])
    cid = chunk_id_for(keys)
    pool.broke = True
    w.write([ChunkWriteJob("nvme", cid, (0, 1), keys)])  # does not raise
    meta = WorkerReport()
    w.take_meta(meta)
    assert meta.refused == {("nvme", cid)} and w.counters.totals["no_buffer|nvme"] == 1
    pool.broke = False
    w.write([ChunkWriteJob("nvme", cid, (0, 1), keys)])
    meta, _ = _settle(w, 1)
    assert meta.written == {("nvme", cid): 1}
    pool.broke = True
    rid = w.start_read(ChunkRead("nvme", cid, (0, 1), (5, 6), keys))  # does not raise
    _, done = _settle(w, 1)
    assert [(r, ok) for r, _, ok in done] == [(rid, False)]
    assert w.counters.totals["no_buffer|nvme"] == 2 and w.counters.totals["load_failures|nvme"] == 2
    pool.broke = False
    rid = w.start_read(ChunkRead("nvme", cid, (0, 1), (5, 6), keys))
    _, done = _settle(w, 1)
    assert [(r, ok) for r, _, ok in done] == [(rid, True)]
    w.close()
