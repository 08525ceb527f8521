"""The trust boundary on a request's ``kv_transfer_params``.

vLLM's OpenAI server forwards ``kv_transfer_params`` from the client's request body. What
arrives here may come from anyone who can send a request. So each request-level feature is
off unless the operator's config enables it, and limited when it is.

* ``kvtier_pin_ttl_s``: enabled by ``cpu.request_pins``. Limited by
  ``cpu.max_pin_ttl_s`` (the TTL is cut to it) and ``cpu.max_pinned_fraction``.
* ``kvtier_peer`` (``do_remote_prefill``): enabled by ``nixl.allowed_peers`` (agent
  names). Limited by ``nixl.trusted_peers``: only their blocks are kept/stored.
* ``kvtier_pool_blocks``: enabled by ``mooncake.accept_handoffs``. Limited by
  ``mooncake.handoff_wait_s``.

A parameter that is not enabled, not allowed or malformed is **ignored**. The request is
served as if it had not been sent, recomputing what it would have loaded. The parameter
is counted in ``request_params_ignored`` (tier label: ``cpu``, ``peer``, ``mooncake``). It
is logged at WARNING at most once a minute per parameter. A cut to a limit is counted in
``request_params_capped``.

Who calls it: the planners (:mod:`~vllm_kvtier.plan.scheduler`,
:mod:`~vllm_kvtier.plan.peer_plan`, :mod:`~vllm_kvtier.plan.pool_handoff`), from vLLM's
scheduler thread, once per request and parameter. Pure: no I/O but the log line.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from vllm_kvtier.config import CPUTierConfig, NixlTierConfig
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters

logger = logging.getLogger(__name__)

PIN_PARAM = "kvtier_pin_ttl_s"
#: Seconds between two WARNING lines about the same ignored parameter.
WARN_INTERVAL_S = 60.0


#: (parameter, request) pairs remembered so that one request counts once per parameter
#: (vLLM may ask about a request again, or resume it after a preemption).
_SEEN_PAIRS = 4096


class IgnoredParams:
    """Counts request parameters ignored or cut, once per request and parameter, and warns
    about them, rate limited."""

    def __init__(self, counters: Counters, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.counters = counters
        self._clock = clock
        self._last_warned: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._seen: OrderedDict[tuple[str, str, str], None] = OrderedDict()

    def ignore(self, param: str, tier: str, request_id: str, why: str) -> None:
        """``request_id``'s ``param`` is not acted on (``why``, for the log)."""
        if self._first("ignored", param, request_id):
            self.counters.add(CounterName.REQUEST_PARAMS_IGNORED, tier)
            self._warn(param, f"kvtier: request {request_id}: kv_transfer_params.{param} ignored: {why}")

    def cap(self, param: str, tier: str, request_id: str, why: str) -> None:
        """``request_id``'s ``param`` is acted on, cut to a configured limit."""
        if self._first("capped", param, request_id):
            self.counters.add(CounterName.REQUEST_PARAMS_CAPPED, tier)
            self._warn(param, f"kvtier: request {request_id}: kv_transfer_params.{param} {why}")

    def _first(self, what: str, param: str, request_id: str) -> bool:
        key = (what, param, request_id)
        if key in self._seen:
            return False
        self._seen[key] = None
        while len(self._seen) > _SEEN_PAIRS:
            self._seen.popitem(last=False)
        return True

    def _warn(self, param: str, line: str) -> None:
        now = self._clock()
        last = self._last_warned.get(param)
        if last is not None and now - last < WARN_INTERVAL_S:
            self._suppressed[param] = self._suppressed.get(param, 0) + 1
            return
        self._last_warned[param] = now
        more = self._suppressed.pop(param, 0)
        logger.warning("%s%s", line, f" ({more} more like it in the last minute)" if more else "")


def _params(request: Any) -> dict | None:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else None


def request_pin_ttl_s(request: Any, cfg: CPUTierConfig, ignored: IgnoredParams) -> float | None:
    """The key-pin TTL ``request`` may have for its prompt blocks: None unless it asked
    (``kvtier_pin_ttl_s``) and ``cpu.request_pins`` is on; at most ``cpu.max_pin_ttl_s``.
    Call once per request (each call counts what it ignores)."""
    params = _params(request)
    if params is None or PIN_PARAM not in params:
        return None
    rid = request.request_id
    if not cfg.request_pins:
        ignored.ignore(PIN_PARAM, TierName.CPU, rid, "cpu.request_pins is off")
        return None
    ttl = params[PIN_PARAM]
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0 or ttl != ttl:
        ignored.ignore(PIN_PARAM, TierName.CPU, rid, f"not a number of seconds > 0: {ttl!r}")
        return None
    if ttl > cfg.max_pin_ttl_s:
        ignored.cap(PIN_PARAM, TierName.CPU, rid, f"cut from {ttl} to cpu.max_pin_ttl_s = {cfg.max_pin_ttl_s:g} s")
        return cfg.max_pin_ttl_s
    return float(ttl)


class PeerTrust(enum.Enum):
    """What a decode instance does with an offer from a NIXL agent."""

    #: Not in ``nixl.allowed_peers`` / ``trusted_peers``: the offer is not read.
    REFUSED = "refused"
    #: Allowed, not trusted: its blocks serve their request only.
    PRIVATE = "private"
    #: In ``nixl.trusted_peers``: its blocks are kept and stored like our own.
    TRUSTED = "trusted"


def peer_trust(agent_names: Sequence[str], cfg: NixlTierConfig) -> PeerTrust:
    """How far to trust an offer whose ranks are the NIXL agents ``agent_names`` (every
    rank must qualify; an offer naming no agent is refused)."""
    if not agent_names:
        return PeerTrust.REFUSED
    if all(cfg.trusts_peer(n) for n in agent_names):
        return PeerTrust.TRUSTED
    if all(cfg.allows_peer(n) for n in agent_names):
        return PeerTrust.PRIVATE
    return PeerTrust.REFUSED
