"""The CPU tier and the tiers below, chosen together."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_kvtier.config import parse_config
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
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
