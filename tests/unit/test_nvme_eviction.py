"""The NVMe tier's eviction: kvaware over its files, through the planner's own index.

Small hand-made traces pin the decisions: a file of reused blocks outlives newer one-off
files; a reused file that is never read again ages out; the tier never refuses a write
it has room for, nor evicts when the write cannot fit. ``nvme.eviction`` picks the
policy, in the engine's planner and in ``kvtier plan --trace`` alike."""

from __future__ import annotations

import json

import pytest

from vllm_kvtier.cli import main
from vllm_kvtier.config import parse_config
from vllm_kvtier.engine.lower import make_planners
from vllm_kvtier.index.chunk_index import ChunkIndex
from vllm_kvtier.index.kvaware import PROTECT_OPS
from vllm_kvtier.keys import BlockKey, EvictionName
from vllm_kvtier.metrics import Counters
from vllm_kvtier.ops.instance_replay import Instance, serve_request
from vllm_kvtier.ops.trace_sim import LowerTier, TierResult, TierSetup, TraceRequest


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(8, "little"))


def _replay(ids: list[int], nvme_blocks: int, eviction: EvictionName = "kvaware") -> tuple[list[int], int]:
    """One-block prompts ``ids`` in order over 1 DRAM slot and an NVMe tier of
    ``nvme_blocks`` (write-back, written on eviction only), through the planner's own
    code. Returns the NVMe hit of each request (0 or 1) and the blocks the NVMe evicted."""
    nvme = LowerTier("nvme", nvme_blocks, "write-back", 1, 1, eviction=eviction)
    inst = Instance(TierSetup(cpu_blocks=1, lower=(nvme,), step_blocks=1))
    stats = [TierResult("cpu", 1), TierResult("nvme", nvme_blocks)]
    hits = []
    for i, h in enumerate(ids):
        before = stats[1].hit_blocks
        serve_request(inst, TraceRequest(i, 16, 1, (key(h),)), 16, stats)
        hits.append(stats[1].hit_blocks - before)
    return hits, inst.planners[0].index.evicted_blocks


def test_a_reused_block_outlives_newer_one_off_blocks_on_nvme():
    """Block 1 is reused in DRAM (two requests) before it goes down; 2, 3, 4 are one-offs.
    The NVMe holds 3: when 5 comes down, LRU would drop 1 (the oldest). kvaware drops the
    oldest one-off, 2, so request 1 hits the NVMe at the end."""
    hits, evicted = _replay([1, 1, 2, 3, 4, 5, 6, 1], 3)
    assert evicted >= 1
    assert hits[-1] == 1


def test_a_one_off_block_still_leaves_in_order_of_age():
    """No reuse at all: the NVMe is LRU, the oldest one-off leaves first."""
    hits, _ = _replay([1, 2, 3, 4, 5, 6, 2], 3)
    assert hits[-1] == 0  # 2 was the oldest written: gone
    hits, _ = _replay([1, 2, 3, 4, 5, 6, 4], 3)
    assert hits[-1] == 1  # 4 was written after it: still there


def test_a_reused_block_never_read_again_ages_out():
    """Protection is extra time (kvaware's ``PROTECT_OPS`` operations), not a place for
    ever: a reused file that is not read again leaves once enough one-offs went through."""
    idx = ChunkIndex(300, eviction="kvaware", file_bytes=100)
    idx.reserve("old", [key(0)], 100, reused=True)
    idx.confirm("old")
    gone_at = None
    for i in range(1, PROTECT_OPS + 100):
        if "old" in (idx.reserve(f"f{i}", [key(i)], 100) or []):
            gone_at = i
            break
        idx.confirm(f"f{i}")
    assert gone_at is not None and PROTECT_OPS - 10 <= gone_at <= PROTECT_OPS + 10


def test_reserve_evicts_by_policy_and_refuses_without_evicting_when_nothing_can_go():
    idx = ChunkIndex(300, eviction="kvaware", file_bytes=100)
    for i, reused in ((1, True), (2, False), (3, False)):
        assert idx.reserve(f"f{i}", [key(i)], 100, reused=reused) == []
    assert idx.reserve("f4", [key(4)], 100) is None  # all three still being written
    assert idx.used_bytes == 300 and idx.evicted_blocks == 0
    for i in (1, 2, 3):
        idx.confirm(f"f{i}")
    idx.pin("f2")
    assert idx.reserve("f4", [key(4)], 100) == ["f3"]  # f1 reused, f2 read by a load
    idx.unpin("f2")
    idx.confirm("f4")
    assert idx.reserve("f5", [key(5)], 100) == ["f2"]
    assert idx.locate(key(1)) == ("f1", 0)
    assert idx.reserve("big", [key(6)], 301) is None
    with pytest.raises(ValueError, match="in use"):
        idx.resize(1000)


def test_the_lru_order_is_kept_where_no_policy_is_named():
    idx = ChunkIndex(200)
    for i in (1, 2):
        idx.reserve(f"f{i}", [key(i)], 100, reused=i == 1)
        idx.confirm(f"f{i}")
    assert idx.reserve("f3", [key(3)], 100) == ["f1"]


@pytest.mark.parametrize("eviction", ["lru", "kvaware"])
def test_a_file_retired_while_read_and_written_again_is_counted_once(eviction):
    """A listed tier retires a file a load is reading; the same content id is written again
    before the load ends. The index holds one file under that id: once both are gone its
    bytes are all free, and a write of the whole capacity fits."""
    idx = ChunkIndex(1000, eviction=eviction)
    keys = [key(1)]
    assert idx.reserve("c", keys, 100) == []
    idx.confirm("c")
    idx.pin("c")
    assert idx.retire("c")
    assert idx.reserve("c", keys, 100) == []  # the same content, written again
    idx.confirm("c")
    idx.unpin("c")
    idx.remove("c")
    assert (idx.used_bytes, idx._held_bytes) == (0, 0)
    assert idx.reserve("d", [key(2)], 1000) == []


@pytest.mark.parametrize(("section", "victim"), [({}, "f2"), ({"eviction": "kvaware"}, "f2"),
                                                 ({"eviction": "lru"}, "f1")])
def test_the_config_picks_the_eviction_of_the_engines_nvme_index(tmp_path, section, victim):
    """The engine's NVMe planner, built from the config: f1 holds reused blocks, f2 and f3
    are one-offs. A full tier makes room for f4: kvaware (the default) drops the oldest
    one-off, f2; ``nvme.eviction: lru`` drops the oldest file, f1."""
    cfg = parse_config({"nvme": {"path": str(tmp_path), "capacity_bytes": 1 << 30, **section}})
    (p,) = make_planners(cfg, namespace="ns", world_size=1, block_bytes_per_rank=4096, counters=Counters())
    assert p.index.policy.name == section.get("eviction", "kvaware")
    size = p.file_bytes(1)
    p.index.resize(3 * size)
    for i in (1, 2, 3):
        assert p.index.reserve(f"f{i}", [key(i)], size, reused=i == 1) == []
        p.index.confirm(f"f{i}")
    assert p.index.reserve("f4", [key(4)], size) == [victim]


def test_plan_trace_replays_the_nvme_eviction_of_the_config_or_the_flag(capsys, tmp_path):
    """One-block prompts over 1 DRAM block and 3 NVMe blocks: block 1 is reused in DRAM,
    then four one-offs push it down and along. kvaware keeps it on the NVMe for the last
    request; LRU has dropped it. The flag overrides the config's ``nvme.eviction``."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 256, "output_length": 1, "hash_ids": [h]})
                             + "\n" for i, h in enumerate([1, 1, 2, 3, 4, 5, 6, 1])))
    lru_cfg = json.dumps({"nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 1 << 30, "eviction": "lru"}})

    def nvme_tokens(*args: str) -> tuple[str, int]:
        assert main(["plan", "--trace", str(trace), "--trace-block-tokens", "256", "--cpu-blocks", "1",
                     "--nvme-blocks", "3", *args, "--json"]) == 0, capsys.readouterr().err
        out = json.loads(capsys.readouterr().out)
        return out["nvme_eviction"], out["tiers"][1]["hit_tokens"]

    assert nvme_tokens() == ("kvaware", 256)
    assert nvme_tokens("--nvme-eviction", "lru") == ("lru", 0)
    assert nvme_tokens("--extra-config", lru_cfg) == ("lru", 0)
    assert nvme_tokens("--extra-config", lru_cfg, "--nvme-eviction", "kvaware") == ("kvaware", 256)
    assert main(["plan", "--trace", str(trace), "--trace-block-tokens", "256", "--cpu-blocks", "1",
                 "--nvme-blocks", "3", "--nvme-eviction", "lru"]) == 0
    assert "(cpu.eviction kvaware, nvme.eviction lru;" in capsys.readouterr().out
    assert main(["plan", "--trace", str(trace), "--cpu-blocks", "1", "--nvme-eviction", "lru"]) == 2
    assert "--nvme-eviction: no NVMe tier" in capsys.readouterr().err
