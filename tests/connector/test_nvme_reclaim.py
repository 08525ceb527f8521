"""NVMe reclaim on real files, through the real start-up path (the scheduler's planner from
make_planners, each rank's worker from make_workers, no engine): debris of this engine's
own tier (interrupted writes, chunks on only some TP ranks, misfits) is deleted at start by
its owners and counted; the capacity bound covers every byte in the rank directories;
another engine's locked directory is neither indexed nor touched."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from testkit.stores import nvme_section
from vllm_kvtier.catalog.base import Listing
from vllm_kvtier.config import parse_config
from vllm_kvtier.engine.lower import make_planners, make_workers
from vllm_kvtier.jobs import ChunkRead, WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext
from vllm_kvtier.tiers.buffers import WriteBuffer
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.tiers.nvme.store import NVMeStore, rank_dir
from vllm_kvtier.tiers.registry import StoreContext
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.tier_io import ChunkWorker

NS = "00112233445566ff"
PLANES = (4096, 4096)
SLOT = sum(PLANES)
WORLD = 2


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def put(store: NVMeStore, fid: str, keys: list[bytes], block_bytes: int = SLOT) -> None:
    wb = WriteBuffer(keys, block_bytes)
    assert store.submit_write(1, fid, wb)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        for r in store.poll():
            assert r.ok, r.reason
            return
        store.wait(0.01)
    raise AssertionError("write did not finish")


def files(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in d.iterdir()}


def gauge(eng: Engine, name: str) -> float:
    drained = eng.counters.drain()
    assert drained is not None
    return drained["gauges"][name]


class Engine:
    """One engine's NVMe tier as start-up builds it: the planner first (vLLM builds the
    scheduler before the workers' first step), then one worker per rank."""

    def __init__(self, root: Path, **nvme) -> None:
        self.cfg = parse_config({"nvme": {"path": str(root), "mode": "write-through", "admit_min_seen": 1,
                                          "chunk_blocks": 2, **nvme}})
        self.counters = Counters()
        self.planner: ChunkPlanner = make_planners(self.cfg, namespace=NS, world_size=WORLD,
                                                   block_bytes_per_rank=SLOT, counters=self.counters)[0]
        self.slots = [SlotTable(CPUPool(8, PLANES, pin=False, prefault=False)) for _ in range(WORLD)]
        self.workers: list[ChunkWorker] = [
            make_workers(self.cfg, namespace=NS, rank=r, slots=self.slots[r], counters=self.counters)["nvme"]
            for r in range(WORLD)]

    def step(self, new_keys: list[bytes] = ()) -> list[str]:  # type: ignore[assignment]
        """One scheduler step that saves ``new_keys`` to DRAM (write-through to NVMe), its
        writes and deletes run by every rank to completion; the deletes it planned."""
        where: dict[BlockKey, int] = {}
        for s, k in enumerate(new_keys):
            for t in self.slots:
                t.set_key(s, k)
            where[BlockKey(k)] = s
        self.planner.note_request(list(new_keys))
        for s, k in enumerate(new_keys):
            self.planner.on_cpu_save(s, BlockKey(k))
        demotes, through, deletes = self.planner.take_jobs(set(), where.get)
        assert demotes == []
        for w in self.workers:
            w.delete(deletes)
            w.write(through)
        meta = WorkerReport()
        end = time.monotonic() + 10
        while time.monotonic() < end:
            for w in self.workers:
                w.poll()
                w.take_meta(meta)
            if sum(meta.written.values()) + len(meta.failed) >= WORLD * len(through):
                break
            time.sleep(0.01)
        assert not meta.failed
        self.planner.on_worker_meta(meta)
        for w in self.workers:  # the deletes are queued behind nothing: let them finish
            if w.store is not None:
                w.store.wait(0.05)
        return deletes

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.planner.close()


def test_debris_is_deleted_at_start_by_its_owners_and_counted(tmp_path: Path) -> None:
    r0, r1 = (NVMeStore(nvme_section(tmp_path), StoreContext(NS, r, SLOT)) for r in range(WORLD))
    put(r0, "good", [key(1), key(2)])
    put(r1, "good", [key(1), key(2)])
    put(r0, "partial", [key(3), key(4)])  # the crash came before rank 1 wrote it
    r0.close()
    r1.close()
    misfit = NVMeStore(nvme_section(tmp_path),
                       StoreContext(NS, 1, 2 * SLOT))  # another block size, inside the namespace
    put(misfit, "misfit", [key(5)], 2 * SLOT)
    misfit.close()
    (rank_dir(tmp_path, NS, 0) / ".tmp-torn-0badf00d").write_bytes(b"\0" * 10000)
    (rank_dir(tmp_path, NS, 1) / "notes.txt").write_bytes(b"not ours")

    eng = Engine(tmp_path, capacity_bytes=1 << 30)
    try:
        assert eng.planner.locate(BlockKey(key(2))) == ("good", 1)
        assert eng.planner.locate(BlockKey(key(3))) is None
        assert eng.step() == ["partial"]
        for r in range(WORLD):
            assert set(files(rank_dir(tmp_path, NS, r))) == {".lock", "good.kvt"} | ({"notes.txt"} if r else set())
        # the torn write (rank 0), the misfit (rank 1), the partial chunk (the planner)
        assert eng.counters.totals["reclaimed_files|nvme"] == 3
    finally:
        eng.close()


def test_chunk_a_rank_could_not_open_is_kept_and_adopted_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE (too many open files) on one rank's chunk while the engine starts: the chunk
    is not indexed, but it is not deleted on any rank either (it is not known partial).
    The next start reads it and indexes it. Before, the planner reclaimed it everywhere."""
    for r in range(WORLD):
        st = NVMeStore(nvme_section(tmp_path), StoreContext(NS, r, SLOT))
        put(st, "good", [key(1), key(2)])
        st.close()
    victim = str(rank_dir(tmp_path, NS, 1) / "good.kvt")
    real_open = os.open

    def emfile(path: str | os.PathLike[str], flags: int, *args: int, **kw: int) -> int:
        if os.fspath(path) == victim:
            raise OSError(errno.EMFILE, "Too many open files", victim)
        return real_open(path, flags, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(os, "open", emfile)
        eng = Engine(tmp_path, capacity_bytes=1 << 30)
    try:
        assert eng.planner.locate(BlockKey(key(2))) is None
        assert eng.step() == []
        for r in range(WORLD):
            assert "good.kvt" in files(rank_dir(tmp_path, NS, r))
        assert eng.counters.totals.get("reclaimed_files|nvme", 0) == 0
    finally:
        eng.close()

    eng = Engine(tmp_path, capacity_bytes=1 << 30)
    try:
        assert eng.planner.locate(BlockKey(key(2))) == ("good", 1)
    finally:
        eng.close()


def test_a_failed_write_deletes_what_other_ranks_wrote_on_an_exclusive_tier(tmp_path: Path) -> None:
    """NVMe is this engine's own: a chunk whose write failed on one rank is deleted on
    every rank (the other rank's file is a partial chunk of ours), unlike a shared tier
    (see test_a_failed_or_refused_write_deletes_nothing_on_a_shared_tier)."""
    p = ChunkPlanner(ChunkPolicy("nvme", "write-through", 1, 2, None, exclusive=True), PlannerContext(WORLD, SLOT, Counters()), Listing([{}, {}]))
    p.note_request([key(1), key(2)])
    for i in (1, 2):
        p.on_cpu_save(i, BlockKey(key(i)))
    (job,) = p.take_jobs(set(), {BlockKey(key(i)): i for i in (1, 2)}.get)[1]
    r0 = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, SLOT))
    put(r0, job.chunk_id, [key(1), key(2)])  # rank 0 wrote it; rank 1's write failed
    p.on_worker_meta(WorkerReport(written={("nvme", job.chunk_id): 1}, failed={("nvme", job.chunk_id)}))
    deletes = p.take_jobs(set(), lambda k: None)[2]
    assert deletes == [job.chunk_id]
    r0.submit_delete(job.chunk_id)
    r0.close()
    assert set(files(rank_dir(tmp_path, NS, 0))) == {".lock"}
    p.close()


def test_capacity_bounds_every_byte_in_the_rank_directories(tmp_path: Path) -> None:
    """Debris the tier cannot delete (a file someone put in a rank directory) and its own
    lock files are taken off the capacity: after filling far past it, the bytes in each
    rank directory stay within its share, and in all of them within capacity_bytes."""
    for r in range(WORLD):
        NVMeStore(nvme_section(tmp_path), StoreContext(NS, r, SLOT)).close()
    (rank_dir(tmp_path, NS, 1) / "notes.txt").write_bytes(b"x" * 30000)
    (rank_dir(tmp_path, NS, 0) / ".tmp-torn-0badf00d").write_bytes(b"\0" * 20000)
    probe = Engine(tmp_path / "probe", capacity_bytes=1 << 30)  # a two-block chunk's file, as planned
    chunk = probe.planner.file_bytes(2)
    probe.close()
    capacity = WORLD * (4 * chunk + 3000)
    eng = Engine(tmp_path, capacity_bytes=capacity)
    try:
        for i in range(0, 40, 2):
            eng.step([key(100 + i), key(101 + i)])
        time.sleep(0.2)
        eng.step()
        per_rank = [sum(files(rank_dir(tmp_path, NS, r)).values()) for r in range(WORLD)]
        assert all(b <= capacity // WORLD for b in per_rank), (per_rank, capacity)
        assert sum(per_rank) <= capacity
        assert eng.counters.totals["evictions|nvme"] > 0
        # Without the reservation four chunks would fit per rank, and rank 1 would hold more.
        assert 4 * chunk + 30000 > capacity // WORLD
        assert eng.planner.locate(BlockKey(key(139))) is not None  # the newest chunk is loadable
    finally:
        eng.close()


def test_a_directory_locked_by_another_engine_is_neither_indexed_nor_touched(tmp_path: Path) -> None:
    """A second engine on the first one's directory: its planner indexes nothing and plans
    nothing, its workers have no store, and the first one's files (one still being written:
    a .tmp- file) are all still there and loadable."""
    first = Engine(tmp_path, capacity_bytes=1 << 30)
    try:
        first.step([key(1), key(2)])
        in_flight = rank_dir(tmp_path, NS, 0) / ".tmp-inflight-12345678"
        in_flight.write_bytes(b"\0" * 5000)
        before = [files(rank_dir(tmp_path, NS, r)) for r in range(WORLD)]
        second = Engine(tmp_path, capacity_bytes=1 << 30)
        try:
            assert second.planner.locate(BlockKey(key(1))) is None
            assert all(w.store is None for w in second.workers)
            assert second.counters.totals["store_failures|nvme"] >= 1
            assert second.step([key(3), key(4)]) == []
            assert second.planner.locate(BlockKey(key(3))) is None
        finally:
            second.close()
        assert [files(rank_dir(tmp_path, NS, r)) for r in range(WORLD)] == before
        assert first.planner.locate(BlockKey(key(2))) is not None
        done = []
        fid, pos = first.planner.locate(BlockKey(key(2)))  # type: ignore[misc]
        for w in first.workers:
            assert w.start_read(ChunkRead("nvme", fid, (pos,), (7,), (key(2),))) is not None
        end = time.monotonic() + 10
        while len(done) < WORLD and time.monotonic() < end:
            for w in first.workers:
                done += [ok for _, _, ok in w.poll()]
            time.sleep(0.01)
        assert done == [True] * WORLD
    finally:
        first.close()


def test_foreign_namespaces_are_reported_at_start_and_collected_when_asked(tmp_path: Path, caplog) -> None:
    old = "aaaaaaaaaaaaaaaa"  # an earlier model's namespace under the same nvme.path
    for r in range(WORLD):
        t = NVMeStore(nvme_section(tmp_path), StoreContext(old, r, SLOT))
        put(t, "c", [key(1), key(2)])
        t.close()
    eng = Engine(tmp_path, capacity_bytes=1 << 30)
    eng.close()
    assert (tmp_path / old / "r1" / "c.kvt").exists()  # off by default: reported only
    assert f"another namespace's directory {tmp_path / old}" in caplog.text
    assert "set nvme.gc_foreign_namespaces: true" in caplog.text
    size = eng.planner.file_bytes(2)
    assert gauge(eng, "foreign_bytes|nvme") >= WORLD * size
    eng = Engine(tmp_path, capacity_bytes=1 << 30, gc_foreign_namespaces=True)
    eng.close()
    assert not (tmp_path / old).exists() and (tmp_path / NS / "r0" / ".lock").exists()
    assert eng.counters.totals["reclaimed_bytes|nvme"] >= WORLD * size
    assert gauge(eng, "foreign_bytes|nvme") == 0


def test_an_unsafe_directory_is_not_indexed_either(tmp_path: Path) -> None:
    """Chunks in a rank directory others can write (planted, perhaps): the planner indexes
    none of them, and the workers refuse the directory."""
    for r in range(WORLD):
        t = NVMeStore(nvme_section(tmp_path), StoreContext(NS, r, SLOT))
        put(t, "planted", [key(1), key(2)])
        t.close()
    os.chmod(rank_dir(tmp_path, NS, 1), 0o777)
    eng = Engine(tmp_path, capacity_bytes=1 << 30)
    try:
        assert eng.planner.locate(BlockKey(key(1))) is None
        assert eng.workers[1].store is None
        assert eng.step([key(3)]) == [] and eng.planner.locate(BlockKey(key(3))) is None
    finally:
        eng.close()
    assert (rank_dir(tmp_path, NS, 0) / "planted.kvt").exists()


def test_start_up_deletes_ask_for_a_step_of_an_idle_engine(tmp_path: Path) -> None:
    """A partial chunk found at start is deleted at the first step, which an idle engine
    is asked for (has_flush_work), not only once a request comes."""
    t = NVMeStore(nvme_section(tmp_path), StoreContext(NS, 0, SLOT))
    put(t, "partial", [key(1)])
    t.close()
    eng = Engine(tmp_path, capacity_bytes=1 << 30)
    try:
        assert eng.planner.has_flush_work()
        assert eng.step() == ["partial"]
        assert not eng.planner.has_flush_work()
        assert not (rank_dir(tmp_path, NS, 0) / "partial.kvt").exists()
    finally:
        eng.close()


def test_each_read_reports_its_own_time_from_issue_to_done(tmp_path: Path) -> None:
    """Load-or-recompute judges a tier by its reads' time (from issue to done on the I/O
    threads), not by the engine steps a load overlapped: each read returned by ``poll``
    answers ``took`` once, with a time it really took."""
    eng = Engine(tmp_path, capacity_bytes=1 << 30)
    try:
        eng.step([key(1), key(2)])
        fid, pos = eng.planner.locate(BlockKey(key(1)))  # type: ignore[misc]
        w = eng.workers[0]
        t0 = time.perf_counter()
        rid = w.start_read(ChunkRead("nvme", fid, (pos,), (7,), (key(1),)))
        assert rid is not None
        got: list[int] = []
        end = time.monotonic() + 10
        while not got and time.monotonic() < end:
            got = [r for r, _, ok in w.poll() if ok]
            time.sleep(0.01)
        assert got == [rid]
        took = w.took(rid)
        assert 0 < took <= time.perf_counter() - t0
        assert w.took(rid) == 0.0  # answered once
    finally:
        eng.close()
