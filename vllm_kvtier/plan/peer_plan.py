"""Scheduler side of P/D peer to peer over NIXL (the ``nixl`` section).

Who calls it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`, from vLLM's
scheduler thread. Pure bookkeeping; the workers move the bytes
(:mod:`vllm_kvtier.transfer.peer`).

Prefill side (a request with ``kv_transfer_params.do_remote_decode``): when the request
finishes, its prompt blocks sit in CPU slots (saved, or being saved this step). Those
slots are pinned for ``hold_s``. ``request_finished`` returns where they are, as
``kv_transfer_params``: every rank's NIXL description, the slots, the block keys. A
decode instance's read notifies the prefill ranks, and the slots are released. If no read
comes (the decode instance died, the proxy gave up), the hold expires. Then the slots are
reclaimed (``peer_hold_timeouts``). Offers hold at most ``nixl.max_offered_fraction`` of
the slots at once.

Trust (prefill side): an offer hands out every rank's NIXL agent metadata (memory
registration keys, pool addresses) and pins slots. vLLM's OpenAI server forwards
``kv_transfer_params`` from clients. So ``do_remote_decode`` is answered only with
``nixl.accept_remote_decode`` on. A shared secret may be configured
(:func:`~vllm_kvtier.config.secrets.load_remote_decode_secret`). Then the request must
also carry a one-time token made with it (``kvtier_pd_auth``: :mod:`~vllm_kvtier.plan.pd_auth`).
The secret itself is never sent, since vLLM logs the request. Otherwise the request gets
no offer, pins nothing, and is counted (``request_params_ignored{tier="peer"}``). The
answer itself must reach only the proxy, never a client (docs/security.md).

Decode side (``do_remote_prefill`` with those parameters): the prompt's blocks whose keys
match the request's own block hashes are an async load. So a mismatched model or prompt is
never loaded. Each block gets a CPU slot. The worker reads slots and stamps over NIXL. Only
blocks whose stamp is the expected key are used; the rest is recomputed.

Trust (decode side): the offer comes in ``kv_transfer_params``, which vLLM's OpenAI server
forwards from clients. It is read only if every rank's agent name matches
``nixl.allowed_peers`` or ``nixl.trusted_peers``. The worker checks again, and NIXL checks
that the agent metadata names that agent. Otherwise it is ignored and counted
(:mod:`~vllm_kvtier.plan.request_params`). A plan from an agent that is allowed but not
trusted is ``trusted=False``: the scheduler uses its blocks for that request only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from vllm_kvtier.config import NixlTierConfig
from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import BlockKey, TierName
from vllm_kvtier.metrics import CounterName, Counters
from vllm_kvtier.plan.pd_auth import HandOffAuth
from vllm_kvtier.plan.request_params import IgnoredParams, PeerTrust, peer_trust

logger = logging.getLogger(__name__)

TIER = TierName.PEER
PARAM = "kvtier_peer"


@dataclass(frozen=True)
class PeerPlan:
    """What a decode request will read: ``remote_slots[i]`` holds ``keys[i]`` (blocks
    ``start`` .. ``start + n``)."""

    peer: dict
    remote_slots: tuple[int, ...]
    keys: tuple[BlockKey, ...]
    #: the prefill instance's request id, for the notification that frees its blocks
    notify: str = ""
    #: every rank's agent is in ``nixl.trusted_peers``: its blocks may be kept and stored
    trusted: bool = False


class PeerPlanner:
    def __init__(self, index: SlotIndex, counters: Counters, *, world_size: int, cfg: NixlTierConfig,
                 ignored: IgnoredParams | None = None, secret: bytes | None = None) -> None:
        """``secret``: the shared secret a ``do_remote_decode`` must prove it knows (None:
        none is asked for; see :func:`~vllm_kvtier.config.secrets.load_remote_decode_secret`)."""
        self.index = index
        self._auth = HandOffAuth(secret) if secret is not None else None
        self.counters = counters
        self.world_size = world_size
        self.cfg = cfg
        self.hold_s = cfg.hold_s
        self.ignored = ignored if ignored is not None else IgnoredParams(counters)
        self._ranks: dict[int, dict] = {}
        #: prefill side: request -> (pinned slots, deadline)
        self._holds: dict[str, tuple[list[int], float]] = {}
        #: decode side: request -> its plan, between the lookup and the allocation
        self._plans: dict[str, PeerPlan] = {}
        #: decode side: requests that already tried once (a failed read is recomputed, not
        #: retried: vLLM reschedules the request at once, and a gone peer would loop)
        self._attempted: set[str] = set()

    # ---- prefill side -------------------------------------------------------------------

    def params_for(self, request: Any, block_size: int) -> dict | None:
        """At ``request_finished`` of a request to hand off: pin its prompt's slots and
        say where they are. None if this is not such a request or the ranks have not
        published their NIXL description yet."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            return None
        refused = self._refusal(params)
        if refused is not None:
            self.ignored.ignore("do_remote_decode", TIER, request.request_id, refused)
            return None
        if not self.published():
            logger.warning("kvtier peer: request %s: workers have not published their NIXL address yet; "
                           "the decode instance will recompute", request.request_id)
            return None
        if any("unavailable" in d for d in self._ranks.values()):
            return None  # the worker logged why at start
        slots, keys = [], []
        for h in request.block_hashes[: request.num_prompt_tokens // block_size]:
            s = self.index.slot(BlockKey(h))
            if s is None:
                break
            slots.append(s)
            keys.append(h.hex())
        if not slots:
            return None
        held = sum(len(h[0]) for h in self._holds.values())
        if held + len(slots) > self.cfg.max_offered_fraction * self.index.num_slots:
            self.ignored.ignore("do_remote_decode", TIER, request.request_id,
                                f"offers already hold {held} of {self.index.num_slots} CPU slots "
                                f"(nixl.max_offered_fraction = {self.cfg.max_offered_fraction:g})")
            return None
        for s in slots:
            self.index.pin(s)
        self._holds[request.request_id] = (slots, time.monotonic() + self.hold_s)
        self.counters.add(CounterName.PEER_OFFERED_BLOCKS, TIER, len(slots))
        return {PARAM: {"ranks": {str(r): d for r, d in self._ranks.items()}, "slots": slots, "keys": keys,
                        "request": request.request_id}}

    def _refusal(self, params: dict) -> str | None:
        """Why a ``do_remote_decode`` gets no offer (None: it gets one)."""
        if not self.cfg.accept_remote_decode:
            return "nixl.accept_remote_decode is off"
        if self._auth is None:
            return None
        return self._auth.refusal(params, time.time())

    def release(self, req_id: str) -> int:
        """Unpin ``req_id``'s offered slots; how many there were (0: none held)."""
        held = self._holds.pop(req_id, None)
        if held is None:
            return 0
        for s in held[0]:
            self.index.unpin(s)
        return len(held[0])

    def expire(self) -> None:
        now = time.monotonic()
        for req_id in [r for r, (_, t) in self._holds.items() if t <= now]:
            self.release(req_id)
            self.counters.add(CounterName.PEER_HOLD_TIMEOUTS, TIER)
            logger.warning("kvtier peer: request %s: no decode instance read its blocks in %.0f s; released",
                           req_id, self.hold_s)

    def on_worker_meta(self, meta: WorkerReport) -> None:
        self._ranks.update(meta.peer_info)
        for req_id in meta.peer_done:
            self.counters.add(CounterName.PEER_RELEASED_BLOCKS, TIER, self.release(req_id))

    def published(self) -> bool:
        """Whether every rank has said where its CPU tier is (or that it has no NIXL). They
        do with their first step, so the scheduler asks for one step at start."""
        return len(self._ranks) >= self.world_size

    def holding(self) -> int:
        return len(self._holds)

    # ---- decode side --------------------------------------------------------------------

    def match(self, request: Any, start: int, limit: int) -> int | None:
        """Blocks ``start``.. of the request a prefill instance offers (None: no offer, or
        one that is ignored: counted once per request)."""
        params = getattr(request, "kv_transfer_params", None)
        offer = params.get(PARAM) if isinstance(params, dict) and params.get("do_remote_prefill") else None
        if offer is None or request.request_id in self._attempted:
            return None
        try:
            if not isinstance(offer, dict):
                raise TypeError("not a mapping")
            keys, slots = list(offer["keys"]), [int(s) for s in offer["slots"]]
            peer = {"ranks": dict(offer["ranks"])}
            notify = str(offer.get("request", request.request_id))
            names = [str(d["agent"]["name"]) for d in peer["ranks"].values()]
        except (KeyError, TypeError, ValueError) as e:
            self._refuse(request.request_id, f"malformed offer ({type(e).__name__}: {e})")
            return None
        trust = peer_trust(names, self.cfg)
        if trust is PeerTrust.REFUSED:
            self._refuse(request.request_id, f"agent(s) {sorted(set(names))[:4]} not in nixl.allowed_peers"
                         + ("" if self.cfg.allowed_peers or self.cfg.trusted_peers else " (empty)"))
            return None
        n = 0
        hashes = request.block_hashes
        for i in range(start, min(limit, len(keys), len(slots))):
            if not isinstance(keys[i], str) or hashes[i].hex() != keys[i]:
                break  # another prompt or another model: never load it
            n += 1
        if n:
            self._plans[request.request_id] = PeerPlan(
                peer, tuple(slots[start : start + n]), tuple(BlockKey(hashes[i]) for i in range(start, start + n)),
                notify, trusted=trust is PeerTrust.TRUSTED,
            )
        return n

    def _refuse(self, req_id: str, why: str) -> None:
        """Ignore ``req_id``'s offer, for good (vLLM may ask again: counted once)."""
        self._attempted.add(req_id)
        self.ignored.ignore(PARAM, TIER, req_id, why)

    def take_plan(self, req_id: str) -> PeerPlan | None:
        plan = self._plans.pop(req_id, None)
        if plan is not None:
            self._attempted.add(req_id)
        return plan

    def forget(self, req_id: str) -> None:
        """The request ended (decode side)."""
        self._plans.pop(req_id, None)
        self._attempted.discard(req_id)
