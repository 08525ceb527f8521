"""``kvtier doctor``: the checklist against real configs, this machine, and measured values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_kvtier.cli import main
from vllm_kvtier.doctor.alerting import check_alerting
from vllm_kvtier.doctor.base import Status, Target
from vllm_kvtier.doctor.probe import Machine
from vllm_kvtier.doctor.sizing import check_gpu_budget
from vllm_kvtier.doctor.tier_checks import check_rdma, rdma_requirements
from vllm_kvtier.doctor.workload import check_bandwidth
from vllm_kvtier.ops.capacity import request_kv
from vllm_kvtier.ops.model_shape import model_from_dims
from vllm_kvtier.sysmem import cgroup_memory_limit, read_meminfo

GiB = 2**30
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 8}
RULES = """
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata: {name: kvtier}
spec:
  groups:
  - name: kvtier
    rules:
    - alert: GPUKVCacheAlmostFull
      expr: vllm:kv_cache_usage_perc > 0.9
    - alert: KVTierSwapInSpike
      expr: rate(vllm:kvtier_blocks_loaded_total[5m]) > 1000
"""
LLAMA_70B = model_from_dims(80, 8, 128)


def machine(**kw) -> Machine:
    base = dict(dram_total_bytes=64 * GiB, dram_available_bytes=48 * GiB, cgroup_limit_bytes=None,
                gpu_memory_bytes=None, gpu_source="no GPU detected (test)", rdma_devices=(), nvme_disk=None)
    return Machine(**{**base, **kw})


def doctor(capsys, tmp_path: Path, *argv: str) -> tuple[int, dict[str, tuple[str, str]]]:
    (tmp_path / "llama8b").mkdir(exist_ok=True)
    (tmp_path / "llama8b" / "config.json").write_text(json.dumps(LLAMA3_8B))
    rc = main(["doctor", *argv, "--json"])
    out = capsys.readouterr().out
    return rc, {c["name"]: (c["status"], c["reason"]) for c in json.loads(out)["checks"]}


def test_a_config_that_passes(capsys, tmp_path):
    (tmp_path / "rules.yaml").write_text(RULES)
    rc, checks = doctor(capsys, tmp_path, '{"cpu": {"capacity_bytes": 1073741824}}', "--preset", "interactive",
                        "--model-config", str(tmp_path / "llama8b"), "--context-tokens", "4K",
                        "--gpu-memory-bytes", "80GB", "--weights-bytes", "16GB", "--ttft-slo-s", "1",
                        "--prometheus-rules", str(tmp_path / "rules.yaml"))
    assert rc == 0
    assert {n: s for n, (s, _) in checks.items()} == dict.fromkeys(checks, "PASS"), checks
    assert "536,870,912 B" in checks["kv-size"][1]  # 4096 tokens x 131,072 B
    assert "interactive workload" in checks["strategy"][1]


def test_a_cpu_budget_above_dram_fails(capsys, tmp_path):
    rc, checks = doctor(capsys, tmp_path, '{"cpu": {"capacity_bytes": 1000000000000000000}}', "--gpu-kv-bytes", "1GB")
    assert rc == 1
    status, reason = checks["cpu-budget"]
    assert status == "FAIL" and "more DRAM than is available" in reason


def test_a_config_that_warns(capsys, tmp_path):
    mem = read_meminfo()
    if "MemAvailable" not in mem:
        pytest.skip("no /proc/meminfo")
    # 80% of what is available: over the 70% rule, under 100% (margin for DRAM that moves meanwhile).
    budget = int(0.8 * min(mem["MemAvailable"], cgroup_memory_limit() or mem["MemAvailable"]))
    rc, checks = doctor(capsys, tmp_path, json.dumps({"cpu": {"capacity_bytes": budget}}), "--preset", "interactive",
                        "--workload", "batch", "--gpu-kv-bytes", "20GB")
    assert rc == 0
    assert checks["cpu-budget"][0] == "WARN" and "above the 50-70% rule's 70%" in checks["cpu-budget"][1]
    assert checks["strategy"][0] == "WARN"
    assert "made for interactive serving" in checks["strategy"][1]
    assert checks["alerting"][0] == "WARN"
    assert not any(s == "FAIL" for s, _ in checks.values())


def test_text_output_and_bad_config(capsys, tmp_path):
    assert main(["doctor", "--preset", "interactive", "--gpu-kv-bytes", "1GB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("WARN  kv-size")
    assert all(line[:4] in ("PASS", "WARN", "FAIL") for line in lines[:-1])
    assert lines[-1].endswith("0 FAIL")
    assert main(["doctor", '{"cpu": {"capacity_bytes": -1}}']) == 2
    assert "cpu.capacity_bytes" in capsys.readouterr().err
    assert main(["doctor", "--preset", "nope"]) == 2
    assert "preset" in capsys.readouterr().err


def test_nvme_space_is_measured(capsys, tmp_path):
    cfg = {"nvme": {"path": str(tmp_path / "kv" / "not-yet"), "capacity_bytes": 10**20}}
    rc, checks = doctor(capsys, tmp_path, json.dumps(cfg), "--gpu-kv-bytes", "1GB")
    assert rc == 1
    assert checks["nvme-space"][0] == "FAIL" and str(tmp_path) in checks["nvme-space"][1]
    cfg["nvme"]["capacity_bytes"] = 2**20
    rc, checks = doctor(capsys, tmp_path, json.dumps(cfg), "--gpu-kv-bytes", "1GB")
    assert checks["nvme-space"][0] == "PASS"
    assert rc == 0


def test_gpu_detection_or_warning(capsys, tmp_path):
    rc, checks = doctor(capsys, tmp_path, "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                        "--context-tokens", "1K")
    torch = pytest.importorskip("torch")
    status, reason = checks["gpu-kv-budget"]
    if torch.cuda.is_available():
        assert "torch.cuda:" in reason
    else:
        assert status == "WARN" and "no GPU detected" in reason


def test_gpu_budget_levels():
    req = request_kv(LLAMA_70B, "bf16", 131072)  # 40 GiB
    assert check_gpu_budget(Target(gpu_kv_bytes=30 * GiB), machine(), req).status is Status.FAIL
    two = Target(concurrency=2, gpu_kv_bytes=100 * GiB)
    assert check_gpu_budget(two, machine(), req).status is Status.PASS
    three = check_gpu_budget(Target(concurrency=3, gpu_kv_bytes=100 * GiB), machine(), req)
    assert three.status is Status.WARN and "2 fit at once" in three.reason
    no_gpu = check_gpu_budget(Target(), machine(), req)
    assert no_gpu.status is Status.WARN and "no GPU detected" in no_gpu.reason
    # Weights bigger than the usable HBM leave nothing.
    heavy = Target(weights_bytes=80 * GiB)
    assert check_gpu_budget(heavy, machine(gpu_memory_bytes=80 * GiB), req).status is Status.FAIL


def test_pcie_against_the_ttft_slo():
    req = request_kv(LLAMA_70B, "bf16", 131072)  # 40 GiB over 64 GB/s: 0.67 s
    assert check_bandwidth(Target(ttft_slo_s=1.0), req, "interactive").status is Status.PASS
    slow = check_bandwidth(Target(ttft_slo_s=0.5, prefill_tokens_per_s=10_000), req, "interactive")
    assert slow.status is Status.WARN and "0.67 s" in slow.reason
    worse = check_bandwidth(Target(ttft_slo_s=0.5, prefill_tokens_per_s=1_000_000), req, "interactive")
    assert worse.status is Status.FAIL and "slower than recomputing" in worse.reason
    assert check_bandwidth(Target(), req, "batch").status is Status.PASS
    assert check_bandwidth(Target(), req, None).status is Status.WARN


def test_rdma_needed_only_when_configured():
    assert rdma_requirements({"cpu": {"capacity_bytes": 1}, "nixl": None}) == []
    needs = rdma_requirements({"mooncake": {"master": "m:50051"}, "pool": {"url": "rdma://kv-store:8080"}})
    assert needs == ["mooncake", "pool.url"]
    assert check_rdma(needs, machine()).status is Status.FAIL
    ok = check_rdma(needs, machine(rdma_devices=("mlx5_0",)))
    assert ok.status is Status.PASS and "mlx5_0" in ok.reason
    assert check_rdma([], machine()).status is Status.PASS


def test_alert_rules(tmp_path):
    assert check_alerting(str(tmp_path / "missing.yaml")).status is Status.FAIL
    (tmp_path / "gpu_only.yaml").write_text(
        "groups:\n- name: g\n  rules:\n  - alert: Full\n    expr: vllm:kv_cache_usage_perc > 0.9\n")
    partial = check_alerting(str(tmp_path / "gpu_only.yaml"))
    assert partial.status is Status.WARN and "swapping" in partial.reason
    (tmp_path / "recording.yaml").write_text("groups:\n- name: g\n  rules:\n  - record: x\n    expr: up\n")
    assert check_alerting(str(tmp_path / "recording.yaml")).status is Status.FAIL


def test_meminfo_and_cgroup_readers(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       65536 kB\nMemAvailable:   32768 kB\nHugePages_Total: 0\n")
    assert read_meminfo(str(tmp_path / "meminfo")) == {"MemTotal": 64 * 2**20, "MemAvailable": 32 * 2**20,
                                                       "HugePages_Total": 0}
    assert read_meminfo(str(tmp_path / "absent")) == {}
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(str(tmp_path)) is None
    (tmp_path / "memory.max").write_text("8589934592\n")
    assert cgroup_memory_limit(str(tmp_path)) == 8 * GiB


# -- what silently turns a tier off ------------------------------------------------------

def _tier_checks(extra: dict) -> dict[str, tuple[Status, str]]:
    from vllm_kvtier.config import parse_config
    from vllm_kvtier.doctor.probe import probe_tiers
    from vllm_kvtier.doctor.tier_checks import (
        check_nvme_dir,
        check_s3_endpoint,
        check_shared_auth,
        check_tier_packages,
    )

    cfg = parse_config(extra)
    m = machine(tiers=probe_tiers(cfg))
    return {c.name: (c.status, c.reason) for c in (check_nvme_dir(cfg, m), check_tier_packages(m),
                                                   check_s3_endpoint(cfg, m), check_shared_auth(cfg, m))}


def test_an_nvme_path_the_tier_refuses_fails(tmp_path):
    d = tmp_path / "nvme"
    d.mkdir(mode=0o700)
    d.chmod(0o700)
    assert _tier_checks({"nvme": {"path": str(d), "capacity_bytes": GiB}})["nvme-dir"][0] is Status.PASS
    d.chmod(0o777)
    status, reason = _tier_checks({"nvme": {"path": str(d), "capacity_bytes": GiB}})["nvme-dir"]
    assert status is Status.FAIL and "mode 777" in reason and "turns itself off" in reason


def test_an_nvme_path_in_memory_fails(tmp_path):
    from vllm_kvtier.config import parse_config
    from vllm_kvtier.doctor.probe import NVMeDir, TierProbe, _fstype
    from vllm_kvtier.doctor.tier_checks import check_nvme_dir

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\nnfs:/x /mnt/nfs nfs4 rw 0 0\n")
    assert _fstype(Path("/dev/shm/kv"), str(mounts)) == "tmpfs"
    assert _fstype(Path("/dev/shmx"), str(mounts)) == "ext4"
    assert _fstype(Path("/mnt/nfs/a"), str(mounts)) == "nfs4"
    cfg = parse_config({"nvme": {"path": "/dev/shm/kv", "capacity_bytes": GiB}})
    for fstype, status in (("tmpfs", Status.FAIL), ("nfs4", Status.WARN), ("ext4", Status.PASS)):
        m = machine(tiers=TierProbe(nvme_dir=NVMeDir("/dev/shm", False, 0o1777, 0, fstype)))
        assert check_nvme_dir(cfg, m).status is status, fstype


def test_a_missing_package_fails_with_its_install_hint(monkeypatch):
    import sys

    extra = {"s3": {"bucket": "kv-bucket", "endpoint_url": "http://127.0.0.1:9"}}
    assert _tier_checks(extra)["tier-packages"][0] is Status.PASS
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed: import boto3 fails
    status, reason = _tier_checks(extra)["tier-packages"]
    assert status is Status.FAIL and "pip install 'vllm-kvtier[s3]'" in reason


def test_an_s3_endpoint_that_does_not_answer_fails():
    import socket

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        up = _tier_checks({"s3": {"bucket": "kv-bucket", "endpoint_url": f"http://127.0.0.1:{port}"}})
    assert up["s3-endpoint"][0] is Status.PASS
    down = _tier_checks({"s3": {"bucket": "kv-bucket", "endpoint_url": f"http://127.0.0.1:{port}"}})
    assert down["s3-endpoint"][0] is Status.FAIL and f"127.0.0.1:{port} does not answer" in down["s3-endpoint"][1]


def test_a_shared_tier_without_a_key_is_named(monkeypatch):
    monkeypatch.delenv("KVTIER_AUTH_KEY", raising=False)
    s3 = {"bucket": "kv-bucket", "endpoint_url": "http://127.0.0.1:9"}
    assert _tier_checks({"s3": s3})["shared-auth"][0] is Status.WARN
    assert _tier_checks({"s3": s3, "auth": {"required": True}})["shared-auth"][0] is Status.FAIL
    monkeypatch.setenv("KVTIER_AUTH_KEY", "ab" * 32)
    assert _tier_checks({"s3": s3})["shared-auth"][0] is Status.PASS


def test_doctor_exits_1_on_an_nvme_path_the_tier_refuses(capsys, tmp_path):
    d = tmp_path / "nvme"
    d.mkdir()
    d.chmod(0o777)
    assert main(["doctor", json.dumps({"nvme": {"path": str(d), "capacity_bytes": GiB}}), "--gpu-kv-bytes", "1GB"]) == 1
    assert "FAIL  nvme-dir" in capsys.readouterr().out
