"""KV events on plain keys (no engine): what the indexes report, coalescing per step, the
queue bound and its counter, locality, the start-up backlog, and vLLM's msgspec types."""

from __future__ import annotations

from array import array

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from testkit.requests import Req
from vllm_kvtier.catalog.base import Listing, MemoryLookups
from vllm_kvtier.catalog.rescan import Rescanner
from vllm_kvtier.chunkformat import align_up, header_bytes_for, make_header
from vllm_kvtier.config import EventsConfig, parse_config
from vllm_kvtier.connector.events import to_vllm
from vllm_kvtier.index.chunk_index import ChunkIndex
from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext
from vllm_kvtier.plan.events import BlockInfo, EventLog, TierEvent, describe_block
from vllm_kvtier.plan.inputs import StepInput
from vllm_kvtier.plan.scheduler import PlannerSetup, SchedulerPlanner

BS = 4


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "big"))


def log(max_queued: int = 1000, max_info: int = 1000, counters: Counters | None = None) -> EventLog:
    return EventLog(EventsConfig(max_queued_blocks=max_queued, max_block_info=max_info),
                    counters if counters is not None else Counters(),
                    describe=lambda r, i: describe_block(r, i, BS))


def flat(events: list[TierEvent]) -> list[tuple[bool, str, str, BlockKey]]:
    return [(e.stored, e.tier, e.locality, k) for e in events for k, _ in e.blocks]


def test_flips_within_a_step_cancel_and_repeats_count_once():
    ev = log()
    ev.record("cpu", [key(1)], True)
    ev.record("cpu", [key(1)], False)  # stored and evicted before the router heard: nothing
    ev.record("cpu", [key(2)], True)
    ev.record("cpu", [key(2)], True)
    ev.record("nvme", [key(2)], True)  # another tier: its own entry
    assert flat(ev.take()) == [(True, "cpu", "LOCAL", key(2)), (True, "nvme", "LOCAL", key(2))]
    ev.record("cpu", [key(2)], False)
    ev.record("cpu", [key(2)], True)  # evicted and saved again in one step: as the router saw it
    assert ev.take() == []


def test_a_burst_is_capped_and_counted():
    counters = Counters()
    ev = log(max_queued=100, counters=counters)
    ev.record("cpu", [key(i) for i in range(250)], False)
    assert ev.pending() == 100
    assert counters.totals["events_dropped|cpu"] == 150
    events = ev.take()
    assert len(flat(events)) == 100 and len(events) == 1  # one run: one BlockRemoved
    assert ev.pending() == 0
    ev.record("cpu", [key(1000)], True)  # the next step has room again
    assert flat(ev.take()) == [(True, "cpu", "LOCAL", key(1000))]


def test_block_info_is_bounded_lru():
    ev = log(max_info=2)
    req = Req("r", [key(i) for i in range(3)], 3 * BS, all_token_ids=list(range(3 * BS)))
    ev.note(req, [0, 1, 2], [key(0), key(1), key(2)])
    assert ev.info(key(0)) is None  # the oldest is forgotten
    info = ev.info(key(2))
    assert info is not None and info.parent_hash == key(1) and info.token_ids.tolist() == [8, 9, 10, 11]


def test_slot_index_reports_entries_evictions_and_removals():
    idx = SlotIndex(2)
    seen: list[tuple[BlockKey, bool]] = []
    idx.watch = lambda k, present: seen.append((k, present))
    idx.allocate(key(1))
    idx.allocate(key(2))
    idx.allocate(key(3))  # evicts key(1) (LRU)
    idx.remove(key(2))
    assert seen == [(key(1), True), (key(2), True), (key(1), False), (key(3), True), (key(2), False)]


def test_chunk_index_reports_only_loadability_changes():
    idx = ChunkIndex(capacity_bytes=200)
    seen: list[tuple[str, list[BlockKey], bool]] = []
    idx.watch = lambda fid, keys, ok: seen.append((fid, list(keys), ok))
    idx.reserve("a", [key(1), key(2)], 100)
    assert seen == []  # being written: not loadable yet
    idx.confirm("a")
    idx.add_existing("b", [key(2), key(3)], 100)  # key(2) stays located in "a"
    idx.pin("b")
    idx.retire("b")  # pinned: no longer offered
    idx.unpin("b")  # forgotten now, nothing more to say
    idx.remove("a")
    assert seen == [("a", [key(1), key(2)], True), ("b", [key(3)], True), ("b", [key(3)], False),
                    ("a", [key(1), key(2)], False)]


def _chunk_planner(found=None, rescanner=None, local=None, exclusive=False) -> ChunkPlanner:
    return ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 2, None, exclusive=exclusive), PlannerContext(1, 64, Counters()), Listing(found or [{}], catalog=rescanner, local_chunks=local))


def test_lower_tier_locality_our_writes_local_other_writers_remote():
    mine = make_header("ns", [key(1), key(11)], [0, 0], 64)
    theirs = make_header("ns", [key(2), key(12)], [0, 0], 64)
    found = [{"mine": mine, "theirs": theirs}]
    later = make_header("ns", [key(3), key(4)], [0, 1], 64)
    listings = [[{"mine": mine, "theirs": theirs, "later": later}]]
    r = Rescanner("s3", lambda: listings.pop(0), 3600.0, initial=found)
    p = _chunk_planner(found, r, local=frozenset({"mine"}))
    ev = log(max_queued=2)  # the start-up backlog goes out at most 2 blocks a step
    p.attach_events(ev)
    assert flat(ev.take()) == [(True, "s3", "LOCAL", key(1)), (True, "s3", "LOCAL", key(11))]
    assert flat(ev.take()) == [(True, "s3", "REMOTE", key(2)), (True, "s3", "REMOTE", key(12))]
    assert ev.take() == []
    r.rescan_once()
    p.refresh()  # a rescan found another writer's chunk
    assert flat(ev.take()) == [(True, "s3", "REMOTE", key(3)), (True, "s3", "REMOTE", key(4))]


def test_lower_tier_write_is_announced_at_the_ack_and_eviction_removes_it():
    one_chunk = header_bytes_for(1) + align_up(64)
    p = ChunkPlanner(ChunkPolicy("nvme", "write-through", 1, 2, 2 * one_chunk, exclusive=True), PlannerContext(2, 64, Counters()), Listing([{}, {}]))
    ev = log()
    p.attach_events(ev)
    p.note_request([key(1), key(2), key(3)])
    p.on_cpu_save(0, key(1))
    _, through, _ = p.take_jobs(set(), lambda k: 0)
    (job,) = through
    assert ev.take() == []  # reserved, being written
    p.on_worker_meta(WorkerReport(written={("nvme", job.chunk_id): 1}))
    assert ev.take() == []  # one rank of two
    p.on_worker_meta(WorkerReport(written={("nvme", job.chunk_id): 1}))
    assert flat(ev.take()) == [(True, "nvme", "LOCAL", key(1))]
    p.on_cpu_save(1, key(2))  # the next write evicts the first (capacity: one chunk a rank)
    p.take_jobs(set(), lambda k: 1)
    assert flat(ev.take()) == [(False, "nvme", "LOCAL", key(1))]


def test_planner_cpu_events_carry_vllm_hashes_tokens_and_parents():
    cfg = parse_config({})
    counters = Counters()
    ev = log(counters=counters)
    planner = SchedulerPlanner(cfg, PlannerSetup(BS, 2, 64), counters=counters, events=ev)
    req = Req("r", [key(i) for i in range(2)], 2 * BS, all_token_ids=list(range(100, 100 + 2 * BS)))
    planner.on_alloc(req, [10, 11], 0)
    planner.plan_step(StepInput({"r": 2 * BS}, ()))  # saves both blocks (save issued: loadable)
    events = planner.take_events()
    assert flat(events) == [(True, "cpu", "LOCAL", key(0)), (True, "cpu", "LOCAL", key(1))]
    _, info = events[0].blocks[1]
    assert info is not None and info.parent_hash == key(0) and info.token_ids.tolist() == [104, 105, 106, 107]
    assert planner.take_events() == []
    other = Req("o", [key(50)], BS, all_token_ids=[1, 2, 3, 4])
    planner.on_alloc(other, [20], 0)
    planner.plan_step(StepInput({"o": BS}, ()))  # a full tier: its save evicts one block
    (evicted,) = [k for k in (key(0), key(1)) if k not in planner.index]
    assert flat(planner.take_events()) == [(False, "cpu", "LOCAL", evicted), (True, "cpu", "LOCAL", key(50))]


def test_no_event_log_no_events():
    planner = SchedulerPlanner(parse_config({}), PlannerSetup(BS, 2, 64))
    assert planner.events is None and planner.index.watch is None and planner.take_events() == []


def test_vllm_types_round_trip_through_msgpack():
    info = BlockInfo(block_hash=key(7), parent_hash=key(6), token_ids=array("i", [1, 2, 3, 4]), lora_name="a",
                     lora_id=3)
    events = to_vllm([
        TierEvent(True, "cpu", "LOCAL", ((key(7), info),)),
        TierEvent(True, "s3", "REMOTE", ((key(9), None),)),
        TierEvent(False, "nvme", "LOCAL", ((key(7), info), (key(9), None))),
    ])
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events)), type=KVEventBatch)
    cpu, s3, removed = batch.events
    ext = {k: maybe_convert_block_hash(BlockHash(k)) for k in (key(6), key(7), key(9))}  # bytes or ints
    assert isinstance(cpu, BlockStored) and cpu.medium == "CPU" and cpu.locality is None
    assert cpu.block_hashes == [ext[key(7)]] and cpu.parent_block_hash == ext[key(6)] and cpu.token_ids == [1, 2, 3, 4]
    assert cpu.block_size == 4 and cpu.lora_name == "a" and cpu.group_idx == 0
    assert isinstance(s3, BlockStored) and (s3.medium, s3.ownership, s3.locality) == ("STORAGE", "s3", "REMOTE")
    assert s3.token_ids == [] and s3.block_size == 0  # vLLM's placeholder form: hash only
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [ext[key(7)], ext[key(9)]]
    assert (removed.medium, removed.ownership, removed.locality) == ("STORAGE", "nvme", "LOCAL")


def test_built_only_when_vllms_kv_events_are_on():
    from types import SimpleNamespace

    from vllm_kvtier.connector.events import event_log

    cfg = parse_config({}).events
    on = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True),
                         cache_config=SimpleNamespace(block_size=BS))
    off = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=False), cache_config=on.cache_config)
    assert event_log(cfg, on, Counters()) is not None
    assert event_log(cfg, off, Counters()) is None
    assert event_log(cfg, SimpleNamespace(kv_events_config=None, cache_config=on.cache_config), Counters()) is None


def test_a_lora_block_is_published_under_vllms_hash_not_our_adapter_bound_key():
    from types import SimpleNamespace

    from vllm_kvtier.connector.events import describe
    from vllm_kvtier.engine.scheduler import AdapterRequest

    live = SimpleNamespace(request_id="r", block_hashes=[key(0), key(1)], all_token_ids=list(range(2 * BS)),
                           lora_request=SimpleNamespace(name="sql", adapter_id=5))
    view = AdapterRequest(live, b"adapter-content-digest")
    assert view.block_hashes[1] != key(1)  # our key is bound to the adapter's content
    info = describe(BS)(view, 1)
    assert info is not None and info.block_hash == key(1) and info.parent_hash == key(0)
    assert (info.lora_name, info.lora_id, info.token_ids.tolist()) == ("sql", 5, [4, 5, 6, 7])
    ev = log()
    ev.register(BlockKey(view.block_hashes[1]), info)
    (removed,) = to_vllm([TierEvent(False, "cpu", "LOCAL", ((BlockKey(view.block_hashes[1]), info),))])
    assert removed.block_hashes == [maybe_convert_block_hash(BlockHash(key(1)))]


def test_register_feeds_group_idx_for_derived_keys():
    """The hybrid hook: a derived key registered with its group is published as vLLM's
    hash of that block with that group_idx, and removals are split per group."""
    ev = log()
    derived = key(900)
    ev.register(derived, BlockInfo(block_hash=key(9), parent_hash=None, token_ids=array("i", [1, 2, 3, 4]),
                                   group_idx=1))
    ev.record("cpu", [derived, key(5)], True)
    ev.record("cpu", [derived, key(5)], True)
    stored = to_vllm(ev.take())
    assert [(e.block_hashes, e.group_idx) for e in stored] == [
        ([maybe_convert_block_hash(BlockHash(key(9)))], 1), ([maybe_convert_block_hash(BlockHash(key(5)))], 0)]
    ev.record("cpu", [derived, key(5)], False)
    removed = to_vllm(ev.take())
    assert sorted((e.group_idx, len(e.block_hashes)) for e in removed) == [(0, 1), (1, 1)]


def test_a_pool_lookup_finds_another_instances_block_remote_and_our_write_local():
    """Mooncake (key-named, no listing): a block a lookup finds in the pool was put by
    another instance (REMOTE); one we wrote is LOCAL once every rank acknowledged it."""
    present = {key(1).hex()}
    p = ChunkPlanner(ChunkPolicy("mooncake", "write-through", 1, 1, None, key_named=True), PlannerContext(1, 64, Counters()), Listing([{}], catalog=MemoryLookups(lambda ids: [i in present for i in ids])))
    ev = log()
    p.attach_events(ev)
    p.discover([key(1), key(2)])
    assert flat(ev.take()) == [(True, "mooncake", "REMOTE", key(1))]
    p.note_request([key(2)])
    p.on_cpu_save(0, key(2))
    (job,) = p.take_jobs(set(), lambda k: 0)[1]
    p.on_worker_meta(WorkerReport(written={("mooncake", job.chunk_id): 1}))
    assert flat(ev.take()) == [(True, "mooncake", "LOCAL", key(2))]
    p.on_worker_meta(WorkerReport(bad={("mooncake", key(1).hex())}))  # unreadable: dropped
    assert flat(ev.take()) == [(False, "mooncake", "REMOTE", key(1))]


def test_note_with_a_group_publishes_vllms_hash_under_that_group():
    ev = log()
    req = Req("r", [key(0), key(1)], 2 * BS, all_token_ids=list(range(2 * BS)))
    derived = [key(700), key(701)]  # what the hybrid path stores group 1's blocks under
    ev.note(req, [0, 1], derived, group_idx=1)
    info = ev.info(key(701))
    assert info is not None and (info.block_hash, info.parent_hash, info.group_idx) == (key(1), key(0), 1)


def test_a_hybrid_group_view_is_published_under_vllms_hash_with_its_group():
    """A hybrid model's group-1 view stores under a derived key; its event carries vLLM's
    hash of the block, the parent's hash and tokens as vLLM publishes them, and group_idx 1."""
    from types import SimpleNamespace

    from vllm_kvtier.connector.events import describe
    from vllm_kvtier.engine.scheduler import GroupView

    live = SimpleNamespace(request_id="r", block_hashes=[key(0), key(1)], all_token_ids=list(range(2 * BS)),
                           lora_request=None)
    view = GroupView(live, 1)
    assert view.block_hashes[1] != key(1)  # the group's own key
    info = describe(BS)(view, 1)
    assert info is not None and (info.block_hash, info.parent_hash, info.group_idx) == (key(1), key(0), 1)
    assert info.token_ids.tolist() == [4, 5, 6, 7]
    ev = log()
    ev.register(BlockKey(view.block_hashes[1]), info)
    ev.record("cpu", [BlockKey(view.block_hashes[1])], True)
    (stored,) = to_vllm(ev.take())
    assert (stored.block_hashes, stored.group_idx) == ([maybe_convert_block_hash(BlockHash(key(1)))], 1)
    assert describe(BS)(GroupView(live, 0), 1).group_idx == 0
