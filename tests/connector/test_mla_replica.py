"""TP > 1 with an MLA model: the latent cache is the same on every TP rank, so the tiers below
CPU store it once, as ``kvtier plan`` counts it.

Two TP ranks in one process, through the real start-up path (the scheduler's planner from
make_planners, each rank's driver from make_workers with the role the connector gives it,
:func:`~vllm_kvtier.engine.lower.rank_role`), on real files and the real moto S3 server:
one chunk file/object per block set, written by rank 0 only, under rank 0's name; both ranks
load it, byte for byte; the scheduler confirms it on the one acknowledgement and counts one
copy in its usage gauge; a delete is the writer's. A sharded model's ranks keep their own
chunks and names, as before."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from testkit import mooncake_server as mcsrv
from testkit import s3_server as s3srv
from testkit.mooncake_server import MooncakeMaster
from testkit.s3_server import MotoServer
from vllm_kvtier.chunkformat import ALIGN, align_up, header_bytes_for
from vllm_kvtier.config import parse_config
from vllm_kvtier.engine.lower import RankRole, make_planners, make_workers, rank_role, stored_copies
from vllm_kvtier.jobs import ChunkRead, ChunkWriteJob, WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.ops.capacity import kv_bytes_per_token
from vllm_kvtier.ops.model_shape import model_from_hf_config
from vllm_kvtier.plan.chunk_plan import ChunkPlanner
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.tiers.nvme.store import rank_dir
from vllm_kvtier.tiers.registry import StoreContext
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.tier_io import ChunkWorker

s3_server = s3srv.s3_server  # fixtures: a moto server for this module, a fresh bucket per test
s3_bucket = s3srv.s3_bucket
mooncake_master = mcsrv.mooncake_master  # fixture: one real mooncake_master for this module

NS = "00112233445566ee"
TP = 2
BLOCK_TOKENS = 16
#: A DeepSeek-V2-style config (the latent size the CPU MLA kernel takes: 512 + 64)
MLA_CONFIG = {"architectures": ["DeepseekV2ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 256,
              "num_attention_heads": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
              "v_head_dim": 32}
#: One plane per layer, as vLLM's MLA cache [num_blocks, block_size, kv_lora_rank + rope] in bf16
PLANES = (BLOCK_TOKENS * 576 * 2,) * 2
SLOT = sum(PLANES)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def latent(i: int) -> bytes:
    """Block ``i``'s bytes: the same on every TP rank (the latent cache is replicated)."""
    return random.Random(i).randbytes(SLOT)


class Ranks:
    """One engine's lower tier as start-up builds it for ``TP`` ranks: the planner (counting
    ``stored_copies``), then each rank's driver with its role."""

    def __init__(self, extra: dict[str, Any], tier: str, *, replicated: bool) -> None:
        self.tier = tier
        self.cfg = parse_config(extra)
        self.counters = Counters()
        self.copies = stored_copies(TP, tp_size=TP, replicated=replicated)
        self.planner: ChunkPlanner = make_planners(self.cfg, namespace=NS, world_size=self.copies,
                                                   block_bytes_per_rank=SLOT, counters=self.counters)[0]
        self.slots = [SlotTable(CPUPool(8, PLANES, pin=False, prefault=False)) for _ in range(TP)]
        self.rank_counters = [Counters() for _ in range(TP)]
        self.roles = [rank_role(r, tp_size=TP, replicated=replicated) for r in range(TP)]
        self.workers: list[ChunkWorker] = [
            make_workers(self.cfg, namespace=NS, rank=r, slots=self.slots[r], counters=self.rank_counters[r],
                         role=self.roles[r])[tier] for r in range(TP)]

    def save(self, slots: list[int]) -> list[ChunkWriteJob]:
        """Blocks ``latent(s)`` saved into CPU slot ``s`` on every rank, written through to the
        tier; returns the chunk jobs, once the scheduler has confirmed them."""
        for t in self.slots:
            for s in slots:
                t.pool.copy_slot_in(s, memoryview(latent(s)))
                t.set_key(s, key(s))
        keys = [key(s) for s in slots]
        self.planner.note_request(keys)
        for s in slots:
            self.planner.on_cpu_save(s, BlockKey(key(s)))
        demotes, through, _ = self.planner.take_jobs(set(), {BlockKey(key(s)): s for s in slots}.get)
        assert demotes == [] and through
        for w in self.workers:
            w.write(through)
        meta = self._settle(lambda m: sum(m.written.values()) + len(m.failed) >= self.copies * len(through))
        assert not meta.failed and not meta.refused
        assert sum(meta.written.values()) == self.copies * len(through)  # rank 1 wrote nothing
        self.planner.on_worker_meta(meta)
        return through

    def _settle(self, done: Any) -> WorkerReport:
        meta = WorkerReport()
        end = time.monotonic() + 15
        while time.monotonic() < end:
            for w in self.workers:
                w.poll()
                w.take_meta(meta)
            if done(meta):
                break
            time.sleep(0.01)
        time.sleep(0.1)  # anything more (a write by a rank that should not write) lands too
        for w in self.workers:
            w.poll()
            w.take_meta(meta)
        return meta

    def load(self, job: ChunkWriteJob, into: list[int]) -> list[list[bytes]]:
        """Every rank reads ``job``'s chunk into its slots ``into``; each rank's bytes of them."""
        read = ChunkRead(self.tier, job.chunk_id, tuple(range(len(job.keys))), tuple(into), job.keys)
        for w in self.workers:
            assert w.start_read(read) is not None
        finished: list[list[bool]] = [[] for _ in self.workers]
        end = time.monotonic() + 15
        while time.monotonic() < end and not all(finished):
            for r, w in enumerate(self.workers):
                finished[r] += [ok for _, _, ok in w.poll()]
            time.sleep(0.01)
        assert finished == [[True]] * TP
        out = []
        for t in self.slots:
            got = []
            for s in into:
                buf = bytearray(SLOT)
                t.pool.copy_slot_out(s, memoryview(buf))
                got.append(bytes(buf))
            out.append(got)
        return out

    def usage(self) -> float:
        self.planner.take_jobs(set(), lambda k: None)  # the gauges are set with each step's jobs
        drained = self.counters.drain()
        assert drained is not None
        return drained["gauges"][f"usage_bytes|{self.tier}"]

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.planner.close()


def test_roles_of_a_replicated_cache_and_of_a_sharded_one() -> None:
    """MLA: the TP group's first rank writes under the group's index (PP stage), the others
    read it; sharded KV (every other model): each rank its own, as before."""
    assert [rank_role(r, tp_size=2, replicated=True) for r in range(4)] == [
        RankRole(0, True), RankRole(0, False), RankRole(1, True), RankRole(1, False)]
    assert [rank_role(r, tp_size=2, replicated=False) for r in range(4)] == [RankRole(r, True) for r in range(4)]
    assert stored_copies(4, tp_size=2, replicated=True) == 2  # TP 2 x PP 2: one copy per stage
    assert stored_copies(4, tp_size=2, replicated=False) == 4
    assert stored_copies(1, tp_size=1, replicated=True) == 1


def test_nvme_stores_one_copy_and_both_ranks_load_it(tmp_path: Path) -> None:
    eng = Ranks({"nvme": {"path": str(tmp_path), "mode": "write-through", "admit_min_seen": 1,
                          "chunk_blocks": 2, "capacity_bytes": 1 << 30}}, "nvme", replicated=True)
    try:
        jobs = eng.save([0, 1, 2, 3])
        assert len(jobs) == 2  # two chunks of two blocks
        files = sorted(p.name for p in rank_dir(tmp_path, NS, 0).glob("*.kvt"))
        assert files == sorted(f"{j.chunk_id}.kvt" for j in jobs)  # one file per block set, rank 0's name
        assert not rank_dir(tmp_path, NS, 1).exists()  # no second copy
        per_file = header_bytes_for(2) + 2 * align_up(SLOT)
        assert {p.stat().st_size for p in rank_dir(tmp_path, NS, 0).glob("*.kvt")} == {per_file}
        assert eng.planner.locate(BlockKey(key(3))) == (jobs[1].chunk_id, 1)  # confirmed on one ack
        assert eng.usage() == 2 * per_file + ALIGN  # one copy (and its lock file), not one per rank
        assert eng.rank_counters[0].totals["blocks_stored|nvme"] == 4
        assert eng.rank_counters[1].totals["blocks_stored|nvme"] == 0

        got = eng.load(jobs[1], [6, 7])  # into other slots: the bytes come from the file
        assert got == [[latent(2), latent(3)]] * TP
        assert [c.totals["blocks_loaded|nvme"] for c in eng.rank_counters] == [2, 2]

        # A delete is the writer's: the file goes once, and the reader only forgets it.
        for w in eng.workers:
            w.delete([jobs[0].chunk_id])
        eng.workers[0].store.wait(0.5)  # type: ignore[union-attr]
        deadline = time.monotonic() + 5
        while (rank_dir(tmp_path, NS, 0) / f"{jobs[0].chunk_id}.kvt").exists() and time.monotonic() < deadline:
            eng.workers[0].poll()
            time.sleep(0.01)
        assert not (rank_dir(tmp_path, NS, 0) / f"{jobs[0].chunk_id}.kvt").exists()
    finally:
        eng.close()


def test_nvme_restart_finds_the_one_copy_for_every_rank(tmp_path: Path) -> None:
    """A restart scans rank 0's directory only and indexes its chunks (on every copy = the
    one); the reader rank reads them with headers it fetches itself."""
    cfg = {"nvme": {"path": str(tmp_path), "mode": "write-through", "admit_min_seen": 1, "chunk_blocks": 2,
                    "capacity_bytes": 1 << 30}}
    first = Ranks(cfg, "nvme", replicated=True)
    try:
        jobs = first.save([0, 1])
    finally:
        first.close()
    again = Ranks(cfg, "nvme", replicated=True)
    try:
        assert again.planner.locate(BlockKey(key(1))) == (jobs[0].chunk_id, 1)
        assert again.load(jobs[0], [4, 5]) == [[latent(0), latent(1)]] * TP
    finally:
        again.close()


def test_sharded_model_keeps_one_chunk_per_rank(tmp_path: Path) -> None:
    """Not replicated (any non-MLA model): both ranks write their own file, under their own
    rank, and a chunk is confirmed once both did (unchanged)."""
    eng = Ranks({"nvme": {"path": str(tmp_path), "mode": "write-through", "admit_min_seen": 1,
                          "chunk_blocks": 2, "capacity_bytes": 1 << 30}}, "nvme", replicated=False)
    try:
        jobs = eng.save([0, 1])
        for r in range(TP):
            assert [p.name for p in rank_dir(tmp_path, NS, r).glob("*.kvt")] == [f"{jobs[0].chunk_id}.kvt"]
        assert eng.planner.locate(BlockKey(key(0))) == (jobs[0].chunk_id, 0)
        per_file = header_bytes_for(2) + 2 * align_up(SLOT)
        assert eng.usage() == TP * (per_file + ALIGN)
    finally:
        eng.close()


@pytest.mark.s3
def test_s3_stores_one_object_and_both_ranks_load_it(s3_server: MotoServer, s3_bucket: str) -> None:
    s3 = {"bucket": s3_bucket, "prefix": "kv/", "endpoint_url": s3_server.url, "path_style": True,
          "mode": "write-through", "admit_min_seen": 1, "chunk_blocks": 2, "rescan_interval_s": 0}
    eng = Ranks({"s3": s3}, "s3", replicated=True)
    try:
        jobs = eng.save([0, 1, 2, 3])
        raw = s3_server.client()
        names = [o["Key"] for o in raw.list_objects_v2(Bucket=s3_bucket, Prefix="kv/").get("Contents", [])]
        chunks = sorted(n for n in names if n.endswith(".kvt"))
        assert len(chunks) == 2 and all(f"/{NS}/r0/" in n for n in chunks)  # one object per block set
        assert not [n for n in names if "/r1/" in n]
        assert eng.load(jobs[0], [5, 6]) == [[latent(0), latent(1)]] * TP
        assert [c.totals["blocks_loaded|s3"] for c in eng.rank_counters] == [2, 2]
    finally:
        eng.close()


@pytest.mark.mooncake
def test_mooncake_pool_holds_one_object_and_both_ranks_load_it(mooncake_master: MooncakeMaster) -> None:
    from vllm_kvtier.tiers.mooncake.store import MooncakeStore

    pool = {"master": mooncake_master.address, "local_hostname": "127.0.0.1", "global_segment_bytes": 16 * 2**20,
            "local_buffer_bytes": 4 * 2**20, "transfer_buffer_bytes": 4 * 2**20, "lookup_timeout_s": 2.0}
    eng = Ranks({"mooncake": pool}, "mooncake", replicated=True)
    probe = [MooncakeStore(mooncake_master.config(global_segment_bytes=0),
                           StoreContext(NS, r, SLOT)) for r in range(TP)]
    try:
        jobs = eng.save([0, 1])
        assert [j.chunk_id for j in jobs] == [key(0).hex(), key(1).hex()]  # one object per block, by its key
        ids = [j.chunk_id for j in jobs]
        assert probe[0].exists(ids) == [True, True]  # rank 0's keys
        assert probe[1].exists(ids) == [False, False]  # no second copy under rank 1
        assert eng.load(jobs[1], [5]) == [[latent(1)]] * TP
        assert [c.totals["blocks_loaded|mooncake"] for c in eng.rank_counters] == [1, 1]
    finally:
        for st in probe:
            st.close(timeout_s=5.0)
        eng.close()


def test_mla_cache_tensors_are_one_plane_per_layer() -> None:
    """vLLM's MLA cache per layer, ``[num_blocks, block_size, kv_lora_rank + rope]`` (CPU MLA and
    FlashMLA alike): a block is one contiguous row per layer, the pool's slot is the latent
    block of every layer, and a block copied out and back is exact."""
    import torch

    from vllm_kvtier.transfer.layout import build_layout

    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(10, BLOCK_TOKENS, 576).to(torch.bfloat16)
              for i in range(2)}
    layout = build_layout(caches, 10)
    assert layout.plane_bytes == PLANES and layout.block_bytes == SLOT
    assert layout.plane_layers == tuple(sorted(caches))
    for name, t in caches.items():
        row = layout.planes[layout.plane_layers.index(name)][3]
        assert torch.equal(row.view(torch.bfloat16).view(BLOCK_TOKENS, 576), t[3])


def test_one_copy_is_what_kvtier_plan_counts() -> None:
    """The bytes a tier holds per block (one copy) are ``kvtier plan``'s MLA figure for the
    block's tokens: layers x (kv_lora_rank + qk_rope_head_dim) x tokens x dtype bytes."""
    model = model_from_hf_config(MLA_CONFIG)
    assert model.attention == "MLA"
    assert kv_bytes_per_token(model, "bf16") * BLOCK_TOKENS == SLOT == 2 * (512 + 64) * BLOCK_TOKENS * 2
