"""The worker's data path: what moves one rank's blocks, built once by :func:`build_datapath`.

Who builds it: :class:`~vllm_kvtier.transfer.worker.WorkerHalf`, from the worker's main
thread, in its first ``begin_step``. Why not at ``register_kv_caches``: the pool size comes
from the scheduler, in the first :class:`~vllm_kvtier.jobs.StepPlan` (``num_slots``), and
the worker cannot compute the same value. The scheduler sizes the pool in its own process
(``connector/wiring.py``, ``pool_slots``). By default it takes ``cpu.capacity_fraction`` of
the memory available there and then; the worker would read another figure, at another
time. Its block size comes from vLLM's KV cache specs, not from this rank's layout. A pool
of another size would give the two halves different slot numbers.

The tiers below CPU are built in the same call, only when the scheduler's namespace (also
in the first plan) agrees with the worker's. Otherwise the path has no lower tier.

Who uses it: the worker half and its trackers (:mod:`.saves`, :mod:`.loads`,
:mod:`.prefetches`), from the worker's main thread. The copy engine may run one background
thread of its own. Nothing here blocks, except ``close`` of the parts (at shutdown).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.transfer.copier import CopyEngine, make_copy_engine
from vllm_kvtier.transfer.layout import KVLayout
from vllm_kvtier.transfer.peer import PeerLink
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.tier_io import ChunkWorker
from vllm_kvtier.transfer.verify import BlockVerifier

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DataPath:
    """One rank's data path. Its parts are fixed once built; only ``lower`` is emptied, at
    shutdown, once its tiers are closed."""

    layout: KVLayout
    pool: CPUPool
    engine: CopyEngine
    #: What each CPU slot holds and which device copy still uses it. Handed to every tier
    #: driver and to the peer link.
    slots: SlotTable
    #: Sync loads go layer by layer (the config and device say so; never with shared KV tensors).
    layered: bool
    #: P/D peer to peer over NIXL (a ``nixl`` section), when NIXL could start here.
    peer: PeerLink | None = None
    #: What this rank publishes for the peer link, once: its description, or why it has none.
    #: None: no ``nixl`` section.
    peer_info: dict | None = None
    #: Shadow verification (``verify.sample_rate`` > 0 only).
    verifier: BlockVerifier | None = None
    #: The tiers below CPU by name ("nvme", "s3"). Empty under a namespace conflict.
    lower: dict[str, ChunkWorker] = field(default_factory=dict)

    def check_size(self, num_slots: int) -> None:
        """Raise RuntimeError when the scheduler's pool size is no longer this pool's. Both
        sizes are named. The scheduler never resizes the pool: this is a bug, not a miss."""
        if num_slots != self.pool.num_slots:
            raise RuntimeError(f"kvtier: scheduler changed the pool size ({self.pool.num_slots} -> {num_slots})")


def build_datapath(cfg: KVTierConfig, layout: KVLayout, num_slots: int, *, namespace: str, rank: int,
                   counters: Counters, cache_dtype: str = "auto",
                   make_tiers: Callable[..., dict[str, Any]] | None = None, with_lower: bool = True) -> DataPath:
    """Build the pool of ``num_slots`` slots and everything on it, in dependency order.

    ``make_tiers(cfg, namespace=, rank=, slots=, counters=, kv_dtype=)``: this rank's tiers
    below CPU (None: none). ``with_lower``: False under a namespace conflict; then no lower
    tier is built. ``cache_dtype``: vLLM's (which fp8 format a ``uint8`` cache holds).

    The caller is the worker's main thread, at its first step. Allocating the pool may take
    a while (pinned, prefaulted memory). A peer link that cannot start is logged and counted
    (``store_failures`` of ``peer``); P/D then falls back to recompute. Any other failure
    raises: the worker cannot serve without its pool."""
    pin_cfg = cfg.cpu.pin_memory
    pin = pin_cfg == "on" or (pin_cfg == "auto" and layout.device.type == "cuda")
    pool = CPUPool(num_slots, layout.plane_bytes, pin=pin, prefault=cfg.cpu.prefault)
    mode = cfg.layer_pipelined_loads
    path = DataPath(layout=layout, pool=pool, engine=make_copy_engine(layout, pool), slots=SlotTable(pool),
                    layered=not layout.shared and (mode == "on" or (mode == "auto" and layout.device.type == "cuda")))
    if cfg.nixl is not None:
        try:
            path.peer = PeerLink(cfg.nixl, pool, rank=rank, counters=counters)
        except Exception as e:  # ImportError (install hint), no UCX...: P/D falls back to recompute
            logger.error("kvtier peer: NIXL unavailable, P/D peer transfers disabled: %s", e)
            counters.add(CounterName.STORE_FAILURES, TierName.PEER)
            # said so that the scheduler stops waiting for this rank's address
            path.peer_info = {"unavailable": str(e)}
        else:
            path.slots.stamp_with(path.peer)
            path.peer_info = path.peer.describe()
    if cfg.verify.sample_rate > 0:
        path.verifier = BlockVerifier(cfg.verify, layout, path.slots, namespace=namespace, rank=rank,
                                      cache_dtype=cache_dtype)
    if make_tiers is not None and with_lower:
        path.lower = make_tiers(cfg, namespace=namespace, rank=rank, slots=path.slots, counters=counters,
                                kv_dtype=layout.dtype)
    return path
