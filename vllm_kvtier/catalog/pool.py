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
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        #: id -> deadline, for ids queued and not sent yet
        self._queued: dict[str, float] = {}
        #: the ids of the lookup running now, and its deadline
        self._sent: frozenset[str] = frozenset()
        self._sent_deadline = 0.0
        self._timeout_counted = False
        #: answers not taken yet, and their ids
        self._answers: list[LookupAnswer] = []
        self._ready: set[str] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{tier}-lookup", daemon=True)
        self._thread.start()

    def _hung(self, now: float) -> bool:
        """Whether the lookup running now is past its deadline (lock held). The first call
        that finds it so counts it in ``lookup_timeouts`` (scheduler thread: counters are
        bumped there only)."""
        if not self._sent or now < self._sent_deadline:
            return False
        if not self._timeout_counted:
            self._timeout_counted = True
            self._counters.add(CounterName.LOOKUP_TIMEOUTS, self.tier)
        return True

    def submit(self, ids: Sequence[str]) -> bool:
        now = self._clock()
        with self._lock:
            if self._closed or self._hung(now):
                return False
            new = [i for i in ids if i not in self._queued and i not in self._sent and i not in self._ready]
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
        with self._lock:
            hung = self._hung(now)
            for i in ids:
                if i in self._ready or (i in self._queued and not hung and now < self._queued[i]):
                    return True
                if i in self._sent and not hung:
                    return True
            return False

    def take_answers(self) -> list[LookupAnswer]:
        with self._lock:
            out, self._answers = self._answers, []
            self._ready.clear()
        return out

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queued and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                batch = list(self._queued)
                self._queued.clear()
                self._sent = frozenset(batch)
                self._sent_deadline = self._clock() + self._timeout_s
                self._timeout_counted = False
            try:
                present: list[bool] | None = self._exists(batch)
            except Exception:  # the pool says False on errors; anything else is a miss too
                logger.exception("kvtier %s: pool lookup failed", self.tier)
                present = None
            with self._lock:
                self._sent = frozenset()
                if present is not None:
                    self._answers.append(LookupAnswer(tuple(batch), tuple(present)))
                    self._ready.update(batch)

    def close(self) -> None:
        """Stop the thread (a lookup in flight is not waited for), then run ``on_close``."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        if self._on_close is not None:
            self._on_close()
