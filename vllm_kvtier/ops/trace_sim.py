"""Replay a request trace through the plugin's own index, eviction and admission code.

This is ``kvtier plan --trace``.

Trace format (Mooncake's FAST'25 release, Alibaba's traces, vLLM's ``timed_trace``): JSON
Lines, one request a line. Fields: ``timestamp`` (ms from the start), ``input_length`` and
``output_length`` (tokens), ``hash_ids``. There is one hash id per block of ``block_tokens``
prompt tokens. Equal ids are the same prefix block, i.e. reusable KV. The last block may be
partial.

What a replay does per request, in trace order, one request at a time. This is the model
the figures rest on; docs/planning.md says what it leaves out.

1. **lookup**: the longest run of the request's leading blocks found in an index. A block
   is looked up in the CPU tier's index, else in the first lower tier that holds it. This
   is the scheduler's ``_match``: CPU, then NVMe, then S3.
2. **admission counts**: each lower tier's :class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner`
   hears of the request's blocks (``note_request``, for ``admit_min_seen``).
3. **load**: CPU hits are touched and pinned. Lower-tier hits are promoted into CPU slots.
   An eviction this causes is offered to the lower tiers (write-back demotion). There is
   one read per contiguous run of a chunk's blocks (S3: one ranged GET). A hit that finds
   no slot to read into ends there. The load ends before the request computes (pins
   released).
4. **save**, ``step_blocks`` at a time (vLLM's chunked prefill). Every block not in the
   CPU index gets a slot, and the policy's victim leaves. Each lower tier hears
   ``on_cpu_evict`` / ``on_cpu_save``. The step's own blocks are held against each other. A
   present block is touched. This is :class:`~vllm_kvtier.plan.save_plan.SavePlanner`'s
   loop.
5. **after each step**: each lower tier's ``take_jobs`` runs at the request's timestamp.
   The background flush of write-back reads this clock. It repeats while it returns
   writes. Every chunk written is confirmed at once (writes never fail here).

The classes doing the work are the serving ones: :class:`~vllm_kvtier.index.slot_index.SlotIndex`
with :func:`~vllm_kvtier.index.policy.make_policy` (``lru``, ``s3fifo``, ``arc``, ``kvaware``), and
:class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner` over
:class:`~vllm_kvtier.index.chunk_index.ChunkIndex` (NVMe: ``nvme.eviction`` over chunks; S3:
LRU). Two bounds are computed beside them (:mod:`vllm_kvtier.ops.trace_bounds`). One is an infinite cache.
The other is Belady's MIN: evict the block whose next use is furthest. A block used never
again, or later than every held one, is not stored.

A hit of ``n`` leading blocks covers ``min(n x block_tokens, input_length)`` prompt tokens.
Pure: no vLLM, no torch, no I/O except :func:`read_trace`. The replays read a
:class:`TraceSource` one request at a time. It is a :class:`Trace` in memory, or a file
read at each pass (:mod:`vllm_kvtier.ops.trace_stream`). Then memory is the indexes,
bounded by the capacities. The infinite cache adds each distinct block. Belady's MIN adds
8 bytes a block of the trace.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

from vllm_kvtier.config.files import read_lines
from vllm_kvtier.errors import KVTierError
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import BlockKey, EvictionName
from vllm_kvtier.ops.instance_replay import Instance, block_tokens_in, serve_request
from vllm_kvtier.ops.trace_bounds import CacheResult as CacheResult
from vllm_kvtier.ops.trace_bounds import simulate_belady as simulate_belady
from vllm_kvtier.ops.trace_bounds import simulate_infinite as simulate_infinite
from vllm_kvtier.plan.chunk_plan import ChunkPlanner

#: Trace files larger than this are refused (a 12k-request hour of Mooncake is ~5 MB).
MAX_TRACE_BYTES = 4 << 30
#: One request's line: a 1M-token prompt as ``prompt_token_ids`` is about 8 MB.
MAX_TRACE_LINE_BYTES = 64 << 20
#: Block size of the ids computed from ``prompt_token_ids`` when none is given (Mooncake's).
DEFAULT_TOKEN_BLOCK = 512
#: Block sizes tried when the trace does not say (the smallest that explains every request).
_BLOCK_CANDIDATES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class TraceError(KVTierError, ValueError):
    """A trace that cannot be read: ``where`` names the file and line ("": the message
    names them itself)."""

    def __init__(self, where: str, message: str) -> None:
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class TraceRequest(NamedTuple):
    """One request of a trace: its prompt's block keys, in order."""

    timestamp_ms: int
    input_length: int
    output_length: int
    keys: tuple[BlockKey, ...]


class TraceSource(Protocol):
    """What a replay reads: a :class:`Trace` in memory, or a file read at each pass
    (:class:`~vllm_kvtier.ops.trace_stream.TraceFile`)."""

    @property
    def block_tokens(self) -> int: ...

    @property
    def block_tokens_source(self) -> str: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def duration_s(self) -> float: ...

    def __len__(self) -> int: ...

    def requests(self) -> Iterator[TraceRequest]:
        """The requests in timestamp order, one at a time."""
        ...


@dataclass(frozen=True)
class Trace:
    """A trace in memory. ``keys[i]`` are request ``i``'s block ids as 8-byte keys."""

    block_tokens: int
    timestamps_ms: tuple[int, ...]
    input_lengths: tuple[int, ...]
    output_lengths: tuple[int, ...]
    keys: tuple[tuple[BlockKey, ...], ...]
    #: how the block size was found: "given", "inferred", "default for prompt_token_ids"
    block_tokens_source: str = "given"

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.input_lengths)

    @property
    def duration_s(self) -> float:
        """From the first request to the last (at least 1 s, so rates stay finite)."""
        if not self.timestamps_ms:
            return 1.0
        return max(1.0, (self.timestamps_ms[-1] - self.timestamps_ms[0]) / 1000.0)

    def requests(self) -> Iterator[TraceRequest]:
        return map(self.request, range(len(self.keys)))

    def request(self, i: int) -> TraceRequest:
        """Request ``i``."""
        return TraceRequest(self.timestamps_ms[i], self.input_lengths[i], self.output_lengths[i], self.keys[i])

    def block_tokens_of(self, i: int, j: int) -> int:
        """Prompt tokens of block ``j`` of request ``i`` (the last one may be partial)."""
        return block_tokens_in(self.block_tokens, self.input_lengths[i], j)

    def hit_tokens(self, i: int, n: int) -> int:
        """Prompt tokens covered by a hit of ``n`` leading blocks of request ``i``."""
        return min(n * self.block_tokens, self.input_lengths[i])


def key_of(hash_id: int) -> BlockKey:
    """The index key of a trace's block id (8 bytes, little-endian, two's complement)."""
    return BlockKey(hash_id.to_bytes(8, "little", signed=True))


def hash_ids_from_tokens(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """The trace's ``hash_ids`` of a prompt: one id per ``block_tokens`` tokens.

    The last block may be partial. Each id is a 64-bit BLAKE2b of the previous block's id
    and this block's tokens. So equal ids mean equal prefixes (vLLM's chained block hashes,
    in small)."""
    ids: list[int] = []
    parent = 0
    for lo in range(0, len(tokens), block_tokens):
        h = hashlib.blake2b(parent.to_bytes(8, "little", signed=True), digest_size=8)
        h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[lo : lo + block_tokens]))
        parent = int.from_bytes(h.digest(), "little", signed=True)
        ids.append(parent)
    return ids


def sample_conversations(records: Iterable[dict], fraction: float, seed: int = 0) -> list[dict]:
    """The requests of about ``fraction`` of the conversations, whole.

    A request belongs to the conversation named by its second block id. It uses its first
    when it has only one; the first block is often a prompt every conversation shares. A
    conversation is kept when a 64-bit BLAKE2b of that id and ``seed`` falls in the
    fraction. Sampling requests instead would cut the reuse between a conversation's turns
    that the tiers live on."""
    out = []
    for r in records:
        ids = r["hash_ids"]
        if not ids:
            continue
        group = ids[1] if len(ids) > 1 else ids[0]
        h = hashlib.blake2b(f"{seed}:{group}".encode(), digest_size=8).digest()
        if int.from_bytes(h, "little") < fraction * 2**64:
            out.append(r)
    return out


def trace_records(trace: Trace) -> list[dict]:
    """``trace`` in the file format (hash ids only: no token of any prompt)."""
    return [{"timestamp": ts, "input_length": n, "output_length": o,
             "hash_ids": [int.from_bytes(k, "little", signed=True) for k in keys]}
            for ts, n, o, keys in zip(trace.timestamps_ms, trace.input_lengths, trace.output_lengths, trace.keys,
                                      strict=True)]


def make_trace(records: Iterable[dict], block_tokens: int) -> Trace:
    """A :class:`Trace` from records already checked (``timestamp``, ``input_length``,
    ``output_length``, ``hash_ids``), sorted by timestamp (stable)."""
    rows = sorted(records, key=lambda r: r["timestamp"])
    return Trace(
        block_tokens=block_tokens,
        timestamps_ms=tuple(int(r["timestamp"]) for r in rows),
        input_lengths=tuple(int(r["input_length"]) for r in rows),
        output_lengths=tuple(int(r.get("output_length", 0)) for r in rows),
        keys=tuple(tuple(key_of(h) for h in r["hash_ids"]) for r in rows),
    )


def infer_block_tokens(records: Sequence[dict]) -> int | None:
    """The block size that explains every request (``len(hash_ids) == ceil(input_length /
    B)``), smallest first among powers of two 16..4096; None if none does."""
    for b in _BLOCK_CANDIDATES:
        if all(len(r["hash_ids"]) == -(-r["input_length"] // b) for r in records):
            return b
    return None


def _parse_line(line: str, where: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(where, f"not JSON: {e.msg}") from None
    except RecursionError:  # the C parser's depth guard: ``[[[[...`` thousands deep
        raise TraceError(where, "not a trace record: JSON nested too deeply") from None


def _count(obj: dict, name: str, where: str, default: int | None = None) -> int | float:
    """Field ``name`` of a record: a finite number >= 0 (``default`` when absent; None:
    required). TraceError naming the line and the field otherwise."""
    if name not in obj:
        if default is None:
            raise TraceError(where, f"no {name!r} field")
        return default
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise TraceError(where, f"{name} must be a number >= 0, got {v!r}"[:200])
    return v


def _check_record(obj: object, where: str) -> dict:
    """A record with every field checked, holding only the fields a replay reads (an
    unknown field is ignored and not kept). TraceError naming the line and the field."""
    if not isinstance(obj, dict):
        raise TraceError(where, f"not a JSON object but {type(obj).__name__}")
    out: dict = {"timestamp": _count(obj, "timestamp", where)}
    if "hash_ids" in obj:
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise TraceError(where, "hash_ids must be a list of integers")
        if any(not -(1 << 63) <= h < 1 << 63 for h in ids):
            raise TraceError(where, "hash_ids must fit in 64 bits")
        out["hash_ids"] = ids
        out["input_length"] = _count(obj, "input_length", where)
    elif "prompt_token_ids" in obj:
        toks = obj["prompt_token_ids"]
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                 and 0 <= t < 1 << 31 for t in toks):
            raise TraceError(where, "prompt_token_ids must be a list of token ids")
        out["prompt_token_ids"] = toks
        n = _count(obj, "input_length", where, default=len(toks))
        if n != len(toks):
            raise TraceError(where, f"input_length {n} differs from the {len(toks)} prompt_token_ids")
        out["input_length"] = len(toks)
    else:
        _count(obj, "input_length", where)
        raise TraceError(where, "no 'hash_ids' field (nor 'prompt_token_ids')")
    out["output_length"] = _count(obj, "output_length", where, default=0)
    return out


def read_trace(path: str | Path, block_tokens: int | None = None) -> Trace:
    """Read a JSONL trace; ``block_tokens`` None: inferred (:func:`infer_block_tokens`).

    Raises :class:`TraceError` naming the file and line of the first bad record, or the
    file when it cannot be read, is empty, or no block size explains it."""
    p = Path(path)
    records = []
    try:
        for n, line in read_lines(p, MAX_TRACE_BYTES, MAX_TRACE_LINE_BYTES):
            if line.strip():
                records.append(_check_record(_parse_line(line, f"{p}:{n}"), f"{p}:{n}"))
    except ValueError as e:
        if isinstance(e, TraceError):
            raise
        raise TraceError("", str(e)) from None
    if not records:
        raise TraceError(str(p), "no request in it")
    if block_tokens is not None and block_tokens <= 0:
        raise TraceError(str(p), f"block size must be > 0, got {block_tokens}")
    source = "given"
    if block_tokens is None and any("hash_ids" not in r for r in records):
        block_tokens, source = DEFAULT_TOKEN_BLOCK, "default for prompt_token_ids"
    if block_tokens is not None:
        for r in records:
            if "hash_ids" not in r:
                r["hash_ids"] = hash_ids_from_tokens(r.pop("prompt_token_ids"), block_tokens)
    if block_tokens is None:
        block_tokens, source = infer_block_tokens(records), "inferred"
        if block_tokens is None:
            raise TraceError(str(p), "no block size in 16..4096 gives every request ceil(input_length / B) "
                                     "hash_ids: give the trace's block size")
    return dataclasses.replace(make_trace(records, block_tokens), block_tokens_source=source)


# ---- single caches: the reference figures (the bounds: ops/trace_bounds.py) ----------


def simulate_policy(trace: TraceSource, capacity_blocks: int, eviction: str, step_blocks: int | None = None) -> CacheResult:
    """One CPU-like tier of ``capacity_blocks`` slots under ``eviction`` (``lru``,
    ``s3fifo``): the hierarchy of :func:`simulate_tiers` with no tier below."""
    r = simulate_tiers(trace, TierSetup(cpu_blocks=capacity_blocks, cpu_eviction=eviction, step_blocks=step_blocks))
    return CacheResult(eviction, capacity_blocks, r.tiers[0].hit_tokens, r.prompt_tokens, r.tiers[0].hit_blocks)


# ---- the plugin's tiers -----------------------------------------------------------------


@dataclass(frozen=True)
class LowerTier:
    """A tier below CPU as the plugin's config has it, in trace blocks.

    ``chunk_blocks``: trace blocks per chunk (at least 1). ``objects_per_chunk``: how many
    of the plugin's chunks (files, objects) one such chunk stands for. It matters when a
    trace block is longer than a chunk of the engine's blocks (Mooncake: 512 tokens = two
    chunks of 16 x 16). ``block_bytes``: bytes of one trace block (0 when the model is not
    known)."""

    name: str
    capacity_blocks: int | None
    mode: Literal["write-back", "write-through"]
    admit_min_seen: int
    chunk_blocks: int
    flush_interval_s: float = 0.0
    objects_per_chunk: int = 1
    block_bytes: int = 0
    #: which chunk leaves the full tier (``nvme.eviction``; the other tiers: LRU)
    eviction: EvictionName = "lru"


@dataclass(frozen=True)
class TierSetup:
    """The tiers to replay: a CPU pool of ``cpu_blocks`` slots and the tiers below, fastest
    first."""

    cpu_blocks: int
    cpu_eviction: str = "kvaware"
    lower: tuple[LowerTier, ...] = ()
    #: blocks a request saves per engine step (vLLM's chunked prefill: max_num_batched_tokens
    #: / block tokens); None: the whole prompt in one step
    step_blocks: int | None = None
    #: store a prompt's partial last block: True when a trace block spans several engine
    #: blocks (their full ones are stored); False at the engine's own block size, where the
    #: plugin stores full blocks only
    save_partial_blocks: bool = True
    #: a chunk written while serving request i becomes loadable for request i + 1 + this
    #: (0: at once, as under live traffic where the next turn comes seconds later; requests
    #: sent back to back find the last one's writes still in flight)
    confirm_lag_requests: int = 0
    #: bytes of one trace block (0: not known; the byte figures are then 0)
    block_bytes: int = 0


@dataclass
class TierResult:
    """What one tier did over the trace."""

    name: str
    capacity_blocks: int | None
    hit_tokens: int = 0
    hit_blocks: int = 0
    #: lower tiers: chunks written (the plugin's files or objects: PUTs on S3) and their bytes
    write_ops: int = 0
    written_blocks: int = 0
    written_bytes: int = 0
    #: lower tiers: reads (one per contiguous run of a chunk's blocks: ranged GETs on S3)
    read_ops: int = 0
    evicted_blocks: int = 0


@dataclass
class TiersResult:
    setup: TierSetup
    requests: int
    prompt_tokens: int
    duration_s: float
    tiers: list[TierResult] = field(default_factory=list)

    @property
    def hit_tokens(self) -> int:
        return sum(t.hit_tokens for t in self.tiers)

    def share(self, tier: TierResult) -> float:
        return tier.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_to_compute(self) -> int:
        return self.prompt_tokens - self.hit_tokens


def simulate_tiers(trace: TraceSource, setup: TierSetup) -> TiersResult:
    """Replay ``trace`` through the CPU tier and the tiers below (module doc): one
    :class:`~vllm_kvtier.ops.instance_replay.Instance`, the fleet replay's with one instance
    and no shared tier. One request at a time: memory is the tiers' indexes, whatever
    the trace's length."""
    inst = Instance(setup)
    cpu = TierResult("cpu", setup.cpu_blocks)
    lows = [TierResult(t.name, t.capacity_blocks) for t in setup.lower]
    result = TiersResult(setup, len(trace), trace.prompt_tokens, trace.duration_s, [cpu, *lows])
    t0: int | None = None
    bt = trace.block_tokens
    # (request index from which they are loadable, planner, report) of writes in flight
    inflight: list[tuple[int, ChunkPlanner, WorkerReport]] = []
    for i, rq in enumerate(trace.requests()):
        t0 = rq.timestamp_ms if t0 is None else t0
        inst.clock[0] = (rq.timestamp_ms - t0) / 1000.0
        while inflight and inflight[0][0] <= i:
            _, p, report = inflight.pop(0)
            p.on_worker_meta(report)
        confirm = None
        if setup.confirm_lag_requests:
            due = i + 1 + setup.confirm_lag_requests

            def confirm(p: ChunkPlanner, report: WorkerReport, due: int = due) -> None:
                inflight.append((due, p, report))

        serve_request(inst, rq, bt, result.tiers, confirm=confirm)
    cpu.evicted_blocks = inst.index.evictions
    for j, p in enumerate(inst.planners):
        lows[j].evicted_blocks = p.index.evicted_blocks
    return result
