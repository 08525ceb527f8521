"""What the scheduler-side planner of a chunk tier is told: the tier's policy
(:class:`ChunkPolicy`, from its config section) and what every planner of one scheduler
shares (:class:`PlannerContext`).

Who builds them: the connector (:mod:`vllm_kvtier.engine.lower`) and the ``kvtier``
simulators, once per tier. Who reads them:
:class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner`. Frozen records.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from vllm_kvtier.keys import EvictionName, TierName
from vllm_kvtier.metrics import Counters


@dataclass(frozen=True)
class ChunkPolicy:
    """What the planner needs to know of a tier's configuration."""

    tier: TierName
    #: "read-only": this instance never writes the tier (a P/D decode instance's pool).
    mode: Literal["write-back", "write-through", "read-only"]
    admit_min_seen: int
    chunk_blocks: int
    #: For the whole engine (all ranks); None: unbounded (e.g. a bucket with a lifecycle rule).
    capacity_bytes: int | None
    #: Chunks of one block named by the block's key (hex), so another instance finds a
    #: prefix from its own block hashes without a listing (a key-value pool).
    key_named: bool = False
    #: Write-back: flush a block still only in DRAM once it is this old (seconds), and
    #: every such block when the engine is idle. 0: only on eviction and at shutdown.
    flush_interval_s: float = 0.0
    #: No other engine writes this tier's chunks (an NVMe rank directory, locked by its
    #: owner): at start, chunks on only some ranks and misfits are this engine's debris and
    #: are deleted. False for shared tiers (another instance may still be writing them).
    exclusive: bool = False
    #: Which chunk leaves a full tier (a :func:`~vllm_kvtier.index.policy.make_policy`
    #: name): the NVMe section's ``eviction``; LRU for a tier whose section has none.
    eviction: EvictionName = "lru"


@dataclass(frozen=True)
class PlannerContext:
    """What every planner of one scheduler shares."""

    #: Shards stored of each block, named ``r0`` .. ``r<world_size - 1>``.
    world_size: int
    block_bytes_per_rank: int
    counters: Counters
    #: The background flush's ages (a test passes its own).
    clock: Callable[[], float] = time.monotonic
