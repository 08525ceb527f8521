"""The trust boundary's small parts (plan/request_params.py), on plain values: which agents
an offer may come from, the pin TTL a request gets, and the ignored-parameter counter's
once-per-request counting and once-a-minute warnings."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from vllm_kvtier.config import CPUTierConfig, NixlConfig, NixlTierConfig
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.request_params import IgnoredParams, PeerTrust, peer_trust, request_pin_ttl_s


def nixl(**kw) -> NixlTierConfig:
    return NixlTierConfig(NixlConfig(), **kw)


def test_peer_trust_needs_every_rank_to_match():
    cfg = nixl(allowed_peers=("prefill-*",), trusted_peers=("prefill-a-*",))
    assert peer_trust(["prefill-a-1-r0", "prefill-a-1-r1"], cfg) is PeerTrust.TRUSTED
    assert peer_trust(["prefill-a-1-r0", "prefill-b-1-r1"], cfg) is PeerTrust.PRIVATE
    assert peer_trust(["prefill-a-1-r0", "rogue-r1"], cfg) is PeerTrust.REFUSED
    assert peer_trust([], cfg) is PeerTrust.REFUSED
    assert peer_trust(["prefill-a-1-r0"], nixl()) is PeerTrust.REFUSED  # default: nobody
    assert peer_trust(["x-r0"], nixl(trusted_peers=("x-*",))) is PeerTrust.TRUSTED  # trusted implies allowed
    assert not nixl(allowed_peers=("Prefill-*",)).allows_peer("prefill-1-r0")  # case matters


def req(params, rid="r1"):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params)


def test_pin_ttl_is_off_capped_or_refused():
    c = Counters()
    ignored = IgnoredParams(c)
    on = CPUTierConfig(request_pins=True, max_pin_ttl_s=600)
    assert request_pin_ttl_s(req(None), on, ignored) is None
    assert request_pin_ttl_s(req({"other": 1}), on, ignored) is None
    assert request_pin_ttl_s(req({"kvtier_pin_ttl_s": 30}), on, ignored) == 30.0
    assert request_pin_ttl_s(req({"kvtier_pin_ttl_s": 1e9}, "r2"), on, ignored) == 600
    for i, bad in enumerate((0, -5, True, "60", float("nan"), None)):
        assert request_pin_ttl_s(req({"kvtier_pin_ttl_s": bad}, f"b{i}"), on, ignored) is None
    assert request_pin_ttl_s(req({"kvtier_pin_ttl_s": 30}, "off"), CPUTierConfig(), ignored) is None
    assert c.totals["request_params_capped|cpu"] == 1 and c.totals["request_params_ignored|cpu"] == 7


def test_a_request_counts_once_and_warnings_are_rate_limited(caplog):
    now = [0.0]
    c = Counters()
    ignored = IgnoredParams(c, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="vllm_kvtier"):
        for i in range(5):
            ignored.ignore("kvtier_peer", "peer", f"r{i}", "not allowed")
            ignored.ignore("kvtier_peer", "peer", f"r{i}", "not allowed")  # asked again: not recounted
        ignored.ignore("kvtier_pin_ttl_s", "cpu", "r0", "off")  # another parameter warns on its own
        now[0] = 61.0
        ignored.ignore("kvtier_peer", "peer", "r9", "not allowed")
    lines = [r.getMessage() for r in caplog.records]
    assert c.totals["request_params_ignored|peer"] == 6 and c.totals["request_params_ignored|cpu"] == 1
    assert len(lines) == 3
    assert "request r0" in lines[0] and "kvtier_pin_ttl_s" in lines[1]
    assert "request r9" in lines[2] and "4 more like it" in lines[2]
