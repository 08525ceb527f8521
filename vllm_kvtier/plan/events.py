"""KV events: which blocks became loadable from a tier, and which stopped being so.

Who calls it: the scheduler-side planners, from vLLM's scheduler thread only. Only when
vLLM's KV cache events are on (``--kv-events-config``). Otherwise no :class:`EventLog`
exists and nothing here runs. The indexes report every change through their ``watch``
hooks (:class:`~vllm_kvtier.index.slot_index.SlotIndex` for the CPU tier, each
:class:`~vllm_kvtier.index.chunk_index.ChunkIndex` below it). So an event mirrors exactly
what a lookup can find:

* **CPU**: stored when a key takes a slot (its save is issued). The worker runs saves
  before loads, in step order, so a later load sees the bytes. Removed when it is evicted
  or dropped (failed load, computed on top of a bad block, a private peer block).
* **lower tiers** (NVMe, S3, Mooncake): stored when every TP rank acknowledged the
  chunk's write. Also stored when a scan found it (start-up, S3 rescan, a pool lookup).
  Removed when the tier evicts, deletes, reclaims or drops it (failed write, bad bytes).
  Also removed when a rescan no longer lists it.

Each entry names its tier and a :data:`Locality`. ``LOCAL`` is for what this instance
wrote, and what an exclusive tier (its own NVMe directory) held at start. ``REMOTE`` is for
chunks another writer stored in a shared bucket or pool.

**Bounded**: entries are coalesced until :meth:`EventLog.take` (vLLM calls ``take_events``
every step). A key stored and removed again before it (or removed and stored) cancels out.
A repeat counts once. At most ``events.max_queued_blocks`` entries wait. Beyond that new
ones are dropped and counted (``events_dropped``). Start-up scan results are announced
from a backlog, at most that many a step.

**What a router sees of a block** (:class:`BlockInfo`): the hash vLLM publishes for it,
its parent's, its token ids, LoRA name, KV cache group. The hash is not our key: for a
LoRA request our key is bound to the adapter's content. It is known while the block's
request is alive. It is remembered (LRU, ``events.max_block_info`` blocks) for events that
come later (a demotion written after the request ended). A block without one (found by a
scan, or forgotten) is announced by key only. That is vLLM's own placeholder form: no
tokens, block size 0.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from vllm_kvtier.config import EventsConfig
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import CounterName, Counters

#: Where a block is relative to this instance: what it stored itself, or another writer did.
Locality = Literal["LOCAL", "REMOTE"]


@dataclass(frozen=True)
class BlockInfo:
    """What a router needs of one block besides where it is."""

    #: The hash vLLM publishes for this block (``request.block_hashes[i]`` of the live
    #: request; differs from our key for LoRA requests and derived group keys).
    block_hash: bytes
    #: vLLM's hash of the previous block of the request, None for the first block.
    parent_hash: bytes | None
    #: The block's token ids (int32: 4 bytes a token in memory).
    token_ids: array
    #: vLLM's KV cache group of the block (0 for a model with one group).
    group_idx: int = 0
    lora_name: str | None = None
    lora_id: int | None = None


def describe_block(request: Any, i: int, block_size: int) -> BlockInfo | None:
    """The :class:`BlockInfo` of block ``i`` of a request whose block hashes are vLLM's
    own (the connector passes its own function for LoRA requests). None if unknown."""
    hashes = request.block_hashes
    if i >= len(hashes):
        return None
    tokens = getattr(request, "all_token_ids", None)
    lora = getattr(request, "lora_request", None)
    return BlockInfo(
        block_hash=bytes(hashes[i]), parent_hash=bytes(hashes[i - 1]) if i > 0 else None,
        token_ids=array("i", tokens[i * block_size : (i + 1) * block_size] if tokens is not None else ()),
        lora_name=getattr(lora, "name", None) if lora is not None else None,
        lora_id=getattr(lora, "adapter_id", None) if lora is not None else None,
    )


@dataclass(frozen=True)
class TierEvent:
    """Blocks of one tier that became loadable (``stored``) or stopped being so, in the
    order the tier reported them. ``blocks``: (our key, what a router sees of it or None)."""

    stored: bool
    tier: str
    locality: Locality
    blocks: tuple[tuple[BlockKey, BlockInfo | None], ...]


class EventLog:
    """The queue of tier events between two :meth:`take` calls (see the module doc). Not
    thread-safe: the scheduler thread only; nothing here blocks or raises on a full queue."""

    def __init__(self, cfg: EventsConfig, counters: Counters, *,
                 describe: Callable[[Any, int], BlockInfo | None]) -> None:
        """``describe(request, i)``: the :class:`BlockInfo` of block ``i`` of a live request."""
        self.cfg = cfg
        self.counters = counters
        self._describe = describe
        #: (tier, key) -> (stored, locality), in arrival order: this step's net changes
        self._pending: OrderedDict[tuple[str, BlockKey], tuple[bool, Locality]] = OrderedDict()
        self._info: OrderedDict[BlockKey, BlockInfo] = OrderedDict()
        #: start-up announcements not made yet: (tier, source of (keys, locality))
        self._backlog: list[tuple[str, Iterator[tuple[Sequence[BlockKey], Locality]]]] = []

    # ---- what a router sees of a block ---------------------------------------------

    def register(self, key: BlockKey, info: BlockInfo) -> None:
        """Remember what ``key`` is to a router (the hook for derived keys: a hybrid
        model's group >= 1 keys map to vLLM's hash and their ``group_idx``)."""
        info_map = self._info
        info_map[key] = info
        info_map.move_to_end(key)
        while len(info_map) > self.cfg.max_block_info:
            info_map.popitem(last=False)

    def note(self, request: Any, positions: Sequence[int], keys: Sequence[BlockKey], *,
             group_idx: int = 0) -> None:
        """Blocks ``positions`` of a live ``request`` are stored (or loaded) under ``keys``
        (``group_idx``: vLLM's KV cache group they belong to; a hybrid model's group >= 1
        keys are derived, and published as vLLM's hash of the block with this group)."""
        for i, key in zip(positions, keys, strict=True):
            info = self._describe(request, i)
            if info is not None:
                self.register(key, info if group_idx == 0 else replace(info, group_idx=group_idx))

    def info(self, key: BlockKey) -> BlockInfo | None:
        return self._info.get(key)

    # ---- tier changes -------------------------------------------------------------

    def record(self, tier: str, keys: Sequence[BlockKey], stored: bool, locality: Locality = "LOCAL") -> None:
        """``keys`` became loadable from ``tier`` (``stored``) or stopped being so."""
        pending = self._pending
        dropped = 0
        for key in keys:
            k = (tier, key)
            prev = pending.get(k)
            if prev is None:
                if len(pending) >= self.cfg.max_queued_blocks:
                    dropped += 1
                    continue
                pending[k] = (stored, locality)
            elif prev[0] != stored:
                del pending[k]  # back to where the router last saw it: nothing to say
            else:
                pending[k] = (stored, locality)
        if dropped:
            self.counters.add(CounterName.EVENTS_DROPPED, tier, dropped)

    def announce(self, tier: str, source: Iterator[tuple[Sequence[BlockKey], Locality]]) -> None:
        """Blocks a tier holds already (found at start-up), announced over the next
        :meth:`take` calls, at most ``events.max_queued_blocks`` a call. ``source`` yields
        (keys, locality) and must check each is still loadable when it yields it."""
        self._backlog.append((tier, source))

    def pending(self) -> int:
        """Entries waiting for :meth:`take` (at most ``events.max_queued_blocks``)."""
        return len(self._pending)

    def take(self) -> list[TierEvent]:
        """This step's events (vLLM's ``take_events``): the coalesced changes, then part of
        the start-up backlog, runs of one tier, kind and locality kept in order."""
        out: list[TierEvent] = []
        run: list[tuple[BlockKey, BlockInfo | None]] = []
        head: tuple[bool, str, Locality] | None = None
        info = self._info.get

        def flush() -> None:
            if head is not None and run:
                out.append(TierEvent(head[0], head[1], head[2], tuple(run)))

        for (tier, key), (stored, locality) in self._pending.items():
            if head != (stored, tier, locality):
                flush()
                head, run = (stored, tier, locality), []
            run.append((key, info(key)))
        flush()
        self._pending = OrderedDict()
        budget = self.cfg.max_queued_blocks
        while self._backlog and budget > 0:
            tier, source = self._backlog[0]
            got = next(source, None)
            if got is None:
                self._backlog.pop(0)
                continue
            keys, locality = got
            if keys:
                out.append(TierEvent(True, tier, locality, tuple((k, info(k)) for k in keys)))
                budget -= len(keys)
        return out
