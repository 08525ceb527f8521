"""The ranks' write reports of a chunk tier: a chunk is durable once every rank wrote it.

Who calls it: :class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner`, from vLLM's scheduler
thread, with each step's :class:`~vllm_kvtier.jobs.WorkerReport`. Pure bookkeeping.
"""

from __future__ import annotations

from collections import OrderedDict

#: Chunks remembered as failed at most (ids, ~100 B each; the oldest is forgotten first).
FAILED_CHUNKS = 4096


def remember(ids: OrderedDict[str, None], chunk_id: str, limit: int) -> None:
    """Add ``chunk_id`` to the bounded ordered set ``ids`` (the oldest goes past ``limit``)."""
    ids[chunk_id] = None
    while len(ids) > limit:
        ids.popitem(last=False)


class ChunkAcks:
    """Per chunk, the ranks that reported it written; and the chunks that failed on some
    rank, whose late "written" reports from other ranks are ignored."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size
        self._acks: dict[str, int] = {}
        self._failed: OrderedDict[str, None] = OrderedDict()

    def written(self, chunk_id: str, ranks: int) -> bool:
        """``ranks`` more ranks wrote ``chunk_id``; True once every rank did (then it is
        forgotten here). A failed chunk is never durable."""
        if chunk_id in self._failed:
            return False
        n = self._acks[chunk_id] = self._acks.get(chunk_id, 0) + ranks
        if n < self._world_size:
            return False
        del self._acks[chunk_id]
        return True

    def fail(self, chunk_id: str) -> None:
        """A rank failed ``chunk_id`` (or refused, or read it wrong): never durable now."""
        self._acks.pop(chunk_id, None)
        remember(self._failed, chunk_id, FAILED_CHUNKS)

    def failed(self, chunk_id: str) -> bool:
        return chunk_id in self._failed

    def retry(self, chunk_id: str) -> None:
        """``chunk_id`` is written again (a key-named chunk) or found again: not failed."""
        self._failed.pop(chunk_id, None)

    def forget(self, chunk_id: str) -> None:
        """``chunk_id`` left the index: its pending reports no longer count."""
        self._acks.pop(chunk_id, None)
