"""The trust boundary on a request's ``kv_transfer_params`` (issue 13), with vLLM's real
``Scheduler`` and our connector in the SCHEDULER role (``sched_helpers``): the parameters
arrive as a client's do (``SamplingParams.extra_args``), each feature is ignored and
counted unless the config enables it, and limited when it does; an untrusted peer's blocks
serve their request only."""

from __future__ import annotations

import logging
import time

from vllm.v1.request import RequestStatus

from tests.sched_helpers import (
    BLOCK_SIZE,
    FakeWorker,
    all_loads,
    all_saves,
    assert_scheduler_empty,
    block_bytes,
    free_blocks,
    make_request,
    make_scheduler,
    make_vllm_config,
    prompt_tokens,
    sched_half,
)
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.plan.inputs import WorkerOutput

BS = BLOCK_SIZE
CPU = {"capacity_bytes": 64 * block_bytes()}


def new_scheduler(model_dir, extra):
    sched = make_scheduler(make_vllm_config(model_dir, extra), num_blocks=128)
    if "nixl" in extra:  # the worker's first report: where its CPU tier is (unused here)
        sched_half(sched).planner.on_worker_output(WorkerOutput(report=WorkerReport(peer_info={0: {"planes": []}})))
    return sched, free_blocks(sched)


def counter(sched, name: str, tier: str) -> float:
    return sched_half(sched).planner.counters.totals.get(f"{name}|{tier}", 0)


def run(sched, worker, req_id, prompt, params=None, max_tokens=1):
    req = make_request(req_id, prompt, max_tokens=max_tokens, kv_transfer_params=params)
    sched.add_request(req)
    worker.run_until_idle(sched)
    return req


# ---- pins -----------------------------------------------------------------------------------


def test_a_client_pin_is_ignored_and_counted_unless_enabled(tiny_model, caplog):
    sched, initial = new_scheduler(tiny_model, {"cpu": CPU})
    half, worker = sched_half(sched), FakeWorker()
    prompt = prompt_tokens(4 * BS + 1)
    with caplog.at_level(logging.WARNING, logger="vllm_kvtier"):
        run(sched, worker, "a", prompt, {"kvtier_pin_ttl_s": 604800})
        run(sched, worker, "b", prompt_tokens(4 * BS + 1, seed=1), {"kvtier_pin_ttl_s": 604800})
    assert half.planner.index.pinned_keys == 0
    assert all(not half.planner.index.key_pinned(BlockKey(h)) for h in make_request("p", prompt).block_hashes)
    assert counter(sched, "request_params_ignored", "cpu") == 2
    warned = [r for r in caplog.records if "kvtier_pin_ttl_s ignored" in r.getMessage()]
    assert len(warned) == 1 and "cpu.request_pins is off" in warned[0].getMessage()  # once a minute
    assert all_saves(worker.metas, "a")  # the request itself is served and stored as usual
    assert_scheduler_empty(sched, initial)


def test_an_enabled_pin_is_capped_at_max_pin_ttl_s(tiny_model):
    sched, initial = new_scheduler(tiny_model, {"cpu": {**CPU, "request_pins": True, "max_pin_ttl_s": 60}})
    half, worker = sched_half(sched), FakeWorker()
    prompt = prompt_tokens(4 * BS + 1)
    run(sched, worker, "a", prompt, {"kvtier_pin_ttl_s": 604800})
    keys = [BlockKey(h) for h in make_request("p", prompt).block_hashes[:4]]
    assert all(half.planner.index.key_pinned(k) for k in keys) and half.planner.index.pinned_keys == 4
    assert counter(sched, "request_params_capped", "cpu") == 1
    assert counter(sched, "request_params_ignored", "cpu") == 0
    # Capped, not kept for a week: each pin lapses within max_pin_ttl_s.
    now = time.monotonic()
    assert all(now < half.planner.index.pin_deadline(k) <= now + 60 for k in keys)
    run(sched, worker, "b", prompt_tokens(4 * BS + 1, seed=2), {"kvtier_pin_ttl_s": "forever"})
    assert counter(sched, "request_params_ignored", "cpu") == 1  # malformed: ignored
    assert_scheduler_empty(sched, initial)


# ---- NIXL peer offers -----------------------------------------------------------------------


def offer(prompt, agent: str, n: int) -> dict:
    """What a prefill instance whose agent is ``agent`` would answer for ``prompt``: its
    first ``n`` blocks in its slots 10.. (shape of ``kvtier_peer``)."""
    hashes = make_request("p", prompt).block_hashes[:n]
    desc = {"agent": {"name": agent, "metadata": "AAAA", "regions": [[4096, 1 << 20]]},
            "planes": [[8192, 4096]], "stamps": 65536}
    return {"do_remote_prefill": True,
            "kvtier_peer": {"ranks": {"0": desc}, "slots": list(range(10, 10 + n)),
                            "keys": [h.hex() for h in hashes], "request": "prefill-req"}}


def nixl(**kw) -> dict:
    return {"cpu": CPU, "nixl": {"deadline_s": 5.0, **kw}}


def test_an_offer_from_an_agent_not_allowed_is_ignored_and_counted(tiny_model):
    prompt = prompt_tokens(4 * BS + 1)
    for cfg in (nixl(), nixl(allowed_peers=["prefill-*"])):  # default: no agent is allowed
        sched, initial = new_scheduler(tiny_model, cfg)
        worker = FakeWorker()
        req = run(sched, worker, "d", prompt, offer(prompt, "attacker-1234-r0", 4), max_tokens=2)
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert not [j for j in all_loads(worker.metas) if j.peer_read is not None]  # never read
        assert counter(sched, "request_params_ignored", "peer") == 1  # counted once, asked many times
        assert counter(sched, "hit_blocks", "peer") == 0
        assert all_saves(worker.metas, "d")  # recomputed, and its own KV stored as usual
        assert_scheduler_empty(sched, initial)


def test_a_malformed_offer_is_ignored_and_counted(tiny_model):
    sched, initial = new_scheduler(tiny_model, nixl(allowed_peers=["*"]))
    worker = FakeWorker()
    run(sched, worker, "d", prompt_tokens(4 * BS + 1),
        {"do_remote_prefill": True, "kvtier_peer": {"ranks": "x", "slots": [1], "keys": ["00"]}})
    assert counter(sched, "request_params_ignored", "peer") == 1
    assert_scheduler_empty(sched, initial)


def _peer_read(sched, worker, prompt, agent):
    """Decode ``prompt`` with an offer from ``agent``; (its peer load, the request)."""
    req = make_request("d", prompt, max_tokens=2, kv_transfer_params=offer(prompt, agent, 4))
    sched.add_request(req)
    worker.run_until_idle(sched)
    (load,) = [j for j in all_loads(worker.metas, "d") if j.peer_read is not None]
    return load, req


def test_an_allowed_untrusted_peer_serves_its_request_only(tiny_model):
    sched, initial = new_scheduler(tiny_model, nixl(allowed_peers=["prefill-*"]))
    half, worker = sched_half(sched), FakeWorker()
    prompt = prompt_tokens(4 * BS + 1)
    load, req = _peer_read(sched, worker, prompt, "prefill-abc-r0")
    keys = [BlockKey(h) for h in req.block_hashes[:4]]
    assert load.peer_read.keys == tuple(keys) and load.peer_read.remote_slots == (10, 11, 12, 13)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    first = next(o for o in worker.outputs if "d" in o.num_scheduled_tokens)
    assert first.num_scheduled_tokens["d"] == 1  # the 4 loaded blocks were not recomputed
    assert counter(sched, "hit_blocks", "peer") == 4 and counter(sched, "peer_unpromoted_blocks", "peer") == 4
    # Not promoted: the CPU index has none of its keys afterwards, and nothing the request
    # computed on top of them was stored (so nothing reaches a lower tier either).
    assert not any(k in half.planner.index for k in keys)
    assert all_saves(worker.metas, "d") == []
    assert len(half.planner.index) == 0
    # The next request with that prompt and no offer finds nothing in our tiers.
    assert sched.connector.get_num_new_matched_tokens(make_request("probe", prompt), 0) == (0, False)
    assert counter(sched, "request_params_ignored", "peer") == 0
    assert_scheduler_empty(sched, initial)


def test_a_trusted_peer_s_blocks_are_kept_like_our_own(tiny_model):
    sched, initial = new_scheduler(tiny_model, nixl(trusted_peers=["prefill-*"]))
    half, worker = sched_half(sched), FakeWorker()
    prompt = prompt_tokens(4 * BS + 1)
    load, req = _peer_read(sched, worker, prompt, "prefill-abc-r0")
    keys = [BlockKey(h) for h in req.block_hashes[:4]]
    assert all(k in half.planner.index for k in keys)
    assert counter(sched, "peer_unpromoted_blocks", "peer") == 0
    assert sched.connector.get_num_new_matched_tokens(make_request("probe", prompt), 0)[0] == 4 * BS
    assert_scheduler_empty(sched, initial)


# ---- pool hand-offs -------------------------------------------------------------------------


def test_a_pool_handoff_is_ignored_unless_enabled(tiny_model):
    """No mooncake section (or one without accept_handoffs): ``kvtier_pool_blocks`` does
    not make the request wait; it is served at once and the field counted."""
    sched, initial = new_scheduler(tiny_model, {"cpu": CPU})
    worker = FakeWorker()
    req = run(sched, worker, "d", prompt_tokens(4 * BS + 1), {"do_remote_prefill": True, "kvtier_pool_blocks": 4})
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(worker.metas) <= 3  # not kept waiting (handoff_wait_s would be 5 s of steps)
    assert counter(sched, "request_params_ignored", "mooncake") == 1
    assert counter(sched, "handoff_timeouts", "all") == 0
    assert_scheduler_empty(sched, initial)


def test_prefill_side_offers_hold_at_most_max_offered_fraction(tiny_model):
    """Any request may ask a prefill instance for an offer (``do_remote_decode``), and each
    pins its prompt's slots for ``hold_s``: past ``nixl.max_offered_fraction`` of the slots
    the answer carries none (counted)."""
    sched, _ = new_scheduler(tiny_model, {"cpu": CPU, "nixl": {"max_offered_fraction": 0.1,  # 6 of 64
                                                                "accept_remote_decode": True}})
    worker = FakeWorker()
    reqs = [make_request(f"p{i}", prompt_tokens(4 * BS + 1, seed=10 + i), max_tokens=1,
                         kv_transfer_params={"do_remote_decode": True}) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(20):
        worker.step(sched)
        if all(r.is_finished() for r in reqs):
            break
    assert all(r.is_finished() for r in reqs)
    assert counter(sched, "peer_offered_blocks", "peer") == 4  # the first offer: 4 slots
    assert counter(sched, "request_params_ignored", "peer") == 1  # the second would hold 8 > 6
    assert sched_half(sched).planner.extras.peer_plan.holding() == 1


def _lower_tier_writes(metas) -> set[bytes]:
    return {k for m in metas for job in (*m.demotes, *m.write_through) for k in job.keys}


def test_an_untrusted_peer_s_blocks_never_reach_a_lower_tier(tiny_model, tmp_path):
    """With an NVMe tier (write-back, every block admitted) and a CPU tier small enough that
    later traffic evicts everything: a trusted peer's blocks are demoted to NVMe like our
    own; an untrusted peer's never are (they left the CPU index without an eviction)."""
    written = {}
    for trust in ("allowed_peers", "trusted_peers"):
        sched, initial = new_scheduler(tiny_model, {
            "cpu": {"capacity_bytes": 8 * block_bytes(), "eviction": "lru"},  # oldest out first
            "nvme": {"path": str(tmp_path / trust), "capacity_bytes": 1 << 30, "admit_min_seen": 1,
                     "flush_interval_s": 0},
            "nixl": {"deadline_s": 5.0, trust: ["prefill-*"]},
        })
        worker = FakeWorker()
        prompt = prompt_tokens(4 * BS + 1)
        _, req = _peer_read(sched, worker, prompt, "prefill-abc-r0")
        peer_keys = set(req.block_hashes[:4])
        for i in range(3):  # 12 blocks of our own through 8 slots: everything is evicted
            run(sched, worker, f"o{i}", prompt_tokens(4 * BS + 1, seed=20 + i))
        nvme = sched_half(sched).planner.lower_tier("nvme")
        assert nvme is not None
        written[trust] = (_lower_tier_writes(worker.metas) & peer_keys,
                          {k for k in peer_keys if nvme.index.knows(BlockKey(k))})
        assert _lower_tier_writes(worker.metas)  # our own blocks were demoted: the test can see it
        assert_scheduler_empty(sched, initial)
    assert written["allowed_peers"] == (set(), set())
    assert written["trusted_peers"] == (peer_keys, peer_keys)


def test_two_requests_reading_the_same_blocks_from_peers_at_once(tiny_model):
    """The second request's blocks are still being read for the first (promotions): it
    does not take them a second time (that used to raise in the scheduler), it recomputes
    them; both are served."""
    sched, initial = new_scheduler(tiny_model, nixl(trusted_peers=["prefill-*"]))
    worker = FakeWorker(auto_recv=False)
    prompt = prompt_tokens(4 * BS + 1)
    reqs = [make_request(f"d{i}", prompt, max_tokens=2, kv_transfer_params=offer(prompt, "prefill-abc-r0", 4))
            for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    worker.step(sched)
    worker.step(sched)
    worker.complete_recv("d0", "d1")
    worker.run_until_idle(sched)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert_scheduler_empty(sched, initial)


# ---- do_remote_decode: the prefill side's offer (issue 31) -----------------------------------

SECRET = "the-proxy-secret-0123456789"


def _prefill(sched, worker, req_id, params, seed):
    """One prefill request with ``params``; the ``kv_transfer_params`` its end returned."""
    half = sched_half(sched)
    answers: dict[str, dict | None] = {}
    finish = half.planner.on_finished

    def recorded(request, block_ids):
        hold, out = finish(request, block_ids)
        answers[request.request_id] = out
        return hold, out

    half.planner.on_finished = recorded
    req = make_request(req_id, prompt_tokens(4 * BS + 1, seed=seed), max_tokens=1, kv_transfer_params=params)
    sched.add_request(req)
    for _ in range(20):  # (an engine holding offers keeps stepping: not run_until_idle)
        worker.step(sched)
        if req.is_finished():
            break
    half.planner.on_finished = finish
    assert req.is_finished()
    return req, answers[req_id]


def _slots_pinned(sched) -> int:
    idx = sched_half(sched).planner.index
    return sum(idx.is_pinned(s) for _, s in idx.items())


def test_remote_decode_gets_no_offer_unless_enabled(tiny_model):
    """Off by default: a client's do_remote_decode gets no offer (no agent metadata, no
    slots), pins nothing, and is counted; with nixl.accept_remote_decode it gets one."""
    worker = FakeWorker()
    sched, _ = new_scheduler(tiny_model, {"cpu": CPU, "nixl": {}})
    _, answer = _prefill(sched, worker, "c", {"do_remote_decode": True}, seed=40)
    assert not (answer or {}).get("kvtier_peer") and "planes" not in repr(answer)
    assert counter(sched, "peer_offered_blocks", "peer") == 0
    assert counter(sched, "request_params_ignored", "peer") == 1
    assert sched_half(sched).planner.extras.peer_plan.holding() == 0 and _slots_pinned(sched) == 0

    sched, _ = new_scheduler(tiny_model, {"cpu": CPU, "nixl": {"accept_remote_decode": True}})
    _, answer = _prefill(sched, worker, "p", {"do_remote_decode": True}, seed=41)
    assert answer is not None and answer["kvtier_peer"]["ranks"] == {"0": {"planes": []}}
    assert counter(sched, "peer_offered_blocks", "peer") == 4 and _slots_pinned(sched) == 4
    assert counter(sched, "request_params_ignored", "peer") == 0


def test_remote_decode_with_a_secret_needs_a_token_made_with_it(tiny_model, monkeypatch):
    """With a shared secret configured, a do_remote_decode without a token, with one made
    with another secret, with the secret itself (vLLM would log it) or with a spent token
    is refused and counted; a fresh token made with the secret gets the offer."""
    import time

    from vllm_kvtier.plan.pd_auth import token

    monkeypatch.setenv("KVTIER_PD_SECRET", SECRET)
    sched, _ = new_scheduler(tiny_model, {"cpu": CPU, "nixl": {"accept_remote_decode": True}})
    worker = FakeWorker()
    now = int(time.time())
    good = token(SECRET.encode(), now, "a" * 32)
    for i, params in enumerate(({"do_remote_decode": True},
                                {"do_remote_decode": True, "kvtier_pd_auth": token(b"x" * 20, now, "b" * 32)},
                                {"do_remote_decode": True, "kvtier_pd_secret": SECRET},
                                {"do_remote_decode": True, "kvtier_pd_auth": 12345})):
        _, answer = _prefill(sched, worker, f"bad{i}", params, seed=50 + i)
        assert not (answer or {}).get("kvtier_peer")
    assert counter(sched, "request_params_ignored", "peer") == 4
    assert counter(sched, "peer_offered_blocks", "peer") == 0 and _slots_pinned(sched) == 0
    _, answer = _prefill(sched, worker, "good", {"do_remote_decode": True, "kvtier_pd_auth": good}, seed=60)
    assert answer is not None and "kvtier_peer" in answer and SECRET not in repr(answer)
    assert counter(sched, "peer_offered_blocks", "peer") == 4
    _, answer = _prefill(sched, worker, "again", {"do_remote_decode": True, "kvtier_pd_auth": good}, seed=61)
    assert not (answer or {}).get("kvtier_peer")  # the same token, copied from a log: spent
    assert counter(sched, "request_params_ignored", "peer") == 5


def test_a_short_or_unreadable_secret_fails_at_start(tiny_model, monkeypatch, tmp_path):
    import pytest

    from vllm_kvtier.config import parse_config
    from vllm_kvtier.config.secrets import load_remote_decode_secret
    from vllm_kvtier.errors import ConfigError

    cfg = parse_config({"nixl": {"accept_remote_decode": True}}).nixl
    assert load_remote_decode_secret(cfg, {}) is None
    with pytest.raises(ConfigError, match="remote_decode_secret_env") as e:
        load_remote_decode_secret(cfg, {"KVTIER_PD_SECRET": "short"})
    assert "short" not in str(e.value)
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o644)
    fcfg = parse_config({"nixl": {"remote_decode_secret_file": str(f)}}).nixl
    with pytest.raises(ConfigError, match="remote_decode_secret_file"):
        load_remote_decode_secret(fcfg)
    f.chmod(0o600)
    assert load_remote_decode_secret(fcfg) == SECRET.encode()
