"""Two data-parallel engines of one model on one host, one ``nvme.path`` and one bucket.

vLLM numbers the workers of a MoE model's data-parallel engines across them: world rank =
``data_parallel_rank * world_size + rank``. Each engine is built here as the connector
builds it (:func:`~vllm_kvtier.connector.wiring.scheduler_half` and
:func:`~vllm_kvtier.connector.wiring.worker_half` from a real ``VllmConfig``), with vLLM's
world group standing for the one a multi-process engine would have (it cannot span two
processes in one test). The scheduler's planner and the worker's tiers then move real chunks:
files on disk, objects in a moto S3 server on 127.0.0.1.

What must hold: each engine's NVMe files are its own (found again after a restart, bound by
its capacity, never offered to the other engine's workers); what one engine stores in the
bucket, every engine's scheduler lists and every engine's workers load."""

from __future__ import annotations

import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm.distributed.parallel_state as parallel_state
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from testkit import s3_server as s3srv
from testkit.s3_server import MotoServer
from tests.sched_helpers import BLOCK_SIZE, DTYPE, HEAD_SIZE, NUM_KV_HEADS, NUM_LAYERS, make_vllm_config
from vllm_kvtier.chunkformat import ALIGN, align_up, header_bytes_for
from vllm_kvtier.config import parse_config
from vllm_kvtier.connector import wiring
from vllm_kvtier.engine.lower import make_workers
from vllm_kvtier.jobs import ChunkRead, StepPlan, WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.tier_io import ChunkWorker

s3_server = s3srv.s3_server  # fixtures: a moto server for this module, a fresh bucket per test
s3_bucket = s3srv.s3_bucket

NS = "00112233445566dd"
NUM_BLOCKS = 16
DP = 2
CHUNK_BLOCKS = 2
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
#: One stored block: K and V of every layer.
SLOT = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * DTYPE.itemsize * NUM_LAYERS
#: One chunk file of CHUNK_BLOCKS blocks, and the bytes three of them take with the lock file.
CHUNK_FILE = header_bytes_for(CHUNK_BLOCKS) + CHUNK_BLOCKS * align_up(SLOT)
THREE_CHUNKS = 3 * CHUNK_FILE + ALIGN + CHUNK_FILE // 2


def key(engine: int, i: int) -> bytes:
    return bytes([engine]) + i.to_bytes(4, "big") * 7 + b"\0\0\0"


def block(k: bytes) -> bytes:
    """The bytes block ``k`` holds, whichever engine computed it (the same model)."""
    return random.Random(k).randbytes(SLOT)


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


class DPEngine:
    """Data-parallel engine ``engine`` of a MoE model (TP 1): its scheduler half, then its
    worker, whose world rank is ``engine`` (vLLM's numbering), as start-up builds them."""

    def __init__(self, model: Path, extra: dict[str, Any], engine: int, tier: str,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        self.engine, self.tier = engine, tier
        vc = make_vllm_config(model, extra)
        par = vc.parallel_config
        par.data_parallel_size = DP
        par.data_parallel_rank = engine
        par.data_parallel_index = engine
        cfg = parse_config(extra)
        kvc = kv_cache_config()
        self.sched = wiring.scheduler_half(cfg, vc, kvc, NS).planner
        planner = self.sched.lower_tier(tier)
        assert planner is not None
        self.planner: ChunkPlanner = planner
        world_rank = engine * par.world_size  # this engine's first (and only) worker
        monkeypatch.setattr(parallel_state, "get_world_group", lambda: SimpleNamespace(rank_in_group=world_rank))
        self.worker = wiring.worker_half(cfg, kvc, NS, vc)
        monkeypatch.undo()
        self.worker.register_kv_caches({n: torch.zeros((NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE),
                                                       dtype=DTYPE) for n in LAYERS})
        self.failed_reads = 0

    def first_step(self) -> None:
        """The worker's first step, which opens its tiers (and takes its NVMe locks)."""
        self.worker.begin_step(StepPlan(num_slots=self.worker.num_slots, step=1, namespace=NS))
        self.tier_worker: ChunkWorker = self.worker.lower[self.tier]

    def save(self, keys: list[bytes]) -> None:
        """Blocks ``keys`` saved to CPU slots 0.. and written through to the tier; the
        chunks the planner evicts to stay in its capacity are deleted."""
        slots = self.worker.slots
        assert slots is not None
        for s, k in enumerate(keys):
            slots.pool.copy_slot_in(s, memoryview(block(k)))
            slots.set_key(s, k)
        self.planner.note_request(list(keys))
        for s, k in enumerate(keys):
            self.planner.on_cpu_save(s, BlockKey(k))
        demotes, through, deletes = self.planner.take_jobs(set(), {BlockKey(k): s for s, k in enumerate(keys)}.get)
        assert demotes == [] and through, f"engine {self.engine}: its scheduler plans no write (tier off)"
        self.tier_worker.delete(deletes)
        self.tier_worker.write(through)
        meta = WorkerReport()
        end = time.monotonic() + 15
        while sum(meta.written.values()) + len(meta.failed) < len(through) and time.monotonic() < end:
            self.tier_worker.poll()
            self.tier_worker.take_meta(meta)
            time.sleep(0.01)
        assert not meta.failed and sum(meta.written.values()) == len(through)
        self.planner.on_worker_meta(meta)

    def load(self, keys: list[bytes]) -> list[bytes] | None:
        """Each of ``keys`` where this engine's scheduler would load it from, read by this
        engine's worker into slots 8..; the bytes read, or None if the scheduler finds none
        of them. A read that fails counts in ``failed_reads`` (vLLM: a failed load)."""
        where = [self.planner.locate(BlockKey(k)) for k in keys]
        if all(w is None for w in where):
            return None
        assert all(w is not None for w in where), where
        slots = self.worker.slots
        assert slots is not None
        out = []
        for i, (k, w) in enumerate(zip(keys, where, strict=True)):
            assert w is not None
            fid, pos = w
            into = 8 + i % 8
            if self.tier_worker.start_read(ChunkRead(self.tier, fid, (pos,), (into,), (k,))) is None:
                self.failed_reads += 1  # refused at once: the worker has no such chunk
                continue
            done: list[bool] = []
            end = time.monotonic() + 15
            while not done and time.monotonic() < end:
                done = [ok for _, _, ok in self.tier_worker.poll()]
                time.sleep(0.005)
            if done != [True]:
                self.failed_reads += 1
                continue
            buf = bytearray(SLOT)
            slots.pool.copy_slot_out(into, memoryview(buf))
            out.append(bytes(buf))
        return out

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.close()


def start(model: Path, extra: dict[str, Any], tier: str, monkeypatch: pytest.MonkeyPatch) -> list[DPEngine]:
    """Both engines, as ``--data-parallel-size 2`` starts them: every engine's scheduler
    scans its tiers before the workers' first step opens them."""
    engines: list[DPEngine] = []
    try:
        for e in range(DP):
            engines.append(DPEngine(model, extra, e, tier, monkeypatch))
        for eng in engines:
            eng.first_step()
    except BaseException:
        for eng in engines:
            eng.close()
        raise
    return engines


def chunk_files(root: Path) -> dict[str, int]:
    """Chunk files under ``nvme.path``, by directory."""
    out: dict[str, int] = {}
    for p in root.glob(f"{NS}/*/*.kvt"):
        out[p.parent.name] = out.get(p.parent.name, 0) + 1
    return out


def test_two_dp_engines_on_one_nvme_path_restart_warm_within_their_bound(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three runs of both engines, each storing four chunks (more than its three-chunk
    capacity): after each restart every engine finds the newest of its own chunks again
    (warm), loads them byte for byte with no failed read, offers none of the other
    engine's chunks, and holds at most three chunk files."""
    root = tmp_path / "nvme"
    extra = {"cpu": {"capacity_bytes": 1 << 24},
             "nvme": {"path": str(root), "mode": "write-through", "admit_min_seen": 1, "chunk_blocks": CHUNK_BLOCKS,
                      "capacity_bytes": THREE_CHUNKS}}
    saved: dict[int, list[list[bytes]]] = {e: [] for e in range(DP)}
    problems: list[str] = []
    for run in range(3):
        newest = {e: saved[e][-1] for e in saved if saved[e]}  # each engine's newest chunk of the last run
        engines = start(tiny_model, extra, "nvme", monkeypatch)
        try:
            for eng in engines:
                assert eng.tier_worker.store is not None, f"engine {eng.engine}: NVMe tier off"
                if run:  # warm: the newest chunk of the last run is found and read back
                    if eng.load(newest[eng.engine]) != [block(k) for k in newest[eng.engine]]:
                        problems.append(f"run {run}, engine {eng.engine}: not warm")
                    if eng.load(newest[1 - eng.engine]) is not None:
                        problems.append(f"run {run}, engine {eng.engine}: offers the other engine's chunk")
                for c in range(4):
                    keys = [key(eng.engine, run * 100 + c * CHUNK_BLOCKS + b) for b in range(CHUNK_BLOCKS)]
                    eng.save(keys)
                    saved[eng.engine].append(keys)
                if eng.failed_reads:
                    problems.append(f"run {run}, engine {eng.engine}: {eng.failed_reads} failed read(s)")
        finally:
            for eng in engines:
                eng.close()
        per_dir = chunk_files(root)
        if len(per_dir) != DP or any(n > 3 for n in per_dir.values()):
            problems.append(f"run {run}: chunk files per directory {per_dir}")
    assert problems == [], "; ".join(problems)


@pytest.mark.s3
def test_what_one_dp_engine_stores_in_s3_every_engine_lists_and_loads(
        tiny_model: Path, s3_server: MotoServer, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine 1 stores two chunks, engine 0 one; after a restart both engines' schedulers
    list all three and both engines' workers load them byte for byte, with no failed read."""
    extra = {"cpu": {"capacity_bytes": 1 << 24},
             "s3": {"bucket": s3_bucket, "prefix": "kv/", "endpoint_url": s3_server.url, "path_style": True,
                    "mode": "write-through", "admit_min_seen": 1, "chunk_blocks": CHUNK_BLOCKS,
                    "rescan_interval_s": 0}}
    stored = [[key(1, 0), key(1, 1)], [key(1, 2), key(1, 3)], [key(0, 0), key(0, 1)]]
    engines = start(tiny_model, extra, "s3", monkeypatch)
    try:
        engines[1].save(stored[0])
        engines[1].save(stored[1])
        engines[0].save(stored[2])
    finally:
        for eng in engines:
            eng.close()
    engines = start(tiny_model, extra, "s3", monkeypatch)
    try:
        for eng in engines:
            for keys in stored:
                assert eng.load(keys) == [block(k) for k in keys], f"engine {eng.engine}: {keys[0].hex()[:8]}"
            assert eng.failed_reads == 0, f"engine {eng.engine}: {eng.failed_reads} failed read(s)"
    finally:
        for eng in engines:
            eng.close()


def test_an_earlier_namespace_of_dp_engines_is_collected_when_asked(tmp_path: Path) -> None:
    """An earlier model's directories, written by two data-parallel engines (``r0`` and
    ``dp1-r0``), are the tier's own names: with ``gc_foreign_namespaces`` the next engine's
    rank 0 deletes them all."""
    old = tmp_path / "aaaaaaaaaaaaaaaa"
    for d in ("r0", "dp1-r0"):
        (old / d).mkdir(mode=0o700, parents=True)
        (old / d / "c.kvt").write_bytes(b"\0" * 4096)
    cfg = parse_config({"nvme": {"path": str(tmp_path), "capacity_bytes": 1 << 30, "gc_foreign_namespaces": True}})
    counters = Counters()
    tiers = make_workers(cfg, namespace=NS, rank=0, counters=counters,
                         slots=SlotTable(CPUPool(4, (SLOT,), pin=False, prefault=False)))
    for t in tiers.values():
        t.close()
    assert not old.exists()
    assert counters.totals["reclaimed_bytes|nvme"] == 2 * 4096
