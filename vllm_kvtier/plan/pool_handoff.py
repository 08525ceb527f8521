"""P/D through a shared pool (the ``mooncake`` section): the hand-off between a prefill
instance and a decode instance, both sides.

Who calls it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`, from vLLM's
scheduler thread. Pure bookkeeping on a request's ``kv_transfer_params``; no I/O.

Prefill side (``do_remote_decode``): ``params_for`` says in the answer how many prompt
blocks this instance puts into the pool (``kvtier_pool_blocks``). Its saves write them
through as each block is computed.

Decode side (``do_remote_prefill`` with ``kvtier_pool_blocks``): the prefill instance's
puts may land after its answer reached the proxy. So ``should_wait`` asks vLLM to retry
(``get_num_new_matched_tokens`` returns None) until those blocks are all visible. It waits
at most ``mooncake.handoff_wait_s``. Then the request goes on with what is there. The
rest is recomputed, counted in ``handoff_timeouts``.

Both sides act only with ``mooncake.accept_handoffs`` on. The decode side's wait is asked
for by the request, and vLLM's OpenAI server forwards ``kv_transfer_params`` from clients.
Off, the prefill side announces nothing. The decode side ignores ``kvtier_pool_blocks``
and counts it (see :mod:`~vllm_kvtier.plan.request_params`). Pool hits are still hits.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters
from vllm_kvtier.plan.request_params import IgnoredParams

logger = logging.getLogger(__name__)

PARAM = "kvtier_pool_blocks"


class PoolHandoff:
    def __init__(self, counters: Counters, *, wait_s: float, block_size: int, enabled: bool = False,
                 ignored: IgnoredParams | None = None) -> None:
        self.counters = counters
        self.wait_s = wait_s
        self.enabled = enabled
        self.ignored = ignored if ignored is not None else IgnoredParams(counters)
        self.block_size = block_size
        #: decode side: request -> when it started waiting for its prefilled blocks
        self._since: dict[str, float] = {}
        #: decode side: requests done waiting (all found, or timed out). A failed load
        #: hides those blocks for a while and vLLM reschedules the request at once: it
        #: must not wait a second time.
        self._settled: set[str] = set()

    def params_for(self, request: Any, *, writes_pool: bool) -> dict | None:
        """Prefill side, at ``request_finished``: the parameters for the decode instance
        (None if this is not a hand-off, or this instance does not write the pool)."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not params.get("do_remote_decode") or not writes_pool or not self.enabled:
            return None
        return {PARAM: request.num_prompt_tokens // self.block_size}

    def should_wait(self, request: Any, start: int, limit: int, found: int) -> bool:
        """Decode side: whether vLLM should ask again next step because blocks the prefill
        instance stored are not all visible yet (``found`` of them are, from ``start``)."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return False
        if PARAM not in params or request.request_id in self._settled:
            return False
        expected = params.get(PARAM)
        if not self.enabled or not isinstance(expected, int) or isinstance(expected, bool):
            self._settled.add(request.request_id)  # counted once per request
            self.ignored.ignore(PARAM, TierName.MOONCAKE, request.request_id,
                                "mooncake.accept_handoffs is off" if not self.enabled else f"not a count: {expected!r}")
            return False
        if found >= min(expected, limit) - start:
            self._since.pop(request.request_id, None)
            self._settled.add(request.request_id)
            return False
        now = time.monotonic()
        since = self._since.setdefault(request.request_id, now)
        if now - since < self.wait_s:
            return True
        self._since.pop(request.request_id, None)
        self._settled.add(request.request_id)
        self.counters.add(CounterName.HANDOFF_TIMEOUTS, TierName.ALL)
        logger.warning("kvtier: request %s: %d of %d prefilled blocks found in the pool after %.1f s; "
                       "recomputing the rest", request.request_id, found, expected - start, now - since)
        return False

    def forget(self, req_id: str) -> None:
        """The request ended (or was aborted while waiting)."""
        self._since.pop(req_id, None)
        self._settled.discard(req_id)
