"""The sections on what is loaded and when: ``load_or_recompute``, ``prefetch`` and
``schedule`` (the order in which waiting requests are admitted)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm_kvtier.config.checks import at_least, at_most, in_range, positive
from vllm_kvtier.config.stores import check_bounds
from vllm_kvtier.errors import ConfigError


@dataclass(frozen=True)
class LoadOrRecomputeConfig:
    """For hits below the CPU tier: load only the part of the prefix that is faster to
    read than to compute again.

    It weighs the measured tier bandwidth and latency against the measured prefill rate.
    Both are kept up to date at run time. CPU hits are always loaded."""

    enabled: bool = True
    #: Starting estimate of the prefill rate; None: 5000 tokens/s until measured.
    prefill_tokens_per_s: float | None = None
    #: A tier not read from for this long gets one load anyway, to measure it again.
    probe_interval_s: float = 30.0
    #: False: ``prefill_tokens_per_s`` is the prefill rate, never re-measured (a known
    #: rate of this model on this accelerator, steadier than one timed from mixed steps;
    #: or a test that must not depend on the machine's speed). Needs prefill_tokens_per_s.
    measure_prefill: bool = True


    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s is not None:
            positive("load_or_recompute.prefill_tokens_per_s", self.prefill_tokens_per_s)
        at_least("load_or_recompute.probe_interval_s", self.probe_interval_s, 0)
        if not self.measure_prefill and self.prefill_tokens_per_s is None:
            raise ConfigError("load_or_recompute.measure_prefill",
                              "false needs load_or_recompute.prefill_tokens_per_s (the rate to use)")
        check_bounds("load_or_recompute", self, durations=("probe_interval_s",))


@dataclass(frozen=True)
class PrefetchConfig:
    """Promote a conversation's blocks that left DRAM back into it when its request ends.

    This is ahead of the next turn, and only with a tier below CPU."""

    enabled: bool = True
    #: Promotions in flight at most (a bandwidth and memory budget).
    max_inflight_blocks: int = 256
    #: A queued prefetch older than this is dropped.
    max_age_s: float = 30.0


    def __post_init__(self) -> None:
        at_least("prefetch.max_inflight_blocks", self.max_inflight_blocks, 1)
        at_least("prefetch.max_age_s", self.max_age_s, 0)
        check_bounds("prefetch", self, durations=("max_age_s",))
        at_most("prefetch.max_inflight_blocks", self.max_inflight_blocks, 1 << 20)


#: ``schedule.max_wait_s`` at most: a bound on unfairness, not a way to park requests.
MAX_SCHEDULE_WAIT_S = 60.0


@dataclass(frozen=True)
class ScheduleConfig:
    """The order in which vLLM admits waiting requests, as far as a connector can change it.

    Its lookup may answer "not yet" for a request. vLLM's scheduler then looks at the next
    one in its queue. "short-first" passes over a request with more than ``short_tokens``
    left to compute after its hits. It does so while one with at most that many waits in
    the queue, up to ``max_wait_s`` a request. So a request whose prefix is stored does not
    wait for KV space or its turn behind a long prefill. The long one waits the short one's
    step more (bounded). Off by default. On the production trace measured
    (docs/benchmarks.md) it cut the short requests' wait and their mean TTFT. It raised the
    long ones' tail, and left the mean where it was."""

    #: "fifo": vLLM's order (arrival) untouched. "short-first": as above.
    order: Literal["fifo", "short-first"] = "fifo"
    #: A request with at most this many tokens to compute after its hits (vLLM's prefix
    #: cache and the tiers) is short: it is never passed over, and it is what the others
    #: make way for.
    short_tokens: int = 256
    #: Once a request was first passed over this long ago, its next lookup admits it in
    #: vLLM's order whatever waits behind it (the bound: this plus up to one step). Also
    #: how long a short request not looked up again holds the others back.
    max_wait_s: float = 0.5

    def __post_init__(self) -> None:
        in_range("schedule.short_tokens", self.short_tokens, 1, 1 << 24)
        in_range("schedule.max_wait_s", self.max_wait_s, 0, MAX_SCHEDULE_WAIT_S)
