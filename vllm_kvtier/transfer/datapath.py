"""The worker's data path: what moves one rank's blocks, built once by :func:`build_datapath`.

Who builds it: :class:`~vllm_kvtier.transfer.worker.WorkerHalf`, from the worker's main
thread, in ``register_kv_caches``, before the first request. The pool size is computed
there (``connector/wiring.py``, ``pool_slots``): a fixed ``cpu.capacity_bytes``, or
``cpu.capacity_fraction`` of the memory available once vLLM's own KV cache is allocated.
The ranks of one engine measure before any of them allocates, and take the smallest
figure. Each worker then tells the scheduler its size in vLLM's start-up handshake
(:class:`~vllm_kvtier.connector.metadata.KVTierHandshake`). Every plan repeats the size
(``StepPlan.num_slots``); a plan larger than this pool is a bug, and raises.

The tiers below CPU are opened at the first plan, by :func:`open_lower`, only when the
scheduler's namespace (sent in that plan) is the worker's; it says why not earlier.

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
    """One rank's data path. Its parts are fixed once built; ``lower`` is filled once, at
    the first plan (:func:`open_lower`), and emptied at shutdown, once its tiers are closed."""

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
    #: The tiers below CPU by name ("nvme", "s3"). Empty before the first plan, and under a
    #: namespace conflict.
    lower: dict[str, ChunkWorker] = field(default_factory=dict)

    def check_size(self, num_slots: int) -> None:
        """Raise RuntimeError when the scheduler plans for more slots than this pool has.
        Both sizes are named. A smaller plan is fine: the scheduler sizes its index to the
        smallest rank's pool. A larger one means the scheduler got no handshake from this
        rank and measured the memory itself (under vLLM's ``MultiConnector``, which hands
        only one connector's handshake to all): set ``cpu.capacity_bytes`` there."""
        if num_slots > self.pool.num_slots:
            raise RuntimeError(f"kvtier: the scheduler plans for {num_slots} CPU slots but this rank's pool has "
                               f"{self.pool.num_slots} (no start-up handshake reached it; set cpu.capacity_bytes)")


def build_datapath(cfg: KVTierConfig, layout: KVLayout, num_slots: int, *, namespace: str, rank: int,
                   counters: Counters, cache_dtype: str = "auto") -> DataPath:
    """Build the pool of ``num_slots`` slots and everything on it, in dependency order,
    but the tiers below CPU (:func:`open_lower`, at the first plan).
    ``cache_dtype``: vLLM's (which fp8 format a ``uint8`` cache holds).

    The caller is the worker's main thread, in ``register_kv_caches``. Allocating the pool
    may take a while (pinned, prefaulted memory). A peer link that cannot start is logged and counted
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
    return path


def open_lower(path: DataPath, cfg: KVTierConfig, make_tiers: Callable[..., dict[str, Any]], *, namespace: str,
               rank: int, counters: Counters) -> None:
    """Open this rank's tiers below CPU on ``path``.

    The call is ``make_tiers(cfg, namespace=, rank=, slots=, counters=, kv_dtype=)``. It
    runs once, at the first plan, only when the scheduler's namespace agrees with the
    worker's. Why not in ``register_kv_caches``? A store's start-up must not run under a
    namespace the scheduler did not compute. For NVMe it takes its directory lock, cleans
    debris, and reports or collects other namespaces' directories. Also, the scheduler's
    start-up scan of the NVMe directories runs after ``register_kv_caches``. A lock taken
    before it would read as another engine's."""
    path.lower = make_tiers(cfg, namespace=namespace, rank=rank, slots=path.slots, counters=counters,
                            kv_dtype=path.layout.dtype)
