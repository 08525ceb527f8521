"""Who wrote each indexed chunk of a tier: another writer (``REMOTE``, for KV events) or
this process (on a shared tier, the only chunks a failed read deletes).

Who calls it: :class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner`, from vLLM's scheduler
thread. Sets of chunk ids, no per-block state; pruned to the indexed chunks now and then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class ChunkOrigins:
    def __init__(self) -> None:
        #: indexed chunks another writer stored (KV events say REMOTE)
        self._remote: set[str] = set()
        #: shared tiers: indexed chunks this process wrote (durable on every rank)
        self._written_here: set[str] = set()

    def is_remote(self, chunk_id: str) -> bool:
        return chunk_id in self._remote

    def mark_remote(self, chunk_id: str) -> None:
        self._remote.add(chunk_id)

    def mark_ours(self, chunk_id: str, *, shared: bool) -> None:
        """This process wrote ``chunk_id`` (every rank acknowledged it); ``shared``: on a
        tier other instances read (remembered as written here)."""
        self._remote.discard(chunk_id)
        if shared:
            self._written_here.add(chunk_id)

    def written_here(self, chunk_id: str) -> bool:
        return chunk_id in self._written_here

    def forget(self, chunk_id: str, *, remote: bool = True, written: bool = True) -> None:
        if remote:
            self._remote.discard(chunk_id)
        if written:
            self._written_here.discard(chunk_id)

    def prune(self, indexed: int, live: Callable[[], Iterable[str]]) -> None:
        """Forget removed chunks once the sets outgrow the index (``indexed`` chunks;
        ``live``: the indexed chunk ids, listed only then)."""
        if len(self._remote) + len(self._written_here) > 2 * indexed + 1024:
            ids = set(live())
            self._remote &= ids
            self._written_here &= ids
