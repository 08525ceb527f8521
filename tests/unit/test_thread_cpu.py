"""The CPU time of the plugin's own threads (``background_cpu_seconds``), read from the
kernel's per-thread accounting."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from vllm_kvtier.metrics import Counters
from vllm_kvtier.transfer.thread_cpu import ThreadCPU, task_cpu_seconds, tier_of_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


class _Burner:
    """A thread of the given name that uses ``cpu_s`` of CPU, then waits to be let go
    (so it is alive when sampled)."""

    def __init__(self, name: str, cpu_s: float) -> None:
        self.burnt = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(cpu_s,), name=name, daemon=True)
        self.thread.start()

    def _run(self, cpu_s: float) -> None:
        t0 = time.thread_time()
        x = 0
        while time.thread_time() - t0 < cpu_s:
            x += 1
        self.burnt.set()
        self.release.wait(60)

    def stop(self) -> None:
        self.release.set()
        self.thread.join(60)


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_tier_of_the_plugins_thread_names() -> None:
    # the names the plugin gives its threads (copier.py, kernel.py, catalog/, lower.py)
    assert tier_of_thread("kvtier-copy_0") == "cpu"
    assert tier_of_thread("kvtier-memmove_1") == "cpu"
    assert tier_of_thread("kvtier-nvme-3") == "nvme"
    assert tier_of_thread("kvtier-s3-0") == "s3"
    assert tier_of_thread("kvtier-s3-scan_2") == "s3"
    assert tier_of_thread("kvtier-mooncake-lookup_0") == "mooncake"
    assert tier_of_thread("kvtier-mooncake-lookup") == "mooncake"
    assert tier_of_thread("kvtier-s3-rescan") == "s3"
    for other in ("MainThread", "Thread-3 (worker)", "kvtier-unknown-0", "xkvtier-nvme-0"):
        assert tier_of_thread(other) is None


def test_counts_each_plugin_threads_time_once_under_its_tier() -> None:
    clock = _Clock()
    mine: list[threading.Thread] = []
    # only this test's threads (others' daemon threads may still run in this process)
    sampler = ThreadCPU(interval_s=1.0, clock=clock, threads=lambda: [t for t in mine if t.is_alive()])
    nvme, copy, other = (_Burner("kvtier-nvme-0", 0.3), _Burner("kvtier-copy_0", 0.2),
                         _Burner("not-ours", 0.3))
    mine += [nvme.thread, copy.thread, other.thread]
    try:
        for b in (nvme, copy, other):
            assert b.burnt.wait(60)
        c = Counters()
        sampler.sample(c)
        got = dict(c.totals)
        # the kernel counts in clock ticks (10 ms here); the thread also ran before its clock started
        assert 0.25 <= got["background_cpu_seconds|nvme"] <= 0.6, got
        assert 0.15 <= got["background_cpu_seconds|cpu"] <= 0.5, got
        assert set(got) == {"background_cpu_seconds|nvme", "background_cpu_seconds|cpu"}, got

        # within the interval: not sampled again
        more = _Burner("kvtier-nvme-1", 0.1)
        mine.append(more.thread)
        assert more.burnt.wait(60)
        sampler.sample(c)
        assert dict(c.totals) == got
        # after it: only the new time (the first two threads are idle since)
        clock.t += 1.0
        sampler.sample(c)
        added = c.totals["background_cpu_seconds|nvme"] - got["background_cpu_seconds|nvme"]
        assert 0.05 <= added <= 0.3, (added, dict(c.totals))
        assert c.totals["background_cpu_seconds|cpu"] - got["background_cpu_seconds|cpu"] <= 0.02
        more.stop()
    finally:
        for b in (nvme, copy, other):
            b.stop()
    # a thread that ended is skipped, never an error
    assert task_cpu_seconds(nvme.thread.native_id or 0) is None
    ended = ThreadCPU(interval_s=1.0, clock=clock, threads=lambda: [nvme.thread])
    ended.sample(c)
    assert c.totals["background_cpu_seconds|nvme"] == pytest.approx(got["background_cpu_seconds|nvme"] + added)
