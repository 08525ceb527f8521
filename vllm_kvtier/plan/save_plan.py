"""Which blocks of a request to store in the CPU tier now, and in which slots.

Who calls it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`, from vLLM's
scheduler thread, each step for every scheduled request (blocks complete once the step's
forward ran) and at ``request_finished`` (what is left). Pure bookkeeping on the
:class:`~vllm_kvtier.index.slot_index.SlotIndex`; the worker copies the bytes.

A block already stored is touched, not stored again; a block with no free slot (every slot
pinned) is skipped and counted (``store_skipped``). Each lower tier hears of every slot
taken (``on_cpu_save``) and every key evicted for it (``on_cpu_evict``), to write through
or demote. A request may key-pin its prompt blocks with ``kv_transfer_params:
{"kvtier_pin_ttl_s": N}`` when ``cpu.request_pins`` is on (its TTL at most
``cpu.max_pin_ttl_s``, the pins bounded by ``cpu.max_pinned_fraction``; decided once per
request, :mod:`~vllm_kvtier.plan.request_params`). A request whose KV depends on blocks
from an untrusted peer (``ReqState.private``) stores nothing. Positions holding vLLM's
null block, or refused by the request's ``keep`` filter (a sliding-window group:
:class:`~vllm_kvtier.index.groups.SaveFilter`), are not stored. A finished request's save
waits for the next step's plan (:meth:`SavePlanner.plan_final`). A block found wrong is
dropped from every tier (:meth:`SavePlanner.drop_stored`).
"""

from __future__ import annotations

from typing import Any

from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.jobs import SaveJob
from vllm_kvtier.keys import BlockKey, TierName
from vllm_kvtier.metrics import CounterName, Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner
from vllm_kvtier.plan.events import EventLog
from vllm_kvtier.plan.req_state import ReqState

TIER = TierName.CPU
#: vLLM's null block (a sliding-window group's position outside the window)
NULL_BLOCK = 0


class SavePlanner:
    """Plans the saves of the requests followed. Owns the saves of finished requests
    until the next step's plan takes them."""

    def __init__(self, index: SlotIndex, lower: list[ChunkPlanner], counters: Counters, *, block_size: int,
                 save_decode_blocks: bool, events: EventLog | None = None) -> None:
        self.index = index
        self.lower = lower
        self.counters = counters
        self.block_size = block_size
        self.save_decode_blocks = save_decode_blocks
        #: KV events on: what a router sees of each block saved is noted while its request lives
        self.events = events
        #: Skip positions holding vLLM's null block (hybrid models; set by the connector).
        self.skip_null_blocks = False
        #: Saves of finished requests, sent with the next step's plan (:meth:`take_final`).
        self._final: list[SaveJob] = []

    def saveable_blocks(self, request: Any, num_computed_tokens: int) -> int:
        """Blocks [0, n) of ``request`` complete once ``num_computed_tokens`` are computed
        (prompt blocks only unless ``save_decode_blocks``)."""
        n = num_computed_tokens // self.block_size
        if not self.save_decode_blocks:
            n = min(n, request.num_prompt_tokens // self.block_size)
        return min(n, len(request.block_hashes))

    def _pin_prompt(self, state: ReqState, ttl_s: float, lo: int, hi: int) -> None:
        """Key-pin the stored prompt blocks in [lo, hi) of a request that asked for it."""
        hashes = state.request.block_hashes
        for i in range(lo, min(hi, state.request.num_prompt_tokens // self.block_size, len(hashes))):
            self.index.pin_key(BlockKey(hashes[i]), ttl_s)

    def plan(self, state: ReqState, upto: int) -> SaveJob | None:
        """The save of ``state``'s blocks [next_save, upto) not stored yet (None if none);
        advances ``next_save``."""
        if state.private:
            state.next_save = max(state.next_save, upto)
            return None
        blocks, slots, keys, positions = [], [], [], []
        hashes = state.request.block_hashes
        first = state.next_save
        for i in range(state.next_save, upto):
            if i >= len(state.block_ids):
                break
            if (self.skip_null_blocks and state.block_ids[i] == NULL_BLOCK) or \
                    (state.keep is not None and not state.keep(i)):
                continue  # outside a sliding window: no block, or no later request reads it
            key = BlockKey(hashes[i])
            if key in self.index:
                self.index.touch(key)
                continue
            alloc = self.index.allocate(key, BlockKey(hashes[i - 1]) if i else None)
            if alloc is None:
                self.counters.add(CounterName.STORE_SKIPPED, TIER)
                continue
            for tier in self.lower:
                if alloc.evicted is not None:
                    tier.on_cpu_evict(alloc.slot, alloc.evicted)
                tier.on_cpu_save(alloc.slot, key)
            # Held until the job is planned: a later block of this job must not evict
            # this one (the job would write the slot twice, and lose its prefix).
            self.index.pin(alloc.slot)
            blocks.append(state.block_ids[i])
            slots.append(alloc.slot)
            keys.append(key)
            positions.append(i)
            state.saved[i] = key
        for s in slots:
            self.index.unpin(s)
        if state.pin_ttl_s is not None:
            self._pin_prompt(state, state.pin_ttl_s, first, upto)
        state.next_save = max(state.next_save, upto)
        if not blocks:
            return None
        if self.events is not None:
            self.events.note(state.request, positions, keys)
        state.saves_issued = True
        return SaveJob(state.request.request_id, tuple(blocks), tuple(slots), tuple(keys))

    def plan_final(self, state: ReqState, upto: int) -> SaveJob | None:
        """:meth:`plan` for a finished request. The job waits for the next step's plan
        (:meth:`take_final`)."""
        job = self.plan(state, upto)
        if job is not None:
            self._final.append(job)
        return job

    def take_final(self) -> list[SaveJob]:
        """The saves of requests finished since the last call (once a step)."""
        final, self._final = self._final, []
        return final

    def pending_final(self) -> list[SaveJob]:
        """The saves of finished requests the next step's plan will carry."""
        return list(self._final)

    def drop_after(self, state: ReqState, pos: int) -> None:
        """The block at ``pos`` of ``state`` failed to load. The blocks this request saved
        after it attended to wrong KV: drop them too. vLLM recomputes from ``pos``. They
        are saved again once complete."""
        for p in [p for p in state.saved if p > pos]:
            self.drop_stored(state.saved.pop(p))
        state.next_save = min(state.next_save, pos)

    def drop_stored(self, key: BlockKey) -> None:
        """Remove ``key`` from the CPU tier and every lower tier (wrong KV, or a unit no
        later request can use)."""
        self.index.remove(key)
        for tier in self.lower:
            tier.drop_key(key)
