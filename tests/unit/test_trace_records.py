"""Trace records for ``kvtier plan --trace``: every field checked, with an error naming the
line and the field; ``--save-trace`` never replaces the trace it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_kvtier.cli import main
from vllm_kvtier.ops.trace_sim import TraceError, read_trace


def _trace(tmp_path: Path, *records: object) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return p


GOOD = {"timestamp": 0, "prompt_token_ids": [1, 2, 3], "output_length": 1}


@pytest.mark.parametrize(("field", "value"), [
    ("timestamp", "NaN"), ("timestamp", "x"), ("timestamp", [1]), ("timestamp", -1),
    ("input_length", -100000), ("input_length", "3"), ("input_length", 5),
    ("output_length", "NaN"), ("output_length", [2]), ("output_length", -1),
])
def test_every_field_of_a_token_trace_is_checked(tmp_path: Path, field: str, value: object) -> None:
    bad = dict(GOOD, **{field: value})
    text = json.dumps(bad).replace('"NaN"', "NaN")  # a JSON NaN, which Python's parser accepts
    p = _trace(tmp_path, GOOD, text)
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: {field} "):
        read_trace(p)


def test_a_deeply_nested_record_is_a_clear_error(tmp_path: Path) -> None:
    p = _trace(tmp_path, GOOD, '{"timestamp": 0, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(TraceError, match=r"t\.jsonl:2: .*nested too deeply"):
        read_trace(p)


def test_save_trace_never_overwrites_the_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _trace(tmp_path, GOOD, dict(GOOD, timestamp=5))
    before = p.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(p)
    for target in (str(p), str(link), f"{tmp_path}/./t.jsonl"):
        assert main(["plan", "--trace", str(p), "--cpu-blocks", "10", "--save-trace", target]) == 2
        assert "--save-trace" in capsys.readouterr().err
    assert p.read_bytes() == before  # the prompts are still there
    out = tmp_path / "ids.jsonl"
    assert main(["plan", "--trace", str(p), "--cpu-blocks", "10", "--save-trace", str(out)]) == 0
    assert "prompt_token_ids" not in out.read_text()
