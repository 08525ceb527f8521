"""Which blocks a chunk tier takes: the admission count and the write breaker.

Who calls it: :class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner`, from vLLM's scheduler
thread. Pure bookkeeping: no I/O, nothing blocks.

* **Admission**: a block is written only once it appeared in at least ``admit_min_seen``
  requests' prompts, counted in a bounded table (the oldest key is forgotten first).
* **Breaker**: after :data:`BREAKER_FAILURES` write failures in a row the tier takes no
  write for :data:`BREAKER_PAUSE_S`; a write that lands resets the count.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

from vllm_kvtier.keys import BlockKey, TierName

logger = logging.getLogger(__name__)

#: Keys whose request count is remembered (~30 MB at most).
SEEN_TABLE_SIZE = 1 << 18
#: Circuit breaker on writes: after this many write failures in a row, stop for a while.
BREAKER_FAILURES = 8
BREAKER_PAUSE_S = 30.0


class Admission:
    """The request counts of block keys, and the breaker of one tier's writes."""

    def __init__(self, tier: TierName, admit_min_seen: int) -> None:
        self.tier = tier
        self.admit_min_seen = admit_min_seen
        self._seen: OrderedDict[BlockKey, int] = OrderedDict()
        self._failures_in_a_row = 0
        self._paused_until = 0.0

    def note_request(self, keys: Sequence[bytes]) -> None:
        """Count one more request whose prompt holds ``keys``."""
        seen = self._seen
        for k in keys:
            key = BlockKey(k)
            seen[key] = seen.get(key, 0) + 1
            seen.move_to_end(key)
        while len(seen) > SEEN_TABLE_SIZE:
            seen.popitem(last=False)

    def reused(self, keys: Sequence[BlockKey]) -> bool:
        """Whether one of ``keys`` appeared in two requests' prompts or more."""
        return any(self._seen.get(k, 0) >= 2 for k in keys)

    def seen_enough(self, key: BlockKey) -> bool:
        """Whether ``key`` appeared in at least ``admit_min_seen`` requests."""
        return self._seen.get(key, 0) >= self.admit_min_seen

    def paused(self) -> bool:
        """Whether the breaker is open: the tier kept failing writes."""
        return bool(self._paused_until) and time.monotonic() < self._paused_until

    def on_writes(self, failed: int, written: int) -> None:
        """A step's write results: ``failed`` writes failed, ``written`` landed."""
        if failed:
            self._failures_in_a_row += failed
            if self._failures_in_a_row >= BREAKER_FAILURES:
                logger.warning("kvtier %s: %d writes failed in a row; pausing writes for %.0f s",
                               self.tier, self._failures_in_a_row, BREAKER_PAUSE_S)
                self._paused_until = time.monotonic() + BREAKER_PAUSE_S
                self._failures_in_a_row = 0
        elif written:
            self._failures_in_a_row = 0
