"""The fleet replay (vllm_kvtier/ops/fleet_sim.py) and its routers, on tiny hand-made traces."""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from vllm_kvtier.cli import main
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.ops.fleet_sim import FleetSetup, simulate_fleet
from vllm_kvtier.ops.routers import Prefix, RouterView, make_router, session_keys
from vllm_kvtier.ops.synth_trace import DocsTraceShape, docs_trace
from vllm_kvtier.ops.trace_plan import lower_tier
from vllm_kvtier.ops.trace_sim import LowerTier, TierSetup, key_of, make_trace, read_trace, simulate_tiers

SAMPLE = str(Path(__file__).parent / "data" / "mooncake_conversation_first500.jsonl")
#: one trace block per chunk, written at once, admitted on first sight
S3 = LowerTier("s3", None, "write-through", 1, 1)


class Recorder:
    """A router that remembers where another one sent each request."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.routes = inner, inner.name, []

    def route(self, i: int, keys: Sequence[BlockKey], view: RouterView) -> int:
        self.routes.append(self.inner.route(i, keys, view))
        return self.routes[-1]


def trace_of(*reqs: tuple[float, list[int]], block_tokens: int = 16, output: int = 1):
    """Requests (seconds, hash ids), each prompt a whole number of blocks."""
    return make_trace([{"timestamp": int(t * 1000), "input_length": len(ids) * block_tokens, "output_length": output,
                        "hash_ids": ids} for t, ids in reqs], block_tokens)


def fleet(n: int, *, cpu: int = 64, shared: LowerTier | None = None, **kw) -> FleetSetup:
    return FleetSetup(n, TierSetup(cpu_blocks=cpu), shared, **kw)


@pytest.mark.parametrize(("s3_blocks", "eviction"), [(None, "kvaware"), (2000, "kvaware"), (None, "lru")])
def test_one_instance_is_the_single_instance_replay(s3_blocks, eviction):
    trace = read_trace(SAMPLE)
    tiers = {n: lower_tier(n, size, trace_block_tokens=512, engine_block_tokens=16, block_bytes=0)
             for n, size in (("nvme", 400), ("s3", s3_blocks))}
    setup = TierSetup(cpu_blocks=150, cpu_eviction=eviction, lower=(tiers["nvme"],), step_blocks=16)
    one = simulate_tiers(trace, dataclasses.replace(setup, lower=(tiers["nvme"], tiers["s3"])))
    got = simulate_fleet(trace, FleetSetup(1, setup, tiers["s3"]), make_router("round-robin", trace.keys))
    assert got.hit_tokens == {"cpu": one.tiers[0].hit_tokens, "nvme": one.tiers[1].hit_tokens,
                              "shared": one.tiers[2].hit_tokens}
    assert (got.shared_write_ops, got.shared_read_ops) == (one.tiers[2].write_ops, one.tiers[2].read_ops)
    assert got.cross_hit_tokens == 0 and got.hit_tokens["nvme"] > 0 and got.hit_tokens["shared"] > 0

    def figures(t):
        return t.hit_tokens, t.hit_blocks, t.write_ops, t.written_blocks, t.written_bytes, t.read_ops

    # every tier's reads and writes too, not only the hits: one code path serves both replays
    assert [figures(t) for t in got.tiers] == [figures(t) for t in one.tiers]
    assert got.tiers[1].write_ops > 0 and got.tiers[1].read_ops > 0


def test_round_robin_takes_the_instances_in_turn():
    trace = trace_of(*((i, [i]) for i in range(7)))
    r = Recorder(make_router("round-robin", trace.keys))
    res = simulate_fleet(trace, fleet(3), r)
    assert r.routes == [0, 1, 2, 0, 1, 2, 0]
    assert res.requests_per_instance == [3, 2, 2]


def test_round_robin_without_a_shared_tier_loses_what_the_other_instance_holds():
    trace = trace_of((0, [1, 2]), (1, [1, 2, 3]), (2, [1, 2, 3, 4]))
    assert simulate_fleet(trace, fleet(1), make_router("round-robin", trace.keys)).hit_tokens["cpu"] == 5 * 16
    two = simulate_fleet(trace, fleet(2), make_router("round-robin", trace.keys))
    assert two.hit_tokens["cpu"] == 2 * 16  # only request 2 (instance 0 again) finds request 0's blocks


def test_a_conversation_sticks_to_one_instance():
    # block 0: a system prompt every conversation starts with (followed by 10 different blocks)
    reqs = []
    for turn in range(3):
        for c in range(10):
            reqs.append((turn * 100 + c, [0, 100 + c, *range(1000 + 10 * c, 1000 + 10 * c + turn)]))
    trace = trace_of(*reqs, output=1000)  # long decodes: the first turns are all in flight at once
    keys = session_keys(trace.keys, fanout=8)
    assert keys[:10] == [key_of(100 + c) for c in range(10)]  # the first block after the system one
    r = Recorder(make_router("session", trace.keys, session_fanout=8))
    simulate_fleet(trace, fleet(4), r)
    home = r.routes[:10]
    assert r.routes[10:20] == home and r.routes[20:] == home
    assert len(set(home)) == 4  # new conversations go to the least loaded
    # with a fanout above the system block's, the system block keys every request: one instance
    assert set(session_keys(trace.keys, fanout=11)) == {key_of(0)}


def test_prefix_routing_picks_the_instance_holding_the_prefix():
    # long decodes: every request stays in flight, so "least loaded" alone would spread them
    trace = trace_of((0, [1, 2, 3]), (1, [7, 8]), (2, [1, 2, 3, 4]), (3, [7, 8, 9]), (4, [5]), output=1000)
    r = Recorder(Prefix(max_imbalance=10))
    simulate_fleet(trace, fleet(3), r)
    assert r.routes == [0, 1, 0, 1, 2]


def test_the_load_bound_overrides_the_prefix_holder():
    trace = trace_of((0, [1, 2]), (1, [1, 2, 3]), (2, [1, 2, 4]), output=1000)
    loose, tight = Recorder(Prefix(max_imbalance=10)), Recorder(Prefix(max_imbalance=1))
    simulate_fleet(trace, fleet(3), loose)
    simulate_fleet(trace, fleet(3), tight)
    assert loose.routes == [0, 0, 0]
    # third request: instance 0 has 2 in flight, the mean is 2/3: 2 >= 2/3 + 1, passed over
    assert tight.routes == [0, 0, 1] and tight.inner.overridden == 1


def test_the_load_bound_lets_requests_go_once_finished():
    # short requests: finished before the next arrives, so the holder is idle again
    trace = trace_of((0, [1, 2]), (10, [1, 2, 3]), (20, [1, 2, 4]), output=1)
    r = Recorder(Prefix(max_imbalance=0.5))
    simulate_fleet(trace, fleet(3, decode_s_per_token=0.01), r)
    assert r.routes == [0, 0, 0]


def s3_case(second_at: float, **kw):
    """Instance 0 writes blocks 1, 2 at t=0; instance 1 asks for them at ``second_at``
    (round-robin: request 1 is instance 1's own, unrelated)."""
    trace = trace_of((0, [1, 2]), (1, [50]), (2, [60]), (second_at, [1, 2, 3]))
    return simulate_fleet(trace, fleet(2, cpu=8, shared=S3, **kw), make_router("round-robin", trace.keys))


def test_s3_another_instance_hits_only_after_its_next_rescan():
    before = s3_case(59.0, shared_kind="s3", rescan_interval_s=60)
    after = s3_case(60.0, shared_kind="s3", rescan_interval_s=60)
    # request 3 is instance 1's: before the listing at 60 s it finds nothing
    assert before.hit_tokens["shared"] == 0 and before.cross_hit_tokens == 0
    assert after.hit_tokens["shared"] == 2 * 16 and after.cross_hit_tokens == 2 * 16
    # the writer itself finds its own chunks at once
    trace = trace_of((0, [1, 2]), (1, [50]), (2, [3, 4]), (3, [60]), (4, [1, 2, 5]))
    own = simulate_fleet(trace, fleet(2, cpu=2, shared=S3, shared_kind="s3"), make_router("round-robin", trace.keys))
    assert own.hit_tokens["shared"] == 2 * 16 and own.cross_hit_tokens == 0


def test_a_mooncake_pool_is_seen_by_every_instance_at_once():
    got = s3_case(3.0, shared_kind="mooncake")
    assert got.hit_tokens["shared"] == 2 * 16 and got.cross_hit_tokens == 2 * 16
    assert s3_case(3.0, shared_kind="s3", rescan_interval_s=60).cross_hit_tokens == 0


def test_a_block_listed_in_the_bucket_is_not_written_again():
    trace = trace_of((0, [1, 2]), (70, [1, 2, 3]))
    res = simulate_fleet(trace, fleet(2, cpu=8, shared=S3, rescan_interval_s=60), make_router("round-robin", trace.keys))
    assert res.shared_write_ops == 3  # 1, 2 by instance 0; only 3 by instance 1


def test_the_synthetic_trace_is_deterministic_and_shares_documents():
    shape = DocsTraceShape(sessions=40)
    a, b = docs_trace(shape), docs_trace(shape)
    assert a == b and len(a) >= 40
    assert docs_trace(dataclasses.replace(shape, seed=8)) != a
    firsts = {r["hash_ids"][1] for r in a}  # the document's first block
    assert len(firsts) < shape.documents + 1 < 40


def test_the_cli_prints_a_row_per_router_and_refuses_bad_options(capsys, tmp_path):
    args = ["plan", "--trace", SAMPLE, "--cpu-blocks", "100", "--s3-blocks", "unbounded", "--instances", "4"]
    assert main([*args, "--json"]) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert [r["router"] for r in out["rows"]] == ["round-robin", "session", "prefix"]
    assert all(0 <= r["total"] <= out["infinite"] + 1e-9 and r["has_shared"] for r in out["rows"])
    assert main([*args, "--router", "session"]) == 0
    assert "session" in capsys.readouterr().out
    assert main([*args, "--sweep", "--sweep-instances", "1,2", "--sweep-shared-blocks", "none,200", "--router",
                 "round-robin", "--png", str(tmp_path / "f.png")]) == 0
    text = capsys.readouterr().out
    assert text.count("round-robin") == 4 and "none" in text and "200" in text
    assert main([*args[:-1], "0"]) == 2
    assert "--instances" in capsys.readouterr().err
    assert main([*args, "--max-imbalance", "-1"]) == 2
    assert "--max-imbalance" in capsys.readouterr().err


def test_at_light_load_new_prompts_spread_over_the_idle_instances():
    # each request is done before the next: every instance is idle, the least sent one wins
    trace = trace_of(*((10 * i, [100 + i]) for i in range(6)))
    r = Recorder(Prefix())
    simulate_fleet(trace, fleet(3), r)
    assert r.routes == [0, 1, 2, 0, 1, 2]


def test_a_shared_document_is_not_taken_for_a_conversation():
    # 10 users read one 3-block document (11, 12, 13) after a system block; two turns each
    reqs = [(turn * 100 + u, [0, 11, 12, 13, 200 + u, *([300 + u] if turn else []), 9000 + 10 * u + turn])
            for turn in range(2) for u in range(10)]
    keys = session_keys(trace_of(*reqs).keys, fanout=8)
    assert keys == [key_of(200 + u) for u in range(10)] * 2


def test_the_sweep_writes_a_csv_that_any_tool_plots(capsys, tmp_path):
    args = ["plan", "--trace", SAMPLE, "--cpu-blocks", "100", "--s3-blocks", "unbounded", "--instances", "4",
            "--sweep", "--sweep-instances", "1,2", "--sweep-shared-blocks", "none,3000", "--router", "round-robin"]
    assert main([*args, "--json"]) == 0, capsys.readouterr().err
    want = json.loads(capsys.readouterr().out)
    path = tmp_path / "fleet.csv"
    assert main([*args, "--csv", str(path), "--png", str(tmp_path / "f.png")]) == 0, capsys.readouterr().err
    rows = list(csv.DictReader(path.open()))
    assert [(r["shared_blocks"], r["instances"], r["router"]) for r in rows] == [
        ("none", "1", "round-robin"), ("none", "2", "round-robin"), ("3000", "1", "round-robin"),
        ("3000", "2", "round-robin")]
    for got, row in zip(rows, want["rows"], strict=True):
        assert float(got["all"]) == pytest.approx(row["total"], abs=1e-6)
        assert float(got["cross"]) == pytest.approx(row["cross"], abs=1e-6)
        assert float(got["single_instance"]) == pytest.approx(want["single_instance"], abs=1e-6)
    assert float(rows[3]["shared"]) > 0 and rows[0]["shared_usd_per_h"] == ""
    assert main([*args, "--csv", str(tmp_path / "no" / "such" / "dir.csv")]) == 2
    assert "--csv" in capsys.readouterr().err
