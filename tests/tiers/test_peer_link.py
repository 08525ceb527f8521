"""The decode side's NIXL peers (issue 13): only allowed agents are read, and remote agents
do not pile up: removed once idle for ``nixl.hold_s``, and at most ``nixl.max_peers`` kept.
Real NIXL agents over UCX on loopback, two P/D ``PeerLink`` s (prefill and decode) in
this process, each with its own CPU pool."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from vllm_kvtier.config import NixlConfig, NixlTierConfig
from vllm_kvtier.jobs import PeerRead
from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.cpu import CPUPool

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12")),
                       reason="nixl is not installed (run tools/setup-remote.sh)"),
]

PLANES = (4096, 4096)
KEY = bytes(range(32))


@pytest.fixture(autouse=True)
def _ucx_env(monkeypatch):
    monkeypatch.setenv("UCX_MODULES", "^ib")  # no RDMA NIC here (see tiers/nixl/agent.py)
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def link(name: str, clock=time.monotonic, **nixl):
    from vllm_kvtier.transfer.peer import PeerLink

    cfg = NixlTierConfig(NixlConfig(deadline_s=10.0), agent_name=name, **nixl)
    counters = Counters()
    return PeerLink(cfg, CPUPool(4, PLANES, pin=False, prefault=False), rank=0, counters=counters, clock=clock), \
        counters


def offered(prefill) -> dict:
    """Slot 1 of ``prefill`` holds KEY (bytes 7s) and is stamped."""
    for p in prefill.pool.planes:
        p[1].fill_(7)
    prefill.stamp(1, KEY)
    return {"ranks": {"0": prefill.describe()}}


def read(decode, prefill, peer: dict, req: str = "r"):
    """Read slot 1 of the peer into our slot 2; the result (None: refused)."""
    rid = decode.read(PeerRead(req, peer, (1,), (2,), (KEY,), notify=req))
    if rid is None:
        return None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        prefill.done_requests()  # progresses the serving side too (no progress thread)
        for got_id, res in decode.poll():
            assert got_id == rid
            return res
        time.sleep(0.002)
    raise AssertionError("the read did not finish")


def test_an_allowed_peer_is_read_then_removed_once_idle_for_hold_s():
    clock = Clock()
    prefill, _ = link("prefill")
    decode, counters = link("decode", clock, allowed_peers=("prefill-*",), hold_s=30.0)
    try:
        res = read(decode, prefill, offered(prefill))
        assert res is not None and res.good == {KEY}
        assert all(bool((p[2] == 7).all()) for p in decode.pool.planes)
        assert decode.peers() == [prefill.agent.name]
        clock.now += 29.0
        assert decode.expire_peers() == [] and decode.peers() == [prefill.agent.name]
        clock.now += 2.0  # idle for more than hold_s: its offers have expired
        decode.poll()
        assert decode.peers() == [] and decode.agent.peers() == []
        assert counters.totals["peers_removed|peer"] == 1
        # Gone is not forgotten for good: a new offer from it connects again.
        res = read(decode, prefill, offered(prefill), "r2")
        assert res is not None and res.good == {KEY} and decode.peers() == [prefill.agent.name]
    finally:
        decode.close()
        prefill.close()


def test_an_agent_not_allowed_is_never_added():
    prefill, _ = link("rogue")
    decode, counters = link("decode", allowed_peers=("prefill-*",))
    try:
        decode.pool.planes[0][2].zero_()  # fresh pool memory may hold an earlier test's bytes
        assert read(decode, prefill, offered(prefill)) is None
        assert decode.peers() == [] and decode.agent.peers() == []
        assert counters.totals["peer_refusals|peer"] == 1 and counters.totals["load_failures|peer"] == 1
        assert not bool((decode.pool.planes[0][2] == 7).all())
    finally:
        decode.close()
        prefill.close()


def test_max_peers_bounds_the_connected_agents():
    one, _ = link("prefill")
    two, _ = link("prefill")
    decode, counters = link("decode", allowed_peers=("prefill-*",), max_peers=1)
    try:
        assert read(decode, one, offered(one)).good == {KEY}
        assert read(decode, two, offered(two), "r2").good == {KEY}  # the idle first one makes room
        assert decode.peers() == [two.agent.name] and decode.agent.peers() == [two.agent.name]
        assert counters.totals["peers_removed|peer"] == 1
    finally:
        decode.close()
        one.close()
        two.close()


def test_pool_bytes_are_what_the_peer_holds():
    """The read moves the peer's bytes (not only the stamp): a guard on the fixture."""
    prefill, _ = link("prefill")
    decode, _ = link("decode", allowed_peers=("prefill-*",))
    try:
        peer = offered(prefill)
        prefill.pool.planes[1][1].copy_(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
        assert read(decode, prefill, peer).good == {KEY}
        assert torch.equal(decode.pool.planes[1][2], prefill.pool.planes[1][1])
    finally:
        decode.close()
        prefill.close()
