"""The plain values the scheduler half and the worker half exchange each step.

:class:`StepPlan` goes from the scheduler to every worker (inside vLLM's
``SchedulerOutput``). :class:`WorkerReport` comes back from each worker. It is merged over
TP ranks by :meth:`WorkerReport.aggregate`. The jobs inside them are frozen dataclasses
of ints, strings and bytes. They are cheap to pickle to every worker process. They never
hold a sentinel. A block that cannot be loaded is named in :attr:`LoadJob.unloadable`,
not given slot -1. A tier is a :class:`~vllm_kvtier.keys.TierName` (a ``StrEnum``: it
equals its string).

This module imports only :mod:`vllm_kvtier.keys` (the bottom), and no vLLM or torch. The
planners (``plan/``) build these values, and the worker side reads them without either.
The connector's thin vLLM subclasses (``connector/metadata.py``) add only vLLM's base
classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from vllm_kvtier.keys import TierName


@dataclass(frozen=True)
class SaveJob:
    """Copy ``block_ids[i]`` of the engine's KV cache into CPU ``slots[i]`` (key ``keys[i]``)."""

    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class ChunkRead:
    """Fill CPU ``slots[i]`` from block ``positions[i]`` of chunk ``chunk_id`` of ``tier``
    ("nvme": a file, "s3": an object); ``keys[i]`` is the key expected there."""

    tier: TierName
    chunk_id: str
    positions: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class PeerRead:
    """P/D peer to peer: fill CPU ``slots[i]`` with block ``keys[i]`` read over NIXL from
    slot ``remote_slots[i]`` of a prefill instance's CPU tier. ``peer``: that instance's
    published description per TP rank (``kv_transfer_params``, JSON-safe)."""

    req_id: str
    peer: dict
    remote_slots: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]
    #: the prefill instance's id of the request, sent back with the read so it frees the
    #: blocks (each API server names a request its own way)
    notify: str = ""


@dataclass(frozen=True)
class LoadJob:
    """Copy CPU ``slots[i]`` (holding ``keys[i]``) into engine ``block_ids[i]``.

    ``asynchronous`` jobs are reported through ``finished_recving``. Sync jobs complete
    before the forward.

    ``reads`` first fill some of the slots from a lower tier (NVMe, S3). That is a
    promotion: the block stays in the CPU tier afterwards. ``peer_read`` fills some over
    NIXL. ``unloadable``: engine blocks of this load that got no CPU slot. None was free
    for their promotion. The worker reports them failed, and vLLM recomputes them. A job
    with any is asynchronous (failures are reported with ``finished_recving``).
    """

    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]
    asynchronous: bool
    reads: tuple[ChunkRead, ...] = ()
    #: P/D peer to peer: slots filled over NIXL from a prefill instance first.
    peer_read: PeerRead | None = None
    unloadable: tuple[int, ...] = ()


@dataclass(frozen=True)
class ChunkWriteJob:
    """Write CPU ``slots[i]`` (holding ``keys[i]``) to ``tier`` as one chunk."""

    tier: TierName
    chunk_id: str
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class PrefetchJob:
    """Fill CPU slots from lower tiers ahead of a request (no engine block involved).

    A prefix predicted to come back is promoted before it is asked for."""

    prefetch_id: int
    reads: tuple[ChunkRead, ...]


@dataclass(frozen=True)
class VerifyJob:
    """Shadow verification of one sampled hit (``verify.sample_rate``).

    The request recomputed blocks ``block_ids[i]`` (vLLM was told 0 external tokens). CPU
    ``slots[i]`` hold the stored block ``keys[i]`` of tier ``tiers[i]``, or ``reads`` fill
    them with it. After this step's forward, the worker compares each slot with its
    freshly computed engine block. It reports the outcome per key."""

    verify_id: int
    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]
    tiers: tuple[TierName, ...]
    reads: tuple[ChunkRead, ...] = ()


_P = TypeVar("_P", bound="StepPlan")
_R = TypeVar("_R", bound="WorkerReport")


@dataclass
class StepPlan:
    """What the scheduler decided for one step, in the order the worker runs it."""

    #: Slots of the CPU pool the scheduler plans for: never more than the worker's pool
    #: (sized in ``register_kv_caches``); the worker checks it.
    num_slots: int
    #: Saves run before the forward: the last blocks of finished requests. vLLM holds
    #: those blocks until the worker reports the saves done (``finished_sending``).
    saves: list[SaveJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    #: Saves run after the forward (in wait_for_save): blocks completed by this very step,
    #: so they are stored even if the engine never steps again (offline LLM, shutdown).
    saves_after: list[SaveJob] = field(default_factory=list)
    #: Finished requests whose blocks vLLM has freed after saves out of them were issued.
    #: Those saves were fenced when their step ended; the worker orders them before this
    #: step's forward again (as for ``preempted``).
    freed: list[str] = field(default_factory=list)
    #: Lower-tier writes of blocks evicted from the CPU tier: done before this step's
    #: saves overwrite their slots.
    demotes: list[ChunkWriteJob] = field(default_factory=list)
    #: Lower-tier writes of blocks saved in this step (write-through): after the saves.
    write_through: list[ChunkWriteJob] = field(default_factory=list)
    #: (tier, chunk id) evicted from a lower tier: delete them.
    deletes: list[tuple[TierName, str]] = field(default_factory=list)
    #: (tier, chunk id) a rescan no longer lists (gone out of band): forget them (a
    #: writer's manifest drops them; nothing is sent to the tier).
    forgets: list[tuple[TierName, str]] = field(default_factory=list)
    #: tier -> slots whose block may be flushed to it at shutdown (write-back, admitted).
    persist_slots: dict[TierName, list[int]] = field(default_factory=dict)
    #: Requests preempted this step: their blocks may be rewritten by this step's forward,
    #: so saves still in flight from them must finish first.
    preempted: list[str] = field(default_factory=list)
    #: Promotions ahead of requests (prefetch), read by the workers' I/O threads.
    prefetches: list[PrefetchJob] = field(default_factory=list)
    #: Step counter, to run each step's saves exactly once.
    step: int = 0
    #: Shadow verification: compare stored blocks with this step's computed ones.
    verifies: list[VerifyJob] = field(default_factory=list)
    #: The namespace the scheduler computed (``""``: none sent): a worker that computed
    #: another refuses every lower-tier read and write (``WorkerHalf.begin_step``).
    namespace: str = ""

    @classmethod
    def from_plan(cls: type[_P], plan: StepPlan) -> _P:
        """The same plan as an instance of ``cls`` (a subclass adding a base class)."""
        return cls(**_fields_of(plan))


@dataclass
class WorkerReport:
    """What a worker tells the scheduler after a step (merged over TP ranks)."""

    #: (tier, chunk id) -> number of ranks that wrote it durably.
    written: dict[tuple[TierName, str], int] = field(default_factory=dict)
    #: (tier, chunk id) whose write failed on some rank.
    failed: set[tuple[TierName, str]] = field(default_factory=set)
    #: (tier, chunk id) found unreadable (missing, truncated, bad checksum) on some rank.
    bad: set[tuple[TierName, str]] = field(default_factory=set)
    #: prefetch id -> number of ranks whose prefetch reads all succeeded.
    prefetched: dict[int, int] = field(default_factory=dict)
    #: Prefetches that failed on some rank.
    prefetch_failed: set[int] = field(default_factory=set)
    #: P/D prefill side: rank -> how a decode instance reads this rank's CPU tier (NIXL).
    peer_info: dict[int, dict] = field(default_factory=dict)
    #: P/D prefill side: requests whose blocks a decode instance has read (release them).
    peer_done: set[str] = field(default_factory=set)
    #: (tier, chunk id) not written because the tier's write queue was full on some rank
    #: (back-pressure: not a failure of the tier, so it does not count toward its breaker).
    refused: set[tuple[TierName, str]] = field(default_factory=set)
    #: Shadow verification: verify id -> number of ranks that finished it.
    verified: dict[int, int] = field(default_factory=dict)
    #: (verify id, key) whose stored block differed from the computed one on some rank.
    verify_mismatched: set[tuple[int, bytes]] = field(default_factory=set)
    #: (verify id, key) whose stored block could not be read on some rank (not compared).
    verify_unread: set[tuple[int, bytes]] = field(default_factory=set)
    #: (verify id, key) within the tolerance but not bitwise equal on some rank.
    verify_inexact: set[tuple[int, bytes]] = field(default_factory=set)
    #: (tier, chunk id) refused on some rank as ``unauthenticated`` (unsigned, or signed with
    #: a key not accepted, e.g. after a key rotation): forgotten so it can be written again,
    #: not deleted (on a shared tier it may be another fleet's good data).
    untrusted: set[tuple[TierName, str]] = field(default_factory=set)
    #: request -> how long its async load's slowest lower-tier read took, from issue to
    #: done on the tier's threads (the slowest rank's): the tier's time, no engine step in it.
    load_read_seconds: dict[str, float] = field(default_factory=dict)

    def aggregate(self: _R, other: Any) -> _R:
        """This report merged with another rank's (counts summed, sets united); of the
        same class as ``self``."""
        assert isinstance(other, WorkerReport)
        written = dict(self.written)
        for k, v in other.written.items():
            written[k] = written.get(k, 0) + v
        prefetched = dict(self.prefetched)
        for i, n in other.prefetched.items():
            prefetched[i] = prefetched.get(i, 0) + n
        verified = dict(self.verified)
        for i, n in other.verified.items():
            verified[i] = verified.get(i, 0) + n
        read_s = dict(self.load_read_seconds)
        for r, s in other.load_read_seconds.items():
            read_s[r] = max(read_s.get(r, 0.0), s)
        return type(self)(written, self.failed | other.failed, self.bad | other.bad, prefetched,
                          self.prefetch_failed | other.prefetch_failed, {**self.peer_info, **other.peer_info},
                          self.peer_done | other.peer_done, self.refused | other.refused, verified,
                          self.verify_mismatched | other.verify_mismatched,
                          self.verify_unread | other.verify_unread, self.verify_inexact | other.verify_inexact,
                          self.untrusted | other.untrusted, read_s)

    def is_empty(self) -> bool:
        return not (self.written or self.failed or self.bad or self.prefetched or self.prefetch_failed
                    or self.peer_info or self.peer_done or self.refused or self.verified or self.untrusted
                    or self.load_read_seconds)

    @classmethod
    def from_report(cls: type[_R], report: WorkerReport) -> _R:
        """The same report as an instance of ``cls`` (a subclass adding a base class)."""
        return cls(**_fields_of(report))


def _fields_of(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}
