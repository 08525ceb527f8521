"""Existence lookups in a key-value pool (Mooncake), on a thread of their own.

Who calls it: the connector builds it (:mod:`vllm_kvtier.engine.lower`) with the pool's
``exists``; the planner submits ids, asks whether answers are still to come and takes
them, from vLLM's scheduler thread (:class:`~vllm_kvtier.catalog.base.PoolLookups`). No
call waits for the pool. Ids submitted while a lookup runs are queued and asked together
in the next one: one thread, one lookup at a time, so a pool that hangs holds one thread.

Deadlines: a lookup not answered within ``timeout_s`` of its sending is counted once in
``lookup_timeouts``; the requests that waited for it go on as a miss. While it still runs,
nothing more is sent (a miss, not counted again). Its answer, when it comes, is handed over
like any other: the chunks it found are indexed then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from vllm_kvtier.catalog.base import LookupAnswer
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters

logger = logging.getLogger(__name__)

#: Ids queued for the next lookup at most (beyond, a submit is refused: a miss).
_MAX_QUEUED_IDS = 1 << 16


class SentLookup:
    """The lookup running now: its ids and deadline. Its timeout is reported once. Not
    locked: :class:`PoolLookup` holds its lock around every call."""

    def __init__(self) -> None:
        self.ids: frozenset[str] = frozenset()
        self._deadline = 0.0
        self._reported = False

    def start(self, ids: Sequence[str], deadline: float) -> None:
        self.ids = frozenset(ids)
        self._deadline = deadline
        self._reported = False

    def end(self) -> None:
        self.ids = frozenset()

    def overdue(self, now: float) -> bool:
        """Whether a lookup runs past its deadline."""
        return bool(self.ids) and now >= self._deadline

    def first_report(self) -> bool:
        """True the first time its timeout is reported, False after."""
        first, self._reported = not self._reported, True
        return first


class Answers:
    """The pool's answers not taken yet, and their ids. Not locked: :class:`PoolLookup`
    holds its lock around every call."""

    def __init__(self) -> None:
        self._answers: list[LookupAnswer] = []
        self._ids: set[str] = set()

    def add(self, ids: Sequence[str], present: Sequence[bool]) -> None:
        self._answers.append(LookupAnswer(tuple(ids), tuple(present)))
        self._ids.update(ids)

    def __contains__(self, chunk_id: str) -> bool:
        return chunk_id in self._ids

    def take(self) -> list[LookupAnswer]:
        out, self._answers = self._answers, []
        self._ids.clear()
        return out


class PoolLookup:
    """:class:`~vllm_kvtier.catalog.base.PoolLookups` over ``exists(ids) -> present``
    (blocking; every rank's answer combined), run on a daemon thread."""

    def __init__(self, tier: TierName, exists: Callable[[list[str]], list[bool]], *, timeout_s: float,
                 counters: Counters, on_close: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``on_close``: run by :meth:`close` (the stores ``exists`` asks)."""
        self.tier = tier
        self._exists = exists
        self._timeout_s = timeout_s
        self._counters = counters
        self._on_close = on_close
        self._clock = clock
        #: the one lock of every field here; the lookup thread waits on it for ids
        self._wake = threading.Condition()
        #: id -> deadline, for ids queued and not sent yet
        self._queued: dict[str, float] = {}
        self._sent = SentLookup()
        self._answers = Answers()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{tier}-lookup", daemon=True)
        self._thread.start()

    def _hung(self, now: float) -> bool:
        """Whether the lookup running now is past its deadline (lock held). The first call
        that finds it so counts it in ``lookup_timeouts`` (scheduler thread: counters are
        bumped there only)."""
        if not self._sent.overdue(now):
            return False
        if self._sent.first_report():
            self._counters.add(CounterName.LOOKUP_TIMEOUTS, self.tier)
        return True

    def submit(self, ids: Sequence[str]) -> bool:
        now = self._clock()
        with self._wake:
            if self._closed or self._hung(now):
                return False
            new = [i for i in ids if i not in self._queued and i not in self._sent.ids and i not in self._answers]
            if len(self._queued) + len(new) > _MAX_QUEUED_IDS:
                return False
            deadline = now + self._timeout_s
            for i in new:
                self._queued[i] = deadline
            if new:
                self._wake.notify()
            return True

    def waiting(self, ids: Sequence[str]) -> bool:
        now = self._clock()
        with self._wake:
            hung = self._hung(now)
            for i in ids:
                if i in self._answers or (i in self._queued and not hung and now < self._queued[i]):
                    return True
                if i in self._sent.ids and not hung:
                    return True
            return False

    def take_answers(self) -> list[LookupAnswer]:
        with self._wake:
            return self._answers.take()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queued and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                batch = list(self._queued)
                self._queued.clear()
                self._sent.start(batch, self._clock() + self._timeout_s)
            try:
                present: list[bool] | None = self._exists(batch)
            except Exception:  # the pool says False on errors; anything else is a miss too
                logger.exception("kvtier %s: pool lookup failed", self.tier)
                present = None
            with self._wake:
                self._sent.end()
                if present is not None:
                    self._answers.add(batch, present)

    def close(self) -> None:
        """Stop the thread (a lookup in flight is not waited for), then run ``on_close``."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._on_close is not None:
            self._on_close()
