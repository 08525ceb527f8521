"""What a chunk tier's lookups skip for a while: chunks whose read just failed, and ids a
pool answered a moment ago.

Who calls it: :class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner`, from vLLM's scheduler
thread. Pure bookkeeping: no I/O, nothing blocks.
"""

from __future__ import annotations

import time

#: A chunk whose read just failed is not offered to lookups for this long (a chunk with
#: bad bytes is dropped outright; this covers a tier that is slow, throttling or down).
FAILED_READ_COOLDOWN_S = 10.0
#: Cooling chunks kept before the expired ones are swept.
_COOLING_SWEEP = 4096
#: Pool lookups: ids answered in one step remembered at most (~100 B each).
ANSWERED_IDS = 1 << 16


class CoolDown:
    """Chunks not offered to lookups until a deadline (a read of them failed)."""

    def __init__(self) -> None:
        #: chunk id -> monotonic time until which lookups skip it
        self._until: dict[str, float] = {}

    def start(self, chunk_id: str) -> None:
        """A read of ``chunk_id`` failed: skip it for :data:`FAILED_READ_COOLDOWN_S`."""
        self._until[chunk_id] = time.monotonic() + FAILED_READ_COOLDOWN_S
        if len(self._until) > _COOLING_SWEEP:
            now = time.monotonic()
            self._until = {f: t for f, t in self._until.items() if t > now}

    def cooling(self, chunk_id: str) -> bool:
        """Whether lookups skip ``chunk_id`` now (a chunk whose time is up is forgotten)."""
        if not self._until:
            return False
        until = self._until.get(chunk_id)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._until[chunk_id]
        return False


class AnsweredIds:
    """Ids a pool answered (present or not) in this step or the one before: not asked again
    meanwhile, so a request that waited for its lookup finds the answer when vLLM asks
    again. Older answers are asked afresh: another instance may have put the block since."""

    def __init__(self) -> None:
        self._now: dict[str, None] = {}
        self._before: dict[str, None] = {}

    def add(self, chunk_id: str) -> None:
        self._now[chunk_id] = None
        if len(self._now) > ANSWERED_IDS:
            del self._now[next(iter(self._now))]

    def __contains__(self, chunk_id: str) -> bool:
        return chunk_id in self._now or chunk_id in self._before

    def new_step(self) -> None:
        """A step begins: the answers of the step before last are forgotten."""
        self._before, self._now = self._now, {}
