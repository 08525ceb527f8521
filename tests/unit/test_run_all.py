"""``errors.run_all``: the shutdown helper runs every step, in order, and raises the first
failure with the later ones in its notes."""

from __future__ import annotations

import pytest

from vllm_kvtier.errors import run_all


def test_every_step_runs_and_the_first_failure_is_raised_with_the_rest_noted():
    ran: list[str] = []

    def step(name: str, fail: bool = False):
        def f() -> None:
            ran.append(name)
            if fail:
                raise OSError(f"{name} failed")
        return f

    with pytest.raises(OSError, match="b failed") as info:
        run_all([step("a"), step("b", True), None, step("c"), step("d", True)])  # None: skipped
    assert ran == ["a", "b", "c", "d"]
    assert info.value.__notes__ == ["then also: OSError('d failed')"]


def test_no_failure_raises_nothing():
    ran: list[int] = []
    run_all(lambda i=i: ran.append(i) for i in range(3))
    assert ran == [0, 1, 2]
