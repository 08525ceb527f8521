"""The S3 tier end to end on real vLLM engines against a real S3 server (moto) on
127.0.0.1: sharing between instances, and faults (server stopped, 503 SlowDown, objects
overwritten with garbage) that must leave tokens correct and the engine serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit import s3_server as s3srv
from testkit.s3_server import FaultProxy, MotoServer
from tests.conftest import close_llm, generate, kvtier_config, kvtier_counters, make_llm, settle
from tests.integration import test_nvme_engine as nvme_engine
from tests.integration.test_nvme_engine import BLOCK_BYTES, SETS, results, run_engine, run_process
from vllm_kvtier.tiers.nvme.store import read_header

# Fixtures from other modules, bound to names in this one.
s3_server = s3srv.s3_server
s3_bucket = s3srv.s3_bucket
baseline_of = nvme_engine.baseline_of

pytestmark = pytest.mark.s3

ROOT = Path(__file__).resolve().parents[2]
LOADABLE = (330 - 1) // 32  # blocks of a 330-token prompt that may come from a tier


def s3_config(endpoint: str, bucket: str, *, cpu_blocks: int = 64, nvme: Path | None = None, **s3) -> dict:
    kv = {
        "cpu": {"capacity_bytes": cpu_blocks * BLOCK_BYTES},
        "s3": {"bucket": bucket, "endpoint_url": endpoint, "path_style": True, "chunk_blocks": 4,
               "deadline_s": 3.0, "backoff_max_s": 0.2, "rescan_interval_s": 0, **s3},
    }
    if nvme is not None:
        kv["nvme"] = {"path": str(nvme), "capacity_bytes": 64 * 2**20}
    return kvtier_config(kv)


def objects(server: MotoServer, bucket: str) -> list[str]:
    page = server.client().list_objects_v2(Bucket=bucket)
    return [o["Key"] for o in page.get("Contents", [])]


@pytest.mark.parametrize("multiprocess", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["inproc", "multiprocess"])
def test_instance_b_loads_what_instance_a_stored(tiny_model, baseline_of, s3_server, s3_bucket, tmp_path,
                                                 multiprocess):
    """A (CPU + NVMe + S3) serves two long prompts and stops. B, a process of its own with
    empty CPU and NVMe tiers on the same bucket, loads every loadable block of both
    prompts from S3, with the baseline's tokens. A's NVMe tier has the default admission
    and write-back: its flush at shutdown leaves every loadable block of the prompts,
    seen once, in chunk files that verify. A runs in this process, or, multiprocess, as
    ``vllm serve`` runs it: then the flush runs in the engine's own process as it exits,
    and B loads in such an engine too."""
    ps = SETS[2]
    kv_a = s3_config(s3_server.url, s3_bucket, nvme=tmp_path / "nvme-a")
    if multiprocess:
        run_process(tiny_model, kv_a, ps, tmp_path, multiprocess=True)
    else:
        run_engine(tiny_model, kv_a, ps)
    keys = objects(s3_server, s3_bucket)
    assert any(k.endswith(".kvt") for k in keys), keys
    assert any(k.endswith(".kvm") for k in keys), "A writes its manifest at shutdown"
    chunks = list((tmp_path / "nvme-a").rglob("*.kvt"))
    assert sum(read_header(f, f.parent.parent.name).nblocks for f in chunks) >= 2 * LOADABLE, chunks

    # another writer id: A's chunks are another instance's (both would default to this host's)
    kv_b = s3_config(s3_server.url, s3_bucket, nvme=tmp_path / "nvme-b", writer_id="writer-b")
    data = run_process(tiny_model, kv_b, ps, tmp_path, multiprocess=multiprocess)
    for p, r in zip(ps, results(data), strict=True):
        assert r.tokens == baseline_of(p)
    c = data["counters"]
    assert c.get("blocks_loaded|s3", 0) == 2 * LOADABLE
    assert c.get("hit_blocks|s3", 0) == 2 * LOADABLE
    assert c.get("remote_hit_blocks|s3", 0) == 2 * LOADABLE, "every hit is on A's chunks"
    assert c.get("blocks_loaded|nvme", 0) == 0 and c.get("load_failures|s3", 0) == 0
    assert c.get("requests|s3", 0) > 0


def test_running_instance_finds_what_another_stores_later(tiny_model, baseline_of, s3_server, s3_bucket,
                                                           tmp_path):
    """B starts first (the bucket is empty), A then stores; B's background rescan finds
    A's objects, and B's requests load them."""
    ps = SETS[3]
    ready, go = tmp_path / "b-ready", tmp_path / "b-go"
    kv_b = s3_config(s3_server.url, s3_bucket, rescan_interval_s=0.5)
    pfile = tmp_path / "prompts-b.json"
    pfile.write_text(json.dumps(ps))
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               KVTIER_TEST_READY_FILE=str(ready), KVTIER_TEST_GO_FILE=str(go), KVTIER_TEST_GO_DELAY_S="2")
    cmd = [sys.executable, "-m", "tests.engine_run", str(tiny_model), json.dumps(kv_b), str(pfile), "8"]
    b = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert b.poll() is None, b.stderr.read()[-4000:] if b.stderr else ""
            assert time.monotonic() < deadline, "instance B did not start"
            time.sleep(0.1)
        llm = make_llm(tiny_model, s3_config(s3_server.url, s3_bucket))  # instance A, in this process
        try:
            assert generate(llm, ps[0]).tokens == baseline_of(ps[0])
        finally:
            close_llm(llm)  # uploads finish and the manifest is written
        go.touch()
        out, err = b.communicate(timeout=300)
    finally:
        if b.poll() is None:
            b.kill()
    assert b.returncode == 0, err[-4000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    data = json.loads(line.removeprefix("RESULT "))
    assert results(data)[0].tokens == baseline_of(ps[0])
    assert data["counters"].get("blocks_loaded|s3", 0) == LOADABLE


def _two_rounds(model: Path, kv: dict, ps: list[list[int]], between) -> tuple[list, list, dict, dict]:
    """Round 1 stores ``ps`` (write-through) through a tiny CPU tier; ``between()`` breaks
    something; round 2 repeats them (their blocks must come from S3) plus fresh prompts."""
    llm = make_llm(model, kv)
    try:
        first = [generate(llm, p) for p in ps]
        settle(llm)  # the uploads are reported durable, as between requests
        before = kvtier_counters(llm)
        between()
        again = [generate(llm, p) for p in ps]
        after = kvtier_counters(llm)
    finally:
        close_llm(llm)
    return first, again, before, after


def test_server_stopped_mid_run(tiny_model, baseline_of, tmp_path):
    """The S3 server goes away between two rounds: loads fail fast (the breaker opens),
    blocks recompute, tokens stay correct, and the engine keeps serving."""
    from testkit.s3_server import aws_test_env

    ps = SETS[1]
    with aws_test_env():
        server = MotoServer(tmp_path)
        server.start()
        try:
            bucket = server.create_bucket()
            kv = s3_config(server.url, bucket, cpu_blocks=4, breaker_failures=3, breaker_cooldown_s=60)
            first, again, before, after = _two_rounds(tiny_model, kv, ps, server.stop)
        finally:
            server.stop()
    for p, r in zip(ps + ps, first + again, strict=True):
        assert r.tokens == baseline_of(p)
    assert before.get("blocks_stored|s3", 0) > 0
    assert after.get("load_failures|s3", 0) > 0 and after.get("blocks_loaded|s3", 0) == 0
    assert after.get("breaker_opens|s3", 0) >= 1
    assert after.get("breaker_state|s3") == 2  # open: requests fail at once


def test_slowdown_503_everywhere(tiny_model, baseline_of, s3_server, s3_bucket):
    """Every request answered 503 SlowDown (through a fault proxy): retried with backoff,
    then a miss; tokens stay correct; counters show the retries and the breaker."""
    ps = SETS[1][:2]
    proxy = FaultProxy(s3_server.url)
    try:
        kv = s3_config(proxy.url, s3_bucket, cpu_blocks=4, breaker_failures=4, breaker_cooldown_s=60)
        first, again, before, after = _two_rounds(tiny_model, kv, ps, proxy.slowdown)
    finally:
        proxy.close()
    for p, r in zip(ps + ps, first + again, strict=True):
        assert r.tokens == baseline_of(p)
    assert proxy.injected > 0
    assert before.get("blocks_stored|s3", 0) > 0
    assert after.get("load_failures|s3", 0) > 0 and after.get("blocks_loaded|s3", 0) == before.get(
        "blocks_loaded|s3", 0)
    assert after.get("retries|s3", 0) > 0 and after.get("breaker_opens|s3", 0) >= 1


def test_objects_overwritten_with_garbage(tiny_model, baseline_of, s3_server, s3_bucket):
    """Someone overwrites every stored object with garbage of the same size: checksums
    fail, blocks recompute, tokens stay correct, and the bad objects are deleted."""
    ps = SETS[1][:2]
    client = s3_server.client()
    vandalised: list[str] = []

    def vandalise() -> None:
        for key in objects(s3_server, s3_bucket):
            if key.endswith(".kvt"):
                vandalised.append(key)
                size = client.head_object(Bucket=s3_bucket, Key=key)["ContentLength"]
                body = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
                garbage = body[:4096] + bytes((b ^ 0x5A) for b in body[4096:size])  # header intact
                client.put_object(Bucket=s3_bucket, Key=key, Body=garbage)

    kv = s3_config(s3_server.url, s3_bucket, cpu_blocks=4)
    first, again, before, after = _two_rounds(tiny_model, kv, ps, vandalise)
    for p, r in zip(ps + ps, first + again, strict=True):
        assert r.tokens == baseline_of(p)
    assert after.get("load_failures|s3", 0) > 0
    assert after.get("blocks_loaded|s3", 0) == before.get("blocks_loaded|s3", 0)
    assert vandalised and set(vandalised) - set(objects(s3_server, s3_bucket)), "bad objects are deleted"


def test_forged_object_is_refused_with_the_mac_on(tiny_model, baseline_of, s3_server, s3_bucket, tmp_path,
                                                  monkeypatch):
    """``auth``: A stores with the key; someone without it replaces one object by a forged
    one with valid CRCs (other block bytes, their CRCs and the header's CRC recomputed, the
    keys kept). B, with the key, refuses it (counted), loads the rest, and its tokens are
    the baseline's; the forged object leaves B's index and stays in the bucket (B did not
    write it)."""
    from dataclasses import replace

    from vllm_kvtier.chunkformat import block_crc, decode_header, encode_header

    monkeypatch.setenv("KVTIER_AUTH_KEY", "5c" * 32)
    ps = SETS[2]
    kv = s3_config(s3_server.url, s3_bucket)
    kv["kv_connector_extra_config"]["auth"] = {"required": True}  # both engines refuse to start without it
    run_engine(tiny_model, kv, ps)
    client = s3_server.client()
    chunks = sorted(k for k in objects(s3_server, s3_bucket) if k.endswith(".kvt"))
    assert chunks
    victim = chunks[0]
    body = bytearray(client.get_object(Bucket=s3_bucket, Key=victim)["Body"].read())
    ns = body[12:28].rstrip(b"\0").decode()
    h = decode_header(bytes(body), ns)
    assert h.authenticated  # A signed it
    crcs = []
    for p in range(h.nblocks):
        off = h.block_offset(p)
        body[off : off + h.block_bytes] = bytes(h.block_bytes)  # zero KV: wrong bytes
        crcs.append(block_crc(bytes(body[off : off + h.block_bytes])))
    encode_header(replace(h, crcs=tuple(crcs)), memoryview(body))  # every CRC valid, the MAC kept
    client.put_object(Bucket=s3_bucket, Key=victim, Body=bytes(body))

    data = run_engine(tiny_model, kv, ps)
    for p, r in zip(ps, results(data), strict=True):
        assert r.tokens == baseline_of(p)
    c = data["counters"]
    assert c.get("auth_failures|s3", 0) >= 1 and c.get("load_failures|s3", 0) >= 1
    assert 0 < c.get("blocks_loaded|s3", 0) < 2 * LOADABLE  # the other objects still serve
    # Forgotten by this reader, not deleted: it did not write the object, and what failed
    # may be the header it was given (a forged manifest entry), not the object.
    assert c.get("forgotten_chunks|s3", 0) >= 1
    assert victim in objects(s3_server, s3_bucket), "a reader deletes only what it wrote"


def test_a_rolling_key_rotation(tiny_model, baseline_of, s3_server, s3_bucket, tmp_path, monkeypatch):
    """``auth`` key rotation on real engines sharing a bucket, one after the other in this
    process: A signs with k1; B (k2 signs,
    k1 verifies: ``auth.verify_key_envs``) loads every loadable block A stored and stores a
    new prompt with k2; once k1 is dropped, C loads B's blocks, never indexes A's chunks
    (no load is even tried) and writes those prefixes again with k2; D loads them all."""
    import copy

    ps, ps2 = SETS[2], SETS[3]
    kv = s3_config(s3_server.url, s3_bucket)
    kv["kv_connector_extra_config"]["auth"] = {"required": True}
    rotating = copy.deepcopy(kv)
    rotating["kv_connector_extra_config"]["auth"]["verify_key_envs"] = ["KVTIER_AUTH_KEY_OLD"]

    def chunks() -> set[str]:
        return {k for k in objects(s3_server, s3_bucket) if k.endswith(".kvt")}

    monkeypatch.setenv("KVTIER_AUTH_KEY", "a1" * 32)
    run_engine(tiny_model, kv, ps)
    signed_k1 = chunks()
    assert signed_k1

    monkeypatch.setenv("KVTIER_AUTH_KEY", "b2" * 32)
    monkeypatch.setenv("KVTIER_AUTH_KEY_OLD", "a1" * 32)
    data = run_engine(tiny_model, rotating, ps + ps2)
    assert [r.tokens for r in results(data)] == [baseline_of(p) for p in ps + ps2]
    assert data["counters"].get("blocks_loaded|s3", 0) == 2 * LOADABLE  # A's, signed with k1
    signed_k2 = chunks() - signed_k1
    assert signed_k2  # ps2, signed with k2

    monkeypatch.delenv("KVTIER_AUTH_KEY_OLD")
    data = run_engine(tiny_model, kv, ps2 + ps)
    assert [r.tokens for r in results(data)] == [baseline_of(p) for p in ps2 + ps]
    c = data["counters"]
    assert c.get("blocks_loaded|s3", 0) == LOADABLE  # B's only
    assert c.get("load_failures|s3", 0) == 0 and c.get("auth_failures|s3", 0) == 0  # k1's: never offered
    rewritten = chunks() - signed_k1 - signed_k2
    assert rewritten  # A's prefixes, written again with k2

    data = run_engine(tiny_model, kv, ps)
    assert [r.tokens for r in results(data)] == [baseline_of(p) for p in ps]
    assert data["counters"].get("blocks_loaded|s3", 0) == 2 * LOADABLE
    assert data["counters"].get("load_failures|s3", 0) == 0
