"""The CPU tier and the tiers below, chosen together: what the DRAM policy learns of
the tier below, and the streamed replay of ``kvtier plan --trace``."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllm_kvtier.config import parse_config
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.ops.trace_sim import (
    TierSetup,
    TraceError,
    read_trace,
    simulate_belady,
    simulate_infinite,
    simulate_tiers,
)
from vllm_kvtier.ops.trace_stream import TraceFile, open_trace
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy
from vllm_kvtier.plan.inputs import StepInput, WorkerOutput
from vllm_kvtier.plan.scheduler import SchedulerPlanner

BS = 4


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "big"))


@dataclass
class Req:
    request_id: str
    block_hashes: list[bytes]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    lora_request: None = None


def test_a_write_confirmed_below_makes_its_dram_copy_the_next_to_go():
    """The engine path: the scheduler's CPU index (kvaware) hears of every chunk the tier
    below confirms. Of two reused prompts, the one also stored below leaves DRAM first,
    tail first, though it is the more recent."""
    below = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 2, None), world_size=1, block_bytes_per_rank=64,
                         counters=Counters(), found=[{}])
    planner = SchedulerPlanner(parse_config({}), block_size=BS, num_slots=4, slot_bytes_total=64, lower=[below])
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
