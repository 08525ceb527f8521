"""The CPU budget's base figure honours a container's memory limit (files under tmp_path
stand in for /proc/meminfo and /sys/fs/cgroup)."""

from __future__ import annotations

from vllm_kvtier.sysmem import available_memory

GiB = 2**30


def _meminfo(tmp_path, available: int):
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       {4 * available // 1024} kB\nMemAvailable:   {available // 1024} kB\n")
    return str(p)


def test_cgroup_v2_limit_caps_the_host_figure(tmp_path):
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text(f"{16 * GiB}\n")
    (cg / "memory.current").write_text(f"{6 * GiB}\n")
    got, where = available_memory(str(cg), _meminfo(tmp_path, 500 * GiB))
    assert got == 10 * GiB and "cgroup" in where


def test_unlimited_cgroup_and_v1_no_limit_use_the_host_figure(tmp_path):
    cg = tmp_path / "v2"
    cg.mkdir()
    (cg / "memory.max").write_text("max\n")
    assert available_memory(str(cg), _meminfo(tmp_path, 3 * GiB)) == (3 * GiB, "MemAvailable")
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert available_memory(str(tmp_path / "v1"), _meminfo(tmp_path, 3 * GiB)) == (3 * GiB, "MemAvailable")


def test_cgroup_v1_limit_and_a_limit_above_the_host(tmp_path):
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{8 * GiB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{2 * GiB}\n")
    assert available_memory(str(tmp_path / "v1"), _meminfo(tmp_path, 100 * GiB))[0] == 6 * GiB
    # A limit with more headroom than the host has free: the host figure is the bound.
    assert available_memory(str(tmp_path / "v1"), _meminfo(tmp_path, 1 * GiB)) == (1 * GiB, "MemAvailable")
