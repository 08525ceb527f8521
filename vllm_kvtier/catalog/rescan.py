"""The rescan thread of a listed tier (S3): changes pushed to the planner.

Who calls it: the connector builds it (:mod:`vllm_kvtier.engine.lower`) with the tier's
listing function; the planner (:class:`~vllm_kvtier.plan.chunk_plan.ChunkPlanner`) calls
:meth:`Rescanner.take` and :meth:`Rescanner.note_written` from vLLM's scheduler thread.
The listing runs on the rescan thread only; so does the diff against the last listing.
The scheduler thread only takes the merged delta (a lock held for a swap).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from vllm_kvtier.catalog.base import Found, RescanDelta, common_chunks
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import CounterName

logger = logging.getLogger(__name__)

#: Chunks of the deltas not taken yet kept at most (an idle engine takes none), and chunk
#: ids of our writes kept for the next listing while listings fail.
_MAX_PENDING_CHUNKS = 1 << 18


class WrittenIds:
    """Chunk ids this instance wrote (all ranks durable) since the last listing began.

    At most :data:`_MAX_PENDING_CHUNKS`; beyond, an id is dropped and counted (as
    ``rescan_written_dropped``). Not locked: :class:`Rescanner` holds its lock around
    every call."""

    def __init__(self) -> None:
        self._ids: dict[str, None] = {}
        self._dropped = 0

    def add(self, chunk_id: str) -> None:
        if len(self._ids) < _MAX_PENDING_CHUNKS:
            self._ids[chunk_id] = None
        else:
            self._dropped += 1

    def take(self) -> list[str]:
        """The ids noted so far, forgotten here (a listing begins)."""
        out, self._ids = list(self._ids), {}
        return out

    def restore(self, chunk_ids: Sequence[str]) -> None:
        """Put back ids a failed listing took (the bound still holds; no count)."""
        for fid in chunk_ids:
            if len(self._ids) >= _MAX_PENDING_CHUNKS:
                break
            self._ids.setdefault(fid, None)

    def take_dropped(self) -> int:
        """Ids dropped since the last call."""
        n, self._dropped = self._dropped, 0
        return n


class Rescanner:
    """Runs ``scan`` every ``interval_s`` on a daemon thread.

    It turns each listing into a :class:`RescanDelta` there, so the scheduler thread only
    applies deltas. ``scan`` may block for seconds (it lists a bucket); it never runs on
    the scheduler thread. A failed scan raises, and is logged and skipped. A listing that
    could not complete must not read as "everything was deleted". ``initial``: the
    start-up listing the planner was built from (the first delta is against it). The
    thread keeps the set of chunk ids of the last listing (about 100 B each). It also keeps
    the deltas not taken yet, merged into one by chunk id. A chunk added then removed
    before a take is in neither. It keeps at most :data:`_MAX_PENDING_CHUNKS` chunks.
    Beyond that, they are dropped. The next rescan then computes one delta against what the
    planner last took (a resync, counted as ``rescan_resyncs``). So an idle engine holds one
    delta's worth, not every rescan's.
    """

    def __init__(self, name: str, scan: Callable[[], Found], interval_s: float, *, initial: Found | None = None,
                 counts: Callable[[], dict[CounterName, int]] | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        """``counts``: called after each scan (same thread), counters to add for it.
        ``on_close``: run by :meth:`close` once the thread is told to stop (the stores the
        listings use)."""
        self._scan = scan
        self._on_close = on_close
        self._counts = counts
        self._interval_s = interval_s
        self._listed: set[str] = set(common_chunks(initial or []))
        self._lock = threading.Lock()
        self._written = WrittenIds()
        #: the deltas not taken yet, merged (None: none)
        self._pending: RescanDelta | None = None
        self._partial = 0  # the last listing's RescanDelta.partial
        self._resyncs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{name}-rescan", daemon=True)
        self._thread.start()

    def note_written(self, chunk_id: str) -> None:
        """``chunk_id`` is durable on every rank (scheduler thread): a listing that starts
        after this and does not show it means it was deleted. Bounded: past
        :data:`_MAX_PENDING_CHUNKS` ids waiting (listings failing) the id is dropped and
        counted; such a chunk, if deleted out of band, leaves the index at its first read."""
        with self._lock:
            self._written.add(chunk_id)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.rescan_once()
            except Exception:
                logger.exception("kvtier: rescan failed")

    def rescan_once(self) -> RescanDelta:
        """One listing and its delta, merged into what :meth:`take` returns (the rescan
        thread; blocks for the listing; a test may call it from its own thread). Raises
        what ``scan`` raises, queueing nothing."""
        with self._lock:
            written = self._written.take()
        try:
            found = self._scan()
        except BaseException:
            with self._lock:  # still to be checked by the next listing
                self._written.restore(written)
            raise
        delta = self.diff(found, written)
        if self._counts is not None:
            delta.counts.update(self._counts())
        with self._lock:
            self._partial = delta.partial
            self._merge(delta)
        return delta

    def _merge(self, d: RescanDelta) -> None:
        """Fold ``d`` into the pending delta (lock held). Invariant: the planner's view is
        ``(listed - pending.added) | pending.removed``; past the bound the pending delta is
        dropped and ``listed`` set back to that view (the next diff is a resync)."""
        p = self._pending
        if p is None:
            self._pending = d  # whatever its size: one delta always gets through
            return
        added, removed = dict(p.added), set(p.removed)
        for fid in d.removed:
            if added.pop(fid, None) is None:
                removed.add(fid)
        for fid, entry in d.added.items():
            if fid in removed:
                removed.discard(fid)  # back before the planner saw it go
            else:
                added[fid] = entry
        counts = dict(p.counts)
        for k, n in d.counts.items():
            counts[k] = counts.get(k, 0) + n
        if len(added) + len(removed) > _MAX_PENDING_CHUNKS:
            self._listed = (self._listed - added.keys()) | removed
            self._pending = None
            self._resyncs += 1
            logger.info("kvtier: %d rescan changes not taken; the next rescan resyncs", len(added) + len(removed))
            return
        self._pending = RescanDelta(added, frozenset(removed), d.partial, counts)

    def diff(self, found: Found, written: Sequence[str] = ()) -> RescanDelta:
        """The delta of listing ``found`` against the previous one (and ``written``: our
        writes confirmed before the listing began); ``found`` becomes the previous one."""
        common = common_chunks(found)
        listed = set(common)
        before = self._listed
        before.update(written)
        removed = frozenset(before - listed)
        added = {fid: (tuple(BlockKey(k) for k in h.keys), h.total_bytes, h.block_bytes)
                 for fid, h in common.items() if fid not in before}
        partial = len(set().union(*found) - listed) if found else 0
        self._listed = listed
        return RescanDelta(added, removed, partial)

    def take(self) -> list[RescanDelta]:
        """The deltas not taken yet, merged into one (none: empty), with the counters of
        the bounds (``rescan_resyncs``, ``rescan_written_dropped``) since the last take."""
        with self._lock:
            p, self._pending = self._pending, None
            extra = {k: v for k, v in ((CounterName.RESCAN_RESYNCS, self._resyncs),
                                       (CounterName.RESCAN_WRITTEN_DROPPED, self._written.take_dropped())) if v}
            self._resyncs = 0
        if extra:
            p = p or RescanDelta({}, frozenset(), self._partial)
            for k, v in extra.items():
                p.counts[k] = p.counts.get(k, 0) + v
        return [] if p is None else [p]

    def close(self) -> None:
        """Stop the thread (a listing in flight is not waited for), then run ``on_close``."""
        self._stop.set()
        if self._on_close is not None:
            self._on_close()
