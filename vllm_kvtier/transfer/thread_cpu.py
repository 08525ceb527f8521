"""CPU time of the plugin's own threads, by tier (``background_cpu_seconds``).

Who calls it: :meth:`~vllm_kvtier.transfer.worker.WorkerHalf.stats`, every step, from the
worker's main thread. It samples at most once per ``interval_s``. What the plugin costs on
the engine's own thread is ``step_seconds``. This is the rest. The copy thread (saves into
the CPU tier, and its memmove helpers) counts under tier ``cpu``. Each tier's I/O threads
(``kvtier-<tier>-<n>``) count under their tier. On a host whose cores are all busy, that
time is taken from the engine (the API server, the scheduler, a CPU forward). So an
operator sizing a pod's CPU request reads it here. So does a benchmark judging a cost
below its noise.

The figures are the kernel's per-thread accounting (``/proc/self/task/<tid>/stat``, user
plus system time, in clock ticks). Linux only: elsewhere nothing is counted. Native threads
of libraries are not in it (NIXL, Mooncake's transfer engine, the kernel's own writeback).
A thread that ends between two samples loses its time since the last one. There is one
sampler per process (:data:`SAMPLER`). So two worker halves in one process (a test, the
single-process executor) never count a thread twice.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable

from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters

#: ``kvtier-<word>...`` thread names -> the tier their time is counted under
_HOST_COPY = {"copy": TierName.CPU, "memmove": TierName.CPU}
_TIERS = {str(t): t for t in (TierName.NVME, TierName.S3, TierName.MOONCAKE, TierName.PEER)}
_NAME = re.compile(r"kvtier-([a-z0-9]+)")


def tier_of_thread(name: str) -> str | None:
    """The tier a plugin thread's CPU time is counted under, or None (not ours)."""
    m = _NAME.match(name)
    if m is None:
        return None
    word = m.group(1)
    tier = _HOST_COPY.get(word) or _TIERS.get(word)
    return None if tier is None else str(tier)


_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def task_cpu_seconds(native_id: int) -> float | None:
    """User plus system CPU seconds of this process's thread ``native_id``, or None (it
    ended, or no /proc)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "tid (comm) state ...": comm may hold spaces and parentheses; fields 14, 15 are
    # utime and stime, the 12th and 13th after the last ')'
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return (int(fields[11]) + int(fields[12])) * _TICK_S
    except (IndexError, ValueError):
        return None


class ThreadCPU:
    def __init__(self, *, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 threads: Callable[[], list[threading.Thread]] = threading.enumerate) -> None:
        """``threads``: the threads to look at (all of the process's by default)."""
        self.interval_s = interval_s
        self._clock = clock
        self._threads = threads
        self._lock = threading.Lock()
        self._next = -float("inf")
        #: native thread id -> (tier, CPU seconds counted so far)
        self._seen: dict[int, tuple[str, float]] = {}

    def sample(self, counters: Counters) -> None:
        """Add to ``counters`` the CPU time the plugin's threads used since the last
        sample (nothing when the last one is under ``interval_s`` old)."""
        now = self._clock()
        with self._lock:
            if now < self._next:
                return
            self._next = now + self.interval_s
            seen: dict[int, tuple[str, float]] = {}
            for t in self._threads():
                tier = tier_of_thread(t.name)
                if tier is None or t.native_id is None:
                    continue
                secs = task_cpu_seconds(t.native_id)
                if secs is None:
                    continue
                before = self._seen.get(t.native_id)
                # a new thread counts from its start; a thread id reused by a new thread
                # (less time than the old one had) counts from the new thread's start
                delta = secs if before is None or before[0] != tier or secs < before[1] else secs - before[1]
                if delta > 0:
                    counters.add(CounterName.BACKGROUND_CPU_SECONDS, tier, delta)
                seen[t.native_id] = (tier, secs)
            self._seen = seen


#: the process's sampler (see the module doc)
SAMPLER = ThreadCPU()
