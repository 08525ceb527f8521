"""The CPU tier and the tiers below, chosen together: what the DRAM policy learns of
the tier below, and the streamed replay of ``kvtier plan --trace``."""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from pathlib import Path

import pytest

from testkit.requests import Req
from vllm_kvtier.catalog.base import Listing
from vllm_kvtier.config import parse_config
from vllm_kvtier.config.lower import NVMeTierConfig
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.ops.trace_plan import (
    TracePlanInput,
    lower_tier,
    make_trace_plan,
    recommend_admission,
    render_trace_plan,
)
from vllm_kvtier.ops.trace_sim import (
    LowerTier,
    TierSetup,
    Trace,
    TraceError,
    make_trace,
    read_trace,
    simulate_belady,
    simulate_infinite,
    simulate_policy,
    simulate_tiers,
)
from vllm_kvtier.ops.trace_stream import TraceFile, open_trace
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext
from vllm_kvtier.plan.inputs import StepInput, WorkerOutput
from vllm_kvtier.plan.scheduler import PlannerSetup, SchedulerPlanner

BS = 4


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "big"))


def test_a_write_confirmed_below_makes_its_dram_copy_the_next_to_go():
    """The engine path: the scheduler's CPU index (kvaware) hears of every chunk the tier
    below confirms. Of two reused prompts, the one also stored below leaves DRAM first,
    tail first, though it is the more recent."""
    below = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 2, None), PlannerContext(1, 64, Counters()),
                         Listing([{}]))
    planner = SchedulerPlanner(parse_config({}), PlannerSetup(BS, 4, 64), lower=[below])
    jobs = []
    for name, ks in (("a", [key(0), key(1)]), ("b", [key(2), key(3)])):
        below.note_request(ks)
        planner.on_alloc(Req(name, ks, 2 * BS), [10, 11], 0)
        jobs += planner.plan_step(StepInput({name: 2 * BS}, ())).write_through
    for i in range(4):
        planner.index.touch(key(i))  # both prompts reused once
    assert planner.index.items()[0][0] == key(1)  # the older prompt's tail goes first
    b_chunk = next(j for j in jobs if key(2) in j.keys)
    planner.on_worker_output(WorkerOutput(report=WorkerReport(written={("s3", b_chunk.chunk_id): 1})))
    assert [k for k, _ in planner.index.items()][:2] == [key(3), key(2)]


def _records(n: int, seed: int = 0) -> list[dict]:
    """``n`` chat-like requests: a shared head block, then a conversation's growing turns."""
    out = []
    for i in range(n):
        conv = (i * 7 + seed) % max(1, n // 4)
        turn = i // max(1, n // 4)
        ids = [0] + [1000 * conv + t + 1 for t in range(2 + turn)]
        out.append({"timestamp": i * 10, "input_length": 16 * len(ids) - 3, "output_length": 5, "hash_ids": ids})
    return out


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_streamed_trace_replays_as_the_trace_in_memory(tmp_path):
    path = _write(tmp_path / "t.jsonl", _records(400))
    whole, streamed = read_trace(path), open_trace(path)
    assert isinstance(streamed, TraceFile)
    assert (streamed.block_tokens, streamed.block_tokens_source, len(streamed), streamed.prompt_tokens,
            streamed.duration_s) == (16, "inferred", 400, whole.prompt_tokens, whole.duration_s)
    setup = TierSetup(cpu_blocks=20, cpu_eviction="kvaware", step_blocks=2)
    assert simulate_tiers(streamed, setup).tiers == simulate_tiers(whole, setup).tiers
    assert simulate_belady(streamed, 20) == simulate_belady(whole, 20)
    assert simulate_infinite(streamed) == simulate_infinite(whole)


def test_an_unsorted_trace_is_sorted_in_memory_and_a_bad_line_is_named(tmp_path):
    records = _records(10)
    records[3], records[4] = records[4], records[3]
    trace = open_trace(_write(tmp_path / "u.jsonl", records))
    assert not isinstance(trace, TraceFile) and list(trace.timestamps_ms) == sorted(trace.timestamps_ms)
    (tmp_path / "bad.jsonl").write_text(json.dumps(records[0]) + "\n{\"timestamp\": 1}\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:2: no 'hash_ids' field|bad.jsonl:2: no 'input_length'"):
        open_trace(tmp_path / "bad.jsonl")


def _peak_bytes(path: Path, streamed: bool) -> int:
    """Peak bytes allocated while reading the trace (whole or streamed) and replaying it."""
    tracemalloc.start()
    trace = open_trace(path) if streamed else read_trace(path)
    simulate_tiers(trace, TierSetup(cpu_blocks=50, cpu_eviction="kvaware", step_blocks=4))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_the_streamed_replay_holds_the_indexes_not_the_trace(tmp_path):
    """A replay streamed from the file peaks far below the trace held in memory: it holds
    the pool, its history and one request (and Python's free lists), not the trace."""
    path = _write(tmp_path / "t.jsonl", _records(8000))
    whole, streamed = _peak_bytes(path, False), _peak_bytes(path, True)
    assert streamed < whole / 4, (streamed, whole)


# ---- two tiers on hand-made traces ------------------------------------------------------


def _chats(turns: int, convs: int) -> Trace:
    """``convs`` conversations of two new blocks a turn, interleaved, one request a second:
    each turn comes back after every other conversation's turn (a small DRAM has cycled)."""
    records, prompt = [], {c: [] for c in range(convs)}
    for t in range(turns):
        for c in range(convs):
            prompt[c] = prompt[c] + [100 * c + 2 * t + 1, 100 * c + 2 * t + 2]
            records.append({"timestamp": 1000 * len(records), "input_length": 512 * len(prompt[c]),
                            "output_length": 1, "hash_ids": list(prompt[c])})
    return make_trace(records, 512)


def _nvme(blocks: int, **kw: object) -> LowerTier:
    """The NVMe tier with the section's defaults, as ``kvtier plan --trace`` builds it."""
    t = lower_tier("nvme", blocks, trace_block_tokens=512, engine_block_tokens=16, block_bytes=0)
    return dataclasses.replace(t, **kw)


def test_dram_over_nvme_serves_no_less_than_one_lru_cache_of_the_nvme_size():
    """The defaults: every block DRAM evicts reaches the SSD, so a turn that comes back
    after DRAM cycled is served from NVMe. Waiting for a second sight (2) serves nothing
    of the first reuses, far below one LRU cache of the SSD's size."""
    trace = _chats(turns=3, convs=4)
    lru = simulate_policy(trace, 24, "lru").hit_tokens
    assert lru > 0
    for dram in (4, 6, 8, 12):  # room for a prompt's hits to be read into DRAM
        default = simulate_tiers(trace, TierSetup(cpu_blocks=dram, lower=(_nvme(24),)))
        assert default.hit_tokens >= lru, dram
    second_sight = simulate_tiers(trace, TierSetup(cpu_blocks=4, lower=(_nvme(24, admit_min_seen=2),)))
    assert second_sight.hit_tokens < lru / 2


def test_admission_trades_ssd_writes_for_hits_and_the_default_takes_the_hits():
    """The frontier: each step up of ``admit_min_seen`` writes fewer blocks and serves
    fewer tokens. With no background flush, 2 writes exactly the blocks seen twice."""
    trace = _chats(turns=4, convs=3)
    runs = {n: simulate_tiers(trace, TierSetup(cpu_blocks=8, lower=(_nvme(64, admit_min_seen=n, flush_interval_s=0.0),)))
            for n in (1, 2, 3)}
    writes = [runs[n].tiers[1].written_blocks for n in (1, 2, 3)]
    hits = [runs[n].hit_tokens for n in (1, 2, 3)]
    assert writes[0] > writes[1] > writes[2] and hits[0] > hits[1] > hits[2]
    # blocks of turns 1-3 are seen again by a later turn; those of turn 4 never are
    assert writes[1] <= 3 * 6 < writes[0]
    assert NVMeTierConfig.__dataclass_fields__["admit_min_seen"].default == 1


def test_plan_trace_replays_the_admission_frontier_and_recommends_from_it():
    """``kvtier plan --trace`` replays NVMe admission 1 and 2 through the engine's own
    planner code and recommends the value that serves the most (writes shown beside)."""
    trace = _chats(turns=4, convs=3)
    setup = TierSetup(cpu_blocks=8, lower=(_nvme(64, admit_min_seen=2),))
    plan = make_trace_plan(TracePlanInput(trace=trace, setup=setup))
    once = simulate_tiers(trace, dataclasses.replace(setup, lower=(_nvme(64, admit_min_seen=1),)))
    assert plan.admission_frontier[1] == (once.hit_tokens / once.prompt_tokens,
                                          once.tiers[1].written_blocks * 3600.0 / once.duration_s)
    assert plan.admission_frontier[1][0] > plan.admission_frontier[2][0]
    assert plan.recommended_admit_min_seen == 1
    assert "recommendation: nvme.admit_min_seen: set 1" in render_trace_plan(plan)


def test_the_admission_recommendation_keeps_the_configured_value_on_a_tie():
    """A large DRAM outlives the flush: both values write the same blocks and serve the
    same share, so the plan keeps what the config says."""
    trace = _chats(turns=4, convs=3)
    for configured in (1, 2):
        setup = TierSetup(cpu_blocks=64, lower=(_nvme(64, admit_min_seen=configured),))
        plan = make_trace_plan(TracePlanInput(trace=trace, setup=setup))
        assert plan.admission_frontier[1] == plan.admission_frontier[2]
        assert plan.recommended_admit_min_seen == configured
        assert plan.admission_recommendation.startswith(f"nvme.admit_min_seen: keep {configured} ")
    # within the margin, the one writing less wins
    assert recommend_admission(setup, {1: (0.300, 200.0), 2: (0.298, 150.0)})[0] == 2
