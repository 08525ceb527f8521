"""Routers of the fleet replay (:mod:`vllm_kvtier.ops.fleet_sim`): which instance serves
each request.

Called once per request, in trace order, from the replay loop. Pure and deterministic:
ties go to the instance sent fewest requests, then the lowest number. A router sees
:class:`RouterView`: each instance's requests in flight, and what each instance holds (as
its KV events tell a router that consumes them).

* ``round-robin``: instance ``i mod N`` for the ``i``-th request.
* ``session``: a conversation sticks to one instance, the least loaded when it starts.
  A conversation is the requests whose prompts share their first block past the shared
  prefix (:func:`session_keys`).
* ``prefix``: the instance holding the longest leading run of the prompt's blocks in its
  own tiers, among those within the load bound. An instance with ``max_imbalance`` or
  more requests in flight above the fleet's mean is passed over (the least loaded never
  is). Ties, and prompts no instance holds, go to the least loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from vllm_kvtier.keys import BlockKey

if TYPE_CHECKING:
    from vllm_kvtier.ops.instance_replay import Instance

ROUTERS = ("round-robin", "session", "prefix")
#: A block followed by at least this many different next blocks over the trace is a shared
#: prefix (a system prompt, a shared document), not the start of one conversation.
DEFAULT_SESSION_FANOUT = 8
#: Blocks from the start of a prompt examined for the session key (a longer shared prefix
#: keys the session on its last examined block).
SESSION_DEPTH = 64
#: Requests in flight above the fleet's mean past which the prefix router passes an
#: instance over (an additive bound: at light load a ratio to a mean below one would
#: exclude every busy holder).
DEFAULT_MAX_IMBALANCE = 4.0


@dataclass
class RouterView:
    """What a router knows when it routes: the instances, their requests in flight, and
    the requests each was sent so far."""

    instances: Sequence[Instance]
    in_flight: list[int]
    routed: list[int]

    def least_loaded(self, among: Sequence[int] | None = None) -> int:
        """The instance with the fewest requests in flight; among equals, the one sent the
        fewest so far (at light load most instances are idle: the lowest number would take
        every new conversation)."""
        pool = range(len(self.in_flight)) if among is None else among
        return min(pool, key=lambda j: (self.in_flight[j], self.routed[j], j))


class Router(Protocol):
    name: str

    def route(self, i: int, keys: Sequence[BlockKey], view: RouterView) -> int:
        """The instance (0..N-1) that serves request ``i`` of prompt blocks ``keys``."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, i: int, keys: Sequence[BlockKey], view: RouterView) -> int:
        j = self._next % len(view.in_flight)
        self._next += 1
        return j


def session_keys(traces_keys: Sequence[Sequence[BlockKey]], fanout: int = DEFAULT_SESSION_FANOUT) -> list[BlockKey]:
    """Each request's conversation: the block after the prompt's last branch point.

    A branch point is a block followed over the whole trace by at least ``fanout``
    distinct blocks that later prompts extend. A prompt's last block is left out: a
    partial tail is never extended. A system prompt or a shared document ends at a branch
    point. A conversation's own blocks are followed by the same block turn after turn. No
    branch point: the prompt's first block. One pass; memory: up to ``fanout`` ids per
    block of the first :data:`SESSION_DEPTH` positions."""
    nexts: dict[BlockKey, set[BlockKey]] = {}
    for keys in traces_keys:
        for p in range(min(len(keys) - 2, SESSION_DEPTH)):
            s = nexts.setdefault(keys[p], set())
            if len(s) < fanout:
                s.add(keys[p + 1])
    out = []
    for keys in traces_keys:
        head = keys[: SESSION_DEPTH + 1]
        cut = max((p for p in range(min(len(head), SESSION_DEPTH)) if len(nexts.get(head[p], ())) >= fanout),
                  default=-1)
        out.append(head[min(cut + 1, len(head) - 1)] if head else BlockKey(b""))
    return out


class Session:
    name = "session"

    def __init__(self, keys: Sequence[BlockKey]) -> None:
        """``keys``: each request's conversation (:func:`session_keys`)."""
        self._keys = keys
        self._home: dict[BlockKey, int] = {}

    def route(self, i: int, keys: Sequence[BlockKey], view: RouterView) -> int:
        s = self._keys[i]
        j = self._home.get(s)
        if j is None:
            j = self._home[s] = view.least_loaded()
        return j


class Prefix:
    name = "prefix"

    def __init__(self, max_imbalance: float = DEFAULT_MAX_IMBALANCE) -> None:
        if not max_imbalance > 0:
            raise ValueError(f"max_imbalance must be > 0, got {max_imbalance}")
        self.max_imbalance = max_imbalance
        #: requests sent elsewhere than to the longest holder by the load bound
        self.overridden = 0

    def route(self, i: int, keys: Sequence[BlockKey], view: RouterView) -> int:
        n = len(view.in_flight)
        bound = sum(view.in_flight) / n + self.max_imbalance
        eligible = [j for j in range(n) if view.in_flight[j] < bound]
        held = [view.instances[j].holds_prefix(keys) for j in range(n)]
        best = max(held[j] for j in eligible)
        if max(held) > best:
            self.overridden += 1
        if best == 0:
            return view.least_loaded(eligible)
        return view.least_loaded([j for j in eligible if held[j] == best])


def make_router(name: str, traces_keys: Sequence[Sequence[BlockKey]], *, max_imbalance: float = DEFAULT_MAX_IMBALANCE,
                session_fanout: int = DEFAULT_SESSION_FANOUT) -> Router:
    """The router ``name`` (:data:`ROUTERS`) for a trace of prompts ``traces_keys``."""
    if name == "round-robin":
        return RoundRobin()
    if name == "session":
        return Session(session_keys(traces_keys, session_fanout))
    if name == "prefix":
        return Prefix(max_imbalance)
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
