"""``bench/timeline.py`` (``bench/serving.py --timeline``): a request's time to first token
split into its phases from the records its server wrote, and the steps' figures. The
recorder itself runs against a real API server in ``tests/integration/test_serving.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import timeline


def fin(rid: str, t: float) -> dict:
    # arrival t, engine input t+0.005, queued t+0.105, scheduled t+0.405, first token t+1.405,
    # seen by the front end t+1.407
    return {"k": "fin", "id": rid, "arrival": t, "queued": t + 0.105, "sched": t + 0.405,
            "first": t + 1.405, "first_seen": t + 1.407, "prompt": 100}


def test_phases_are_the_gaps_between_a_requests_marks_and_add_up_to_its_ttft():
    recs = [
        # the engine's id carries a suffix; "ext" is the front end's, which "fin" carries
        {"k": "recv", "id": "cmpl-a-0-9d4d", "ext": "cmpl-a-0", "t": 10.005}, fin("cmpl-a-0", 10.0),
        {"k": "recv", "id": "cmpl-b-0-77aa", "ext": "cmpl-b-0", "t": 20.005}, fin("cmpl-b-0", 20.0),
        # a request the engine never recorded is left out, not counted as zero
        fin("cmpl-c-0", 30.0),
    ]
    s = timeline.summarize(recs)
    assert s["requests"] == 2
    got = {p: round(v["mean"], 3) for p, v in s["phases_ms"].items()}
    assert got == {"to_engine": 5.0, "step_wait": 100.0, "kv_wait": 300.0, "async_load": 0.0, "prefill": 1000.0,
                   "back": 2.0}
    assert sum(got.values()) == pytest.approx(s["ttft_ms"])
    assert s["missing"] == [] and s["steps"] == 0 and "running_mean" not in s


def test_an_asynchronous_load_is_its_own_phase_and_a_reused_id_is_the_latest_request():
    recs = [
        # round 1: the same front-end id as round 2, loaded asynchronously from t+0.205
        {"k": "recv", "id": "r-1111", "ext": "r", "t": 10.005}, {"k": "load", "id": "r-1111", "t": 10.205},
        fin("r", 10.0),
        # round 2 reuses the id; its engine id differs; a load outside its queued-scheduled
        # window (a stale record) is not its load
        {"k": "recv", "id": "r-2222", "ext": "r", "t": 20.005}, {"k": "load", "id": "r-2222", "t": 5.0},
        fin("r", 20.0),
    ]
    s = timeline.summarize(recs)
    assert s["requests"] == 2
    # kv_wait: (0.1 + 0.3) / 2 s; async_load: (0.2 + 0) / 2 s; to_engine 5 ms in both
    got = {p: round(v["mean"], 3) for p, v in s["phases_ms"].items()}
    assert got == {"to_engine": 5.0, "step_wait": 100.0, "kv_wait": 200.0, "async_load": 100.0, "prefill": 1000.0,
                   "back": 2.0}


def test_steps_weight_the_running_requests_by_their_time_and_count_held_ones():
    sched = [{"k": "sched", "t": 0, "tokens": n, "running": r, "held": h, "loading": 0, "kv_usage": u}
             for n, r, h, u in ((1000, 1, 0, 0.5), (2, 3, 1, 0.9), (0, 0, 0, 0.0))]
    steps = [{"k": "step", "t0": 0.0, "t1": 3.0, "ran": True}, {"k": "step", "t0": 3.0, "t1": 4.0, "ran": True},
             {"k": "step", "t0": 4.0, "t1": 4.001, "ran": False}]
    s = timeline.summarize(sched + steps)
    assert s["steps"] == 2  # the step that scheduled nothing is not one
    assert s["running_mean"] == 2.0 and s["held_mean"] == 0.5 and s["kv_usage_mean"] == pytest.approx(0.7)
    assert s["running_time_weighted"] == pytest.approx((1 * 3 + 3 * 1) / 4)
    assert s["step_ms_max"] == pytest.approx(3000)
    assert "longest step 3000 ms" in timeline.describe(s)


def test_a_wrap_that_did_not_apply_is_said_and_a_torn_last_line_is_skipped(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"k": "missing", "module": "vllm.v1.engine.core", "error": "no step"}) + "\n"
                    + json.dumps({"k": "error", "where": "fin", "error": "TypeError()"}) + "\n"
                    + json.dumps(fin("cmpl-a-0", 1.0)) + "\n" + '{"k": "recv", "id"')
    recs = timeline.read(path)
    assert len(recs) == 3
    s = timeline.summarize(recs)
    assert s["missing"] == ["fin: TypeError()", "vllm.v1.engine.core"] and s["requests"] == 0
    assert "NOT wrapped" in timeline.describe(s)
    assert timeline.read(tmp_path / "absent.jsonl") == []
