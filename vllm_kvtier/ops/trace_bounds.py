"""The reference figures of a trace replay: an infinite cache and Belady's MIN.

Who calls it: :mod:`vllm_kvtier.ops.trace_sim` and ``kvtier plan --trace``. They bound
what any policy of the plugin's serves (:func:`~vllm_kvtier.ops.trace_sim.simulate_tiers`).
Hits are prefix hits: a block counts only if every block before it hits too. Pure: no
I/O. The infinite cache holds each distinct block. Belady's MIN adds 8 bytes a block of
the trace.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_kvtier.keys import BlockKey

if TYPE_CHECKING:
    from vllm_kvtier.ops.trace_sim import TraceSource


@dataclass(frozen=True)
class CacheResult:
    """Hits of one cache over a trace."""

    name: str
    capacity_blocks: int | None
    hit_tokens: int
    prompt_tokens: int
    hit_blocks: int

    @property
    def hit_share(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _prefix_hits(keys: Sequence[BlockKey], cached: Container[BlockKey]) -> int:
    """How many of ``keys``, from the first, are in ``cached`` (a prefix hit stops at the
    first miss)."""
    n = 0
    for k in keys:
        if k not in cached:
            break
        n += 1
    return n


def simulate_infinite(trace: TraceSource) -> CacheResult:
    """A cache that never evicts: the share of prompt tokens that any cache could serve."""
    seen: set[BlockKey] = set()
    hit_tokens = hit_blocks = 0
    for rq in trace.requests():
        n = _prefix_hits(rq.keys, seen)
        hit_tokens += min(n * trace.block_tokens, rq.input_length)
        hit_blocks += n
        seen.update(rq.keys)
    return CacheResult("infinite", None, hit_tokens, trace.prompt_tokens, hit_blocks)


def simulate_belady(trace: TraceSource, capacity_blocks: int) -> CacheResult:
    """Belady's MIN at ``capacity_blocks``: on a miss with the cache full, the block whose
    next use is furthest leaves, or the incoming block is not stored when its own next use
    is further still (or never). Hits are prefix hits, as for the other caches.

    Two passes: the first finds each access's next use (8 bytes an access, and the last
    use of each distinct block), the second replays."""
    never = 1 << 62
    # next use of each access, in the flattened order of the trace's blocks
    nxt = array("q")
    last: dict[BlockKey, int] = {}
    pos = 0
    for rq in trace.requests():
        for k in rq.keys:
            nxt.append(never)
            prev = last.get(k)
            if prev is not None:
                nxt[prev] = pos
            last[k] = pos
            pos += 1
    del last
    held: dict[BlockKey, int] = {}  # key -> its next use
    heap: list[tuple[int, BlockKey]] = []  # (-next use, key); stale entries skipped
    hit_tokens = hit_blocks = 0
    pos = 0
    for rq in trace.requests():
        n = _prefix_hits(rq.keys, held)
        hit_tokens += min(n * trace.block_tokens, rq.input_length)
        hit_blocks += n
        for k in rq.keys:
            nu = nxt[pos]
            pos += 1
            if k in held:
                held[k] = nu
                heapq.heappush(heap, (-nu, k))
                continue
            if nu == never or capacity_blocks <= 0:
                continue
            if len(held) >= capacity_blocks:
                while True:
                    top, victim = heap[0]
                    if held.get(victim) == -top:
                        break
                    heapq.heappop(heap)
                if -top <= nu:
                    continue  # everything held is used sooner than this one
                heapq.heappop(heap)
                del held[victim]
            held[k] = nu
            heapq.heappush(heap, (-nu, k))
            if len(heap) > 4 * capacity_blocks + 1024:  # drop stale entries now and then
                heap = [(-v, k2) for k2, v in held.items()]
                heapq.heapify(heap)
    return CacheResult("belady", capacity_blocks, hit_tokens, trace.prompt_tokens, hit_blocks)
