"""Short first: which waiting request vLLM's scheduler admits first.

This is ``schedule.order: short-first``.

Who calls it: :class:`~vllm_kvtier.connector.scheduler.SchedulerHalf`, from vLLM's
scheduler thread only. Pure bookkeeping: no I/O, nothing blocks.

vLLM admits waiting requests in arrival order and puts whatever fits into one step. Take
a request whose prefix a tier holds, with a few dozen tokens to compute. It shares its
first step with the long prefill of a request that arrived just before it. So it waits as
long as that prefill. A connector can change the order in one way only. Its lookup may
answer "not yet" (``None``). vLLM's scheduler then looks at the next request in its
queue, and asks again at the next step.

A request is *long* when more than ``short_tokens`` of its prompt are left to compute
after its hits (vLLM's prefix cache and the tiers). Else it is *short*. A long request is
passed over while a short one waits in the queue. Waiting means it arrived, vLLM has not
admitted it, and it has not ended. This lasts until ``max_wait_s`` from the first time
has passed at its next lookup. Then it is no longer followed: vLLM admits it in its own
order. A short request holds the others back only while it is fresh. Fresh means it
arrived or vLLM looked it up within the last ``max_wait_s``. One that vLLM keeps skipping
for its own reasons (say a LoRA slot) stops counting. Short requests are never passed
over. Nor are requests not seen to arrive (a preempted one coming back).

A request's tokens to compute are known exactly once vLLM looks it up. Before that (it is
behind the request being looked up) they are the caller's estimate at arrival.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters

#: Waiting requests followed at most; past it the oldest is no longer followed (then it
#: is admitted in vLLM's order, and is not made way for).
MAX_WAITING = 1 << 16


class ShortFirst:
    """The waiting requests, short or long, and how long each long one was passed over."""

    def __init__(self, *, short_tokens: int, max_wait_s: float, counters: Counters,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.short_tokens = short_tokens
        self.max_wait_s = max_wait_s
        self.counters = counters
        self._clock = clock
        #: waiting request -> tokens it has left to compute (estimated, then looked up), in arrival order
        self._left: OrderedDict[str, int] = OrderedDict()
        #: the waiting requests that are short -> when they were last found so (arrival or
        #: lookup), oldest first
        self._short: OrderedDict[str, float] = OrderedDict()
        #: long request -> when it was first passed over
        self._passed_since: dict[str, float] = {}

    def arrived(self, req_id: str, tokens_left: int) -> None:
        """vLLM queued ``req_id``, estimated to have ``tokens_left`` tokens to compute."""
        self._set(req_id, tokens_left)
        while len(self._left) > MAX_WAITING:
            self.gone(next(iter(self._left)))

    def admit(self, req_id: str, tokens_left: int) -> bool:
        """Whether vLLM may admit ``req_id`` now, its lookup having left ``tokens_left``
        tokens to compute. False: answer vLLM "not yet" (counted)."""
        if req_id not in self._left:
            return True
        self._set(req_id, tokens_left)
        if tokens_left <= self.short_tokens or not self._fresh_short():
            return True
        now = self._clock()
        since = self._passed_since.setdefault(req_id, now)
        if now - since >= self.max_wait_s:
            self.counters.add(CounterName.PASSED_OVER_EXPIRED, TierName.ALL)
            self.gone(req_id)  # admitted in vLLM's order from now on
            return True
        self.counters.add(CounterName.PASSED_OVER, TierName.ALL)
        return False

    def gone(self, req_id: str) -> None:
        """``req_id`` was admitted, ended while waiting, or is no longer followed."""
        self._left.pop(req_id, None)
        self._short.pop(req_id, None)
        self._passed_since.pop(req_id, None)

    def waiting(self) -> dict[str, int]:
        """The followed requests and their tokens to compute (introspection: tests)."""
        return dict(self._left)

    def _set(self, req_id: str, tokens_left: int) -> None:
        self._left[req_id] = tokens_left
        if tokens_left <= self.short_tokens:
            self._short[req_id] = self._clock()
            self._short.move_to_end(req_id)
        else:
            self._short.pop(req_id, None)

    def _fresh_short(self) -> bool:
        """Whether a short request found so within ``max_wait_s`` waits. Older ones stop
        counting (they stay followed: a lookup makes them fresh again)."""
        horizon = self._clock() - self.max_wait_s
        while self._short and next(iter(self._short.values())) < horizon:
            self._short.popitem(last=False)
        return bool(self._short)
