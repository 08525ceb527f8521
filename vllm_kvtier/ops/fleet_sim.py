"""Replay a request trace through a fleet of instances (``kvtier plan --trace --instances N``).

Each instance has its own CPU tier and local tiers below it (NVMe): an
:class:`~vllm_kvtier.ops.instance_replay.Instance`, the single-instance replay's. All
instances share one tier (S3 or the Mooncake pool): :class:`SharedTier`. A router
(:mod:`vllm_kvtier.ops.routers`) picks the instance of each request, in trace order.

Per request the instance runs :func:`~vllm_kvtier.ops.instance_replay.serve_request`. That
is the code :func:`~vllm_kvtier.ops.trace_sim.simulate_tiers` runs (its module doc says
what it does). The shared tier comes last in the lookup. What the shared tier models:

* **writes**: each instance decides its own writes with its own planner for the shared
  tier (mode, admission counts, chunking), as the engine does. A written chunk goes into
  the bucket at the request's time.
* **listing**: the writer finds its own chunk at once. Another instance finds it after its
  next rescan of the bucket. S3 instances rescan every ``rescan_interval_s`` seconds, all
  on one clock. A chunk written at ``t`` is listed at the next multiple of the interval. A
  Mooncake pool answers lookups from the master: visible to every instance at once.
* **reads**: a hit on another instance's chunk is a cross-instance hit (the figure a
  shared tier exists for). A block visible in the bucket is not written again.
* **capacity**: one LRU over the bucket's chunks (a lifecycle rule, the pool's eviction),
  in the same chunk bytes as the single-instance replay.

Memory: each instance's indexes (bounded by its capacities), the bucket's index (one entry
per block it holds), and the router's state (one entry per conversation for ``session``).
Nothing grows with N x the trace. Pure: no I/O.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.ops.instance_replay import Instance, serve_request
from vllm_kvtier.ops.routers import Router, RouterView
from vllm_kvtier.ops.trace_sim import LowerTier, TierResult, TierSetup, Trace
from vllm_kvtier.plan.chunk_plan import ChunkPlanner

SharedKind = Literal["s3", "mooncake"]


@dataclass(frozen=True)
class FleetSetup:
    """``instances`` replicas of ``setup``'s CPU and local tiers, and ``shared`` (None: no
    shared tier) seen by all. ``setup.lower`` holds the local tiers only."""

    instances: int
    setup: TierSetup
    shared: LowerTier | None = None
    shared_kind: SharedKind = "s3"
    #: S3: seconds between two listings of the bucket (0: other instances never see a chunk)
    rescan_interval_s: float = 60.0
    #: seconds of prefill per prompt token computed, and of decode per output token: how
    #: long a request stays in flight (the routers' load and the imbalance figures)
    prefill_s_per_token: float = 1e-4
    decode_s_per_token: float = 0.02


@dataclass
class FleetResult:
    """Token hits of a fleet over a trace, and its load."""

    router: str
    instances: int
    requests: int
    prompt_tokens: int
    duration_s: float
    #: hit tokens per tier: "cpu", each local tier's name, "shared" (all shared-tier hits)
    hit_tokens: dict[str, int] = field(default_factory=dict)
    #: shared-tier hits on chunks another instance wrote
    cross_hit_tokens: int = 0
    shared_write_ops: int = 0
    shared_read_ops: int = 0
    #: requests routed to each instance, and prompt tokens each computed (not hit)
    requests_per_instance: list[int] = field(default_factory=list)
    computed_per_instance: list[int] = field(default_factory=list)
    #: most requests in flight on one instance at once
    peak_in_flight: int = 0
    #: each tier's figures over the fleet: "cpu", each local tier, "shared" (when there is one)
    tiers: list[TierResult] = field(default_factory=list)

    def share(self, tier: str) -> float:
        return self.hit_tokens.get(tier, 0) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def total_share(self) -> float:
        return sum(self.hit_tokens.values()) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def cross_share(self) -> float:
        return self.cross_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_imbalance(self) -> float:
        """Busiest instance's requests over the mean (1.0: even)."""
        n = self.requests_per_instance
        return max(n) * len(n) / sum(n) if n and sum(n) else 1.0

    @property
    def compute_imbalance(self) -> float:
        """Busiest instance's prompt tokens computed over the mean (1.0: even)."""
        n = self.computed_per_instance
        return max(n) * len(n) / sum(n) if n and sum(n) else 1.0


@dataclass
class _Chunk:
    keys: tuple[BlockKey, ...]
    nbytes: int
    writer: int
    listed_at: float


class SharedTier:
    """The bucket (or pool) every instance reads: its chunks, who wrote each, and when the
    others can find it. Called from the replay loop only."""

    def __init__(self, capacity_bytes: int | None, kind: SharedKind, rescan_interval_s: float) -> None:
        self.capacity_bytes = capacity_bytes
        self.kind = kind
        self.rescan_interval_s = rescan_interval_s
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()  # LRU first
        self._where: dict[BlockKey, tuple[str, int]] = {}
        self.used_bytes = 0
        #: writers' planners, told when the bucket drops one of their chunks
        self.writers: list[ChunkPlanner] = []

    def listed_at(self, written_at: float) -> float:
        """When instances other than the writer find a chunk written at ``written_at``."""
        if self.kind == "mooncake":
            return written_at
        if self.rescan_interval_s <= 0:
            return float("inf")
        return (written_at // self.rescan_interval_s + 1) * self.rescan_interval_s

    def put(self, fid: str, keys: Sequence[BlockKey], nbytes: int, writer: int, now: float) -> None:
        """``writer`` wrote chunk ``fid`` at ``now`` (a rewrite of a chunk keeps its first listing)."""
        old = self._chunks.get(fid)
        if old is not None:
            self._chunks.move_to_end(fid)
            return
        self._chunks[fid] = _Chunk(tuple(keys), nbytes, writer, self.listed_at(now))
        self.used_bytes += nbytes
        for pos, k in enumerate(keys):
            self._where.setdefault(k, (fid, pos))
        while self.capacity_bytes is not None and self.used_bytes > self.capacity_bytes and self._chunks:
            self._drop(next(iter(self._chunks)))

    def _drop(self, fid: str) -> None:
        c = self._chunks.pop(fid)
        self.used_bytes -= c.nbytes
        for pos, k in enumerate(c.keys):
            if self._where.get(k) == (fid, pos):
                del self._where[k]
        if self.writers:
            self.writers[c.writer].index.remove(fid)

    def locate(self, key: BlockKey, reader: int, now: float) -> tuple[str, int] | None:
        """(chunk, position) of ``key`` if ``reader`` can find it at ``now``."""
        loc = self._where.get(key)
        if loc is None:
            return None
        c = self._chunks[loc[0]]
        return loc if c.writer == reader or c.listed_at <= now else None

    def publish(self, p: ChunkPlanner, report: WorkerReport, writer: int, now: float) -> None:
        """``writer``'s planner ``p`` confirmed the chunks of ``report`` at ``now``."""
        for _tier, fid in report.written:
            keys = p.index.loadable_keys(fid)
            if keys:
                self.put(fid, keys, p.file_bytes(len(keys)), writer, now)

    def writer_of(self, fid: str) -> int:
        return self._chunks[fid].writer

    def touch(self, fid: str) -> None:
        if fid in self._chunks:
            self._chunks.move_to_end(fid)

    def __len__(self) -> int:
        return len(self._where)


def make_instance(setup: TierSetup, shared: LowerTier | None = None, clock: list[float] | None = None) -> Instance:
    """One instance's tiers (the factory the fleet replay uses; ``clock``: a one-item list
    of seconds that the write-back flush reads)."""
    return Instance(setup, shared, clock)


def simulate_fleet(trace: Trace, fleet: FleetSetup, router: Router) -> FleetResult:
    """Replay ``trace`` through ``fleet``, each request on the instance ``router`` picks."""
    n = fleet.instances
    if n < 1:
        raise ValueError(f"instances must be >= 1, got {n}")
    clock = [0.0]
    insts = [make_instance(fleet.setup, fleet.shared, clock) for _ in range(n)]
    shared = None
    if fleet.shared is not None:
        cap = None
        if fleet.shared.capacity_blocks is not None:
            full = insts[0].planners[-1].file_bytes(fleet.shared.chunk_blocks)
            cap = -(-fleet.shared.capacity_blocks // fleet.shared.chunk_blocks) * full
        shared = SharedTier(cap, fleet.shared_kind, fleet.rescan_interval_s)
        shared.writers = [inst.planners[-1] for inst in insts]
    names = ["cpu", *(t.name for t in fleet.setup.lower), *(["shared"] if shared is not None else [])]
    caps = [fleet.setup.cpu_blocks, *(t.capacity_blocks for t in fleet.setup.lower),
            *([fleet.shared.capacity_blocks] if fleet.shared is not None else [])]
    res = FleetResult(router.name, n, len(trace), trace.prompt_tokens, trace.duration_s,
                      requests_per_instance=[0] * n, computed_per_instance=[0] * n,
                      tiers=[TierResult(name, cap) for name, cap in zip(names, caps, strict=True)])
    view = RouterView(insts, [0] * n, res.requests_per_instance)
    finishing: list[tuple[float, int]] = []  # (finish time, instance) of requests in flight
    t0 = trace.timestamps_ms[0] if trace.timestamps_ms else 0
    for i in range(len(trace)):
        now = (trace.timestamps_ms[i] - t0) / 1000.0
        clock[0] = now
        while finishing and finishing[0][0] <= now:
            _, j = heapq.heappop(finishing)
            view.in_flight[j] -= 1
        me = router.route(i, trace.keys[i], view)
        if not 0 <= me < n:
            raise ValueError(f"router {router.name} picked instance {me} of {n}")
        hits, cross = serve_request(insts[me], trace.request(i), trace.block_tokens, res.tiers,
                                    bucket=shared, me=me, now=now)
        res.cross_hit_tokens += cross
        computed = trace.input_lengths[i] - hits
        res.requests_per_instance[me] += 1
        res.computed_per_instance[me] += computed
        busy = computed * fleet.prefill_s_per_token + trace.output_lengths[i] * fleet.decode_s_per_token
        view.in_flight[me] += 1
        res.peak_in_flight = max(res.peak_in_flight, view.in_flight[me])
        heapq.heappush(finishing, (now + busy, me))
    res.hit_tokens = {t.name: t.hit_tokens for t in res.tiers}
    res.hit_tokens.setdefault("shared", 0)
    if shared is not None:
        res.shared_write_ops, res.shared_read_ops = res.tiers[-1].write_ops, res.tiers[-1].read_ops
    return res
