"""KV events in vLLM's own types, for ``KVTierConnector.take_events``.

The planner's tier events become ``BlockStored`` / ``BlockRemoved``
(``vllm.distributed.kv_events``).

Who calls it: the connector in the scheduler role, from vLLM's scheduler thread. vLLM
publishes what ``take_events`` returns with the KV cache manager's own events, over its
``--kv-events-config`` publisher. Built only when ``kv_events_config.enable_kv_cache_events``
is on (:func:`event_log`); otherwise nothing here runs.

Mediums (``docs/events.md`` says why): the CPU tier is vLLM's ``"CPU"``. That is what its
native CPU offloading publishes; no ``locality``, as vLLM's own. The tiers below it are
vLLM's ``"STORAGE"``. That is what its native disk/object offloading publishes. Dynamo's
router maps it to its disk tier; a router that knows only GPU and CPU sets it aside.
``ownership`` names the tier (``"nvme"``, ``"s3"``, ``"mooncake"``), so a router can tell
them apart. ``locality`` is ``"LOCAL"`` (this instance stored it) or ``"REMOTE"`` (another
writer did, in a shared bucket or pool).

Hashes are vLLM's: ``maybe_convert_block_hash`` of the live request's ``block_hashes``, as
its own events publish them. For a LoRA request it is not our adapter-bound key. Some
blocks go out in vLLM's placeholder form (hash only: ``token_ids`` empty, ``block_size``
0). Those are a block whose request is gone and was forgotten, or one a scan found. They
go out by our key. A router will not recognise that key for a LoRA block, so it ignores
it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import BlockHash, ExternalBlockHash, maybe_convert_block_hash

from vllm_kvtier.config import EventsConfig
from vllm_kvtier.engine.scheduler import AdapterRequest, GroupView
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.events import BlockInfo, EventLog, TierEvent, describe_block

__all__ = ["describe", "event_log", "events_enabled", "to_vllm"]


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV cache events (``--kv-events-config`` with
    ``enable_kv_cache_events``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


def describe(block_size: int):  # type: ignore[no-untyped-def]
    """``describe(request, i)`` for :class:`~vllm_kvtier.plan.events.EventLog`.

    It gives block ``i`` as vLLM's own events show it. For a LoRA request it is the live
    request's hash, not ours. For a hybrid model's group view it is vLLM's hash of the
    block, with the view's ``group_idx``. The keys of groups >= 1 are derived from it."""

    def info(request: Any, i: int) -> BlockInfo | None:
        group = 0
        if isinstance(request, GroupView):
            group, request = request.group, request.live
        if isinstance(request, AdapterRequest):
            request = request.live
        found = describe_block(request, i, block_size)
        return found if found is None or group == 0 else dataclasses.replace(found, group_idx=group)

    return info


def event_log(cfg: EventsConfig, vllm_config: Any, counters: Counters) -> EventLog | None:
    """The planner's event log when vLLM's KV events are on, else None (no event work)."""
    if not events_enabled(vllm_config):
        return None
    return EventLog(cfg, counters, describe=describe(vllm_config.cache_config.block_size))


def _hash(h: bytes) -> ExternalBlockHash:
    """A hash as vLLM's own events publish it (bytes, or an int with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    return maybe_convert_block_hash(BlockHash(h))


def _medium(tier: str) -> tuple[str, str | None]:
    """(medium, ownership) of a tier in an event."""
    return (MEDIUM_CPU, None) if tier == TierName.CPU else (MEDIUM_STORAGE, str(tier))


def _stored(info: BlockInfo | None, key: bytes, medium: str, ownership: str | None,
            locality: str | None) -> BlockStored:
    if info is None:  # vLLM's placeholder form: hash only
        return BlockStored(block_hashes=[_hash(key)], parent_block_hash=None, token_ids=[],
                           block_size=0, lora_id=None, medium=medium, lora_name=None, group_idx=0,
                           locality=locality, ownership=ownership)
    parent = info.parent_hash
    return BlockStored(
        block_hashes=[_hash(info.block_hash)],
        parent_block_hash=_hash(parent) if parent is not None else None,
        token_ids=info.token_ids.tolist(), block_size=len(info.token_ids), lora_id=info.lora_id,
        medium=medium, lora_name=info.lora_name, group_idx=info.group_idx, locality=locality, ownership=ownership,
    )


def to_vllm(events: Iterable[TierEvent]) -> list[KVCacheEvent]:
    """vLLM's events for the planner's: one ``BlockStored`` per block (each carries its own
    parent, so order does not matter), one ``BlockRemoved`` per tier, locality and group."""
    out: list[KVCacheEvent] = []
    for ev in events:
        medium, ownership = _medium(ev.tier)
        locality = None if ev.tier == TierName.CPU else ev.locality
        if ev.stored:
            out.extend(_stored(info, key, medium, ownership, locality) for key, info in ev.blocks)
            continue
        by_group: dict[int, list[Any]] = {}
        for key, info in ev.blocks:
            h, g = (key, 0) if info is None else (info.block_hash, info.group_idx)
            by_group.setdefault(g, []).append(_hash(h))
        out.extend(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=g, locality=locality,
                                ownership=ownership) for g, hashes in by_group.items())
    return out
