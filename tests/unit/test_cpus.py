"""Where the plugin's own threads run (``background_cpus``): off the cores the worker's main
thread is bound to. The real-thread tests bind this test's main thread to one CPU, as
vLLM's CPU worker does to its compute cores, and read the masks of the threads the copy
engine and the NVMe store start (by their kernel thread ids)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

from testkit.stores import nvme_section
from vllm_kvtier import cpus
from vllm_kvtier.config import parse_config
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.tiers.nvme.store import NVMeStore
from vllm_kvtier.tiers.registry import StoreContext
from vllm_kvtier.transfer.copier import HostCopyEngine
from vllm_kvtier.transfer.layout import build_layout

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs this process may use")


def test_cpu_lists_parse_and_bad_ones_name_the_field():
    assert cpus.parse_cpu_list("2,3,8-11") == {2, 3, 8, 9, 10, 11}
    assert cpus.parse_cpu_list(" 0 ") == {0}
    for bad in ("", "a", "3-1", "1,,2", "-2", "1-"):
        with pytest.raises(ValueError):
            cpus.parse_cpu_list(bad)
    with pytest.raises(ConfigError, match="background_cpus"):
        parse_config({"background_cpus": "1-x"})
    assert parse_config({"background_cpus": "0-1"}).background_cpus == "0-1"
    assert parse_config({}).background_cpus == "inherit"


def test_spare_cpus_are_the_started_set_minus_compute():
    assert cpus.spare_cpus({0, 1, 2, 3}, {0, 1}) == {2, 3}
    assert cpus.spare_cpus({0}, {0}) == frozenset()  # nothing spare: threads stay put
    # never a compute core's hyperthread sibling
    assert cpus.spare_cpus({0, 1, 2, 3, 4, 5}, {0, 1}, {0, 1, 3}) == {2, 4, 5}


def test_smt_siblings_come_from_sysfs(tmp_path):
    for cpu, sib in ((0, "0,4"), (1, "1-1"), (2, "garbage")):
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(sib + "\n")
    assert cpus.smt_siblings(frozenset({0, 1, 2, 3}), str(tmp_path)) == {0, 1, 4}


@pytest.fixture
def bound_main() -> Iterator[int]:
    """This thread bound to one CPU (as vLLM binds its worker); everything restored after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {ALLOWED[0]})
    try:
        yield ALLOWED[0]
    finally:
        os.sched_setaffinity(0, before)
        cpus.configure("inherit")


def _masks(prefix: str) -> list[set[int]]:
    return [os.sched_getaffinity(t.native_id) for t in threading.enumerate()
            if t.name.startswith(prefix) and t.native_id is not None]


def _copy_thread_mask(eng: HostCopyEngine) -> set[int]:
    return eng._bg.submit(os.sched_getaffinity, 0).result(timeout=60)


def _engine() -> HostCopyEngine:
    kv = {"model.layers.0.self_attn.attn": torch.zeros((4, 2, 16, 64))}
    lay = build_layout(kv, 4)
    return HostCopyEngine(lay, CPUPool(2, lay.plane_bytes, pin=False, prefault=False))


@needs_two_cpus
def test_background_threads_leave_the_compute_core(bound_main, tmp_path):
    other = ALLOWED[1]
    assert cpus.configure(str(other)) == {other}
    eng = _engine()
    store = NVMeStore(nvme_section(tmp_path / "nvme", io_engine="posix"), StoreContext("cpus0000", 0, 3000))
    try:
        assert _copy_thread_mask(eng) == {other}
        io = _masks("kvtier-nvme")
        assert io and all(m == {other} for m in io), io
        assert os.sched_getaffinity(0) == {bound_main}  # the compute thread is not moved
    finally:
        store.close()
        eng.shutdown()


@needs_two_cpus
def test_auto_takes_the_started_set_minus_compute_and_inherit_stays(bound_main):
    parent = os.sched_getaffinity(os.getppid())
    want = set(parent) - {bound_main} - cpus.smt_siblings(frozenset({bound_main}))
    chosen = cpus.configure("auto")
    eng = _engine()
    try:
        if want:
            assert chosen == want
            assert _copy_thread_mask(eng) == want
        else:  # the parent itself runs on the compute CPU only: nothing spare
            assert chosen is None
            assert _copy_thread_mask(eng) == {bound_main}
    finally:
        eng.shutdown()
    assert cpus.configure("auto", shared_host=True) is None  # other ranks' cores unknown: stay
    assert cpus.configure("inherit") is None
    eng = _engine()
    try:
        assert _copy_thread_mask(eng) == {bound_main}
    finally:
        eng.shutdown()


@needs_two_cpus
def test_a_list_the_kernel_refuses_leaves_threads_where_they_are(bound_main):
    cpus.configure(str(max(ALLOWED) + 4096))  # no such CPU: sched_setaffinity refuses
    eng = _engine()
    try:
        assert _copy_thread_mask(eng) == {bound_main}
    finally:
        eng.shutdown()
