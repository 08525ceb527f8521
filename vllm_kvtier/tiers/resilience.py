"""Retries with jittered exponential backoff under a deadline, and a circuit breaker.

Used by the object-store tier (:mod:`vllm_kvtier.tiers.s3.medium`). Nothing here knows
about S3, so it is tested with a fake clock and plain exceptions.

Who calls it: the store's I/O threads, concurrently. :class:`CircuitBreaker` is thread-safe
(one lock, held for a few comparisons). :func:`call_with_retries` blocks its calling
thread for at most the deadline plus one attempt. An attempt already on the wire is
bounded by the client's own socket timeouts, not by us.

Why a breaker: when an endpoint is down, every request otherwise spends its whole deadline
in connect timeouts and backoff. With the breaker open, requests fail at once (a miss, and
the engine recomputes). After a cool-down a single probe request decides whether traffic
resumes. So a dead endpoint costs one request per cool-down instead of one per block.
"""

from __future__ import annotations

import enum
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class BreakerState(enum.IntEnum):
    """Circuit breaker state; the int value is what a gauge exports."""

    CLOSED = 0  # requests flow
    HALF_OPEN = 1  # one probe request is allowed; its outcome closes or reopens
    OPEN = 2  # requests fail at once until the cool-down has passed


class BreakerOpen(Exception):
    """Raised by :func:`call_with_retries` when the breaker refuses a request."""


class DeadlineExceeded(Exception):
    """The deadline passed before an attempt could start (no request was sent for it)."""


@dataclass(frozen=True)
class BreakerSnapshot:
    state: BreakerState
    consecutive_failures: int
    #: times the breaker went from closed or half-open to open
    opens: int
    #: requests refused while open (or while a half-open probe was in flight)
    rejected: int


@dataclass(frozen=True)
class RemoteStats:
    """What a remote store (S3, Mooncake) did so far, for metrics and benchmarks."""

    #: Requests sent, by operation name (S3: every HTTP attempt; Mooncake: client calls,
    #: a batch counting once).
    requests: dict[str, int]
    #: Attempts retried after a transient failure (Mooncake never retries: a failed read
    #: is a miss and the engine recomputes).
    retries: int
    #: Failed jobs (reads, writes, deletes), by reason.
    failures: dict[str, int]
    breaker: BreakerSnapshot


class CircuitBreaker:
    """Opens after ``failures`` consecutive failed requests; after ``cooldown_s`` lets one
    probe through (half-open); the probe's success closes it, its failure reopens it.

    Every request that :meth:`allow` let through must end in exactly one
    :meth:`record_success` or :meth:`record_failure`. A failure is a sign the endpoint is
    unhealthy (5xx, throttling, timeout, connection refused); an answer that is the
    caller's problem (404, 403, bad request) is a success for the breaker.
    """

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or cooldown_s < 0:
            raise ValueError(f"need failures >= 1 and cooldown_s >= 0, got {failures}, {cooldown_s}")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probe_in_flight = False
        self._opens = 0
        self._rejected = 0

    @property
    def state(self) -> BreakerState:
        """The current state; an open breaker whose cool-down has passed reads HALF_OPEN."""
        with self._lock:
            if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                return BreakerState.HALF_OPEN
            return self._state

    def snapshot(self) -> BreakerSnapshot:
        state = self.state
        with self._lock:
            return BreakerSnapshot(state, self._consecutive, self._opens, self._rejected)

    def allow(self) -> bool:
        """May a request be sent now? Never blocks."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                self._state = BreakerState.HALF_OPEN
            if self._state is BreakerState.HALF_OPEN and not self._probe_in_flight:
                self._probe_in_flight = True
                return True
            self._rejected += 1
            return False

    def record_success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._consecutive = 0
            self._probe_in_flight = False

    def record_failure(self) -> None:
        with self._lock:
            self._consecutive += 1
            probe_failed = self._state is BreakerState.HALF_OPEN and self._probe_in_flight
            if probe_failed or (self._state is BreakerState.CLOSED and self._consecutive >= self.failures):
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
                self._opens += 1
            self._probe_in_flight = False


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max, base * 2**attempt)], so clients that failed
        together (a throttled prefix) do not retry together."""
        return rng.uniform(0.0, min(self.backoff_max_s, self.backoff_base_s * (2**attempt)))


def call_with_retries(
    fn: Callable[[], T],
    *,
    transient: Callable[[BaseException], bool],
    policy: RetryPolicy,
    breaker: CircuitBreaker,
    deadline: float,
    rng: random.Random,
    on_retry: Callable[[BaseException], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``fn`` until it succeeds, fails with a non-transient error, has been tried
    ``policy.max_attempts`` times, the breaker refuses, or the next attempt could not start
    before ``deadline`` (a ``clock()`` time). Raises the last error (or :class:`BreakerOpen`,
    :class:`DeadlineExceeded` if no attempt was made at all)."""
    last: BaseException | None = None
    for attempt in range(policy.max_attempts):
        if clock() >= deadline:
            break
        if not breaker.allow():
            if last is not None:
                raise last
            raise BreakerOpen()
        try:
            result = fn()
        except Exception as e:
            if not transient(e):
                breaker.record_success()  # the endpoint answered; the request was the problem
                raise
            breaker.record_failure()
            last = e
            if attempt + 1 >= policy.max_attempts:
                break
            delay = policy.delay_s(attempt, rng)
            if clock() + delay >= deadline:
                break
            if on_retry is not None:
                on_retry(e)
            sleep(delay)
            continue
        breaker.record_success()
        return result
    if last is not None:
        raise last
    raise DeadlineExceeded()
