"""Load or recompute on a real vLLM engine, driven by a controlled S3 tier: the same
objects behind a fault proxy that answers at once (fast: the planner loads) or holds each
request 5 s (slow: after measuring one slow load, the planner recomputes). Tokens equal
the run without the plugin either way.

Both outcomes hold at any machine speed: the prefill rate is pinned
(``load_or_recompute.measure_prefill: false``), so recomputing a prompt's 10 blocks is
estimated at 2 s everywhere, and the tiers sit two orders of magnitude apart around it: a
read through the passing proxy takes milliseconds (the decision flips only past ~1.8 s),
one through the delaying proxy at least 5 s whatever the machine (a slower machine only
makes it slower). The first load of each engine is decided on the built-in S3 prior
(30 ms + 100 MB/s: 0.04 s for 10 blocks), so it loads in both cases; the slow case's
decision is the one after it, made on that first measured load."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit import s3_server as s3srv
from testkit.s3_server import FaultProxy
from tests.conftest import close_llm, generate, kvtier_counters, make_llm
from tests.integration import test_nvme_engine as nvme_engine
from tests.integration.test_nvme_engine import SETS, run_engine
from tests.integration.test_s3_engine import LOADABLE, s3_config

s3_server = s3srv.s3_server
s3_bucket = s3srv.s3_bucket
baseline_of = nvme_engine.baseline_of

pytestmark = pytest.mark.s3

#: Pinned: a 10-block (320-token) prompt recomputes in 2 s by the estimate, on any machine.
PREFILL_TOKENS_PER_S = 160.0
#: Each request through the slow proxy waits this long before it is forwarded.
DELAY_S = 5.0


def policy_config(endpoint: str, bucket: str) -> dict:
    """CPU + S3 (through ``endpoint``) with load-or-recompute on, the prefill rate pinned,
    no probes during the test, and S3 timeouts above the proxy's delay (slow, not failing)."""
    kv = s3_config(endpoint, bucket, deadline_s=30.0, read_timeout_s=30.0)
    kv["kv_connector_extra_config"]["load_or_recompute"] = {
        "enabled": True, "prefill_tokens_per_s": PREFILL_TOKENS_PER_S, "measure_prefill": False,
        "probe_interval_s": 3600,
    }
    return kv


def serve_through_proxy(model: Path, s3_url: str, bucket: str, ps: list[list[int]],
                        delay_s: float) -> list[tuple[list[int], dict[str, float]]]:
    """An engine (in this process) reading ``bucket`` through a fault proxy: it starts
    with the proxy passing (the start-up scan indexes the objects), then the proxy delays
    every request by ``delay_s`` while ``ps`` are served one after the other. Per prompt:
    (tokens, the counters' change while it was served)."""
    proxy = FaultProxy(s3_url)
    try:
        llm = make_llm(model, policy_config(proxy.url, bucket))
        try:
            if delay_s > 0:
                proxy.delay(delay_s)
            rows = []
            for p in ps:
                before = kvtier_counters(llm)
                tokens = generate(llm, p).tokens
                after = kvtier_counters(llm)
                rows.append((tokens, {k: after.get(k, 0) - before.get(k, 0) for k in after}))
            proxy.passthrough()  # a quick shutdown
        finally:
            close_llm(llm)
    finally:
        proxy.close()
    return rows


@pytest.fixture(scope="module")
def stored_bucket(tiny_model, s3_server) -> str:
    """A bucket holding both prompts of ``SETS[2]``, stored by an engine closed since. Both tests
    read it; what an engine here adds (the same chunks, its manifest) changes no decision."""
    bucket = s3_server.create_bucket()
    run_engine(tiny_model, s3_config(s3_server.url, bucket), SETS[2])
    return bucket


def test_fast_tier_is_loaded(tiny_model, baseline_of, s3_server, stored_bucket):
    """Reads answered at once: both prompts load every loadable block from S3 (the first
    on the prior, the second on the measured first load), nothing is recomputed."""
    ps = SETS[2]
    rows = serve_through_proxy(tiny_model, s3_server.url, stored_bucket, ps, delay_s=0.0)
    for p, (tokens, d) in zip(ps, rows, strict=True):
        assert tokens == baseline_of(p)
        assert d.get("blocks_loaded|s3", 0) == LOADABLE, d
        assert d.get("recompute_chosen_blocks|s3", 0) == 0, d


def test_slow_tier_is_recomputed(tiny_model, baseline_of, s3_server, stored_bucket):
    """Reads held 5 s each: the first prompt loads (decided on the prior) and is measured
    slow; the second finds all its blocks in S3 and recomputes them instead, loading none
    from S3, with the baseline's tokens. The slow load did not fail: it was slow."""
    ps = SETS[2]
    rows = serve_through_proxy(tiny_model, s3_server.url, stored_bucket, ps, delay_s=DELAY_S)
    (t0, first), (t1, second) = rows
    assert t0 == baseline_of(ps[0]) and t1 == baseline_of(ps[1])
    assert first.get("blocks_loaded|s3", 0) == LOADABLE and first.get("load_failures|s3", 0) == 0, first
    assert second.get("recompute_chosen_blocks|s3", 0) == LOADABLE, second
    assert second.get("blocks_loaded|s3", 0) == 0 and second.get("load_probes|all", 0) == 0, second
