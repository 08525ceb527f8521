"""The S3 tier's data path (S3Store) against a real S3 server (moto) on 127.0.0.1.

Faults are real: the server process stopped and restarted, a proxy in front of it that
answers 503 SlowDown or holds requests without answering, objects overwritten through
boto3. Nothing is mocked. The circuit breaker's state machine is also tested alone with a
fake clock. The data-path tests run with both I/O engines (boto3, and NIXL's OBJ backend
where nixl is installed), and each engine reads what the other wrote.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from testkit import s3_server as s3srv
from testkit.s3_server import ACCESS_KEY_ID, SECRET_ACCESS_KEY, FaultProxy, MotoServer, aws_test_env
from tests.nixl_env import nixl_engine_env, nixl_env, requires_nixl
from vllm_kvtier.chunkformat import ChunkHeader
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.tiers.base import IOResult
from vllm_kvtier.tiers.buffers import WriteBuffer
from vllm_kvtier.tiers.registry import StoreContext
from vllm_kvtier.tiers.resilience import BreakerState, CircuitBreaker
from vllm_kvtier.tiers.s3.manifest import decode_manifest, encode_manifest
from vllm_kvtier.tiers.s3.store import S3Config, S3Store

pytestmark = pytest.mark.s3
s3_server = s3srv.s3_server  # fixtures: a moto server for this module, a fresh bucket per test
s3_bucket = s3srv.s3_bucket

BLOCK = 3000  # not a multiple of 4 KiB: the format pads it
NS = "s3test0000000000"
nixl_env = nixl_env  # fixtures: UCX/NIXL environment for the nixl engine's tests
nixl_engine_env = nixl_engine_env
ENGINES = ["boto3", pytest.param("nixl", marks=[pytest.mark.nixl, requires_nixl])]


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def block(i: int, n: int = BLOCK) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(256)) * (n // 256) + bytes(n % 256)


def config(server: MotoServer, bucket: str, **kw: Any) -> S3Config:
    base = dict(bucket=bucket, prefix="kv/", endpoint_url=server.url, path_style=True, io_threads=2,
                connect_timeout_s=0.5, read_timeout_s=1.0, deadline_s=2.0, backoff_base_s=0.02,
                backoff_max_s=0.2, breaker_failures=3, breaker_cooldown_s=0.5)
    base.update(kw)
    return S3Config(**base)  # type: ignore[arg-type]


@pytest.fixture(params=ENGINES)
def store(request: pytest.FixtureRequest, s3_server: MotoServer, s3_bucket: str) -> Iterator[S3Store]:
    s = S3Store(config(s3_server, s3_bucket, io_engine=request.param), StoreContext(NS, 0, BLOCK))
    yield s
    s.close()


def chunk(first: int, n: int, block_bytes: int = BLOCK) -> WriteBuffer:
    wb = WriteBuffer([key(first + i) for i in range(n)], block_bytes)
    for i in range(n):
        with wb.block(i) as b:
            b[:] = block(first + i, block_bytes)
    return wb


def wait(store: S3Store, job: int, timeout_s: float = 15.0) -> IOResult:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for r in store.poll():
            if r.job_id == job:
                return r
            r.release()
        time.sleep(0.002)
    raise AssertionError(f"job {job} gave no result within {timeout_s} s")


def write(store: S3Store, object_id: str, first: int, n: int, job: int = 1) -> ChunkHeader:
    assert store.submit_write(job, object_id, chunk(first, n, store.block_bytes))
    r = wait(store, job)
    assert r.ok, r.reason
    assert r.header is not None
    return r.header


def read(store: S3Store, object_id: str, h: ChunkHeader, positions: list[int], job: int = 2) -> IOResult:
    store.submit_read(job, object_id, h, positions, [h.keys[p] for p in positions])
    return wait(store, job)


def requests(store: S3Store) -> dict[str, int]:
    return store.stats().requests


# ---- data path ----------------------------------------------------------------------------


def test_ranged_reads_fetch_only_the_needed_runs(store: S3Store) -> None:
    h = write(store, "obj-a", 0, 8)
    assert h.nblocks == 8 and requests(store) == {"PutObject": 1}
    r = read(store, "obj-a", h, [6, 1, 2, 7])  # runs [1,2] and [6,7]: two ranged GETs
    assert r.ok and r.blocks is not None
    assert [b.tobytes() for b in r.blocks] == [block(6), block(1), block(2), block(7)]
    assert r.nbytes == 2 * (h.stride + BLOCK)  # the bytes fetched: two runs of two blocks, no more
    r.release()
    assert requests(store) == {"PutObject": 1, "GetObject": 2}
    h = write(store, "obj-b", 0, 10, job=3)
    r = read(store, "obj-b", h, [5, 1, 2, 3, 9, 2], job=4)  # runs [1,3], [5], [9]: three GETs
    assert r.ok and r.blocks is not None and [b.tobytes() for b in r.blocks] == [block(p) for p in [5, 1, 2, 3, 9, 2]]
    r.release()
    assert requests(store) == {"PutObject": 2, "GetObject": 5}
    r = read(store, "obj-b", h, list(range(10)), job=5)  # every block: one plain GET of the object
    assert r.ok and r.nbytes == h.total_bytes
    r.release()
    assert requests(store) == {"PutObject": 2, "GetObject": 6}


def test_key_layout_spreads_over_hashed_prefixes(store: S3Store) -> None:
    pat = re.compile(rf"^kv/{NS}/r0/[0-9a-f]{{2}}/(obj-\d+)\.kvt$")
    keys = [store.key(f"obj-{i}") for i in range(64)]
    assert all(pat.match(k) for k in keys)
    assert len({k.split("/")[3] for k in keys}) > 32  # 64 ids over 256 prefixes
    h = write(store, "obj-7", 0, 1)
    listed = store.scan()
    assert listed.found == {"obj-7": h} and listed.problems == {}


@pytest.mark.parametrize("engine", ENGINES)
def test_multipart_upload_above_threshold(s3_server: MotoServer, s3_bucket: str, engine: str) -> None:
    mib = 1 << 20
    s = S3Store(config(s3_server, s3_bucket, multipart_threshold_bytes=5 * mib, multipart_part_bytes=5 * mib,
                       io_engine=engine), StoreContext(NS, 0, mib))
    try:
        h = write(s, "big", 0, 6)  # 6 MiB of blocks + a 4 KiB header: two parts
        assert requests(s) == {"CreateMultipartUpload": 1, "UploadPart": 2, "CompleteMultipartUpload": 1}
        r = read(s, "big", h, [0, 5])
        assert r.ok and r.blocks is not None
        assert r.blocks[0].tobytes() == block(0, mib) and r.blocks[1].tobytes() == block(5, mib)
        r.release()
    finally:
        s.close()


def test_garbage_object_is_a_checksum_miss(store: S3Store, s3_server: MotoServer) -> None:
    h = write(store, "bad", 0, 4, job=1)
    h2 = write(store, "good", 10, 2, job=2)
    client = s3_server.client()
    size = client.head_object(Bucket=store.config.bucket, Key=store.key("bad"))["ContentLength"]
    client.put_object(Bucket=store.config.bucket, Key=store.key("bad"), Body=os.urandom(size))
    r = read(store, "bad", h, [1, 2], job=3)
    assert not r.ok and r.reason == "checksum" and r.blocks is None
    r = read(store, "good", h2, [0, 1], job=4)  # the rest keeps serving
    assert r.ok
    r.release()
    assert store.breaker.state is BreakerState.CLOSED  # damaged data is not an unhealthy endpoint
    assert store.stats().failures == {"checksum": 1}
    # Shorter garbage: the ranged GET comes back short.
    client.put_object(Bucket=store.config.bucket, Key=store.key("bad"), Body=b"x" * 100)
    assert read(store, "bad", h, [3], job=5).reason == "truncated"
    store.submit_delete("bad")
    deadline = time.monotonic() + 5
    while not any(d.kind == "delete" for d in store.poll()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert read(store, "bad", h, [0], job=6).reason == "missing"


@pytest.mark.nixl
@requires_nixl
def test_engines_read_each_others_objects(s3_server: MotoServer, s3_bucket: str) -> None:
    a = S3Store(config(s3_server, s3_bucket, io_engine="boto3"), StoreContext(NS, 0, BLOCK))
    b = S3Store(config(s3_server, s3_bucket, io_engine="nixl"), StoreContext(NS, 0, BLOCK))
    try:
        ha, hb = write(a, "by-boto3", 0, 6, job=1), write(b, "by-nixl", 0, 6, job=2)
        assert ha == hb
        client = s3_server.client()
        body = {oid: client.get_object(Bucket=s3_bucket, Key=a.key(oid))["Body"].read()
                for oid in ("by-boto3", "by-nixl")}
        assert body["by-boto3"] == body["by-nixl"] and len(body["by-nixl"]) == ha.total_bytes  # same bytes stored
        for reader, oid, positions in [(b, "by-boto3", [4, 1, 2]), (a, "by-nixl", [4, 1, 2]),
                                       (b, "by-boto3", list(range(6))), (a, "by-nixl", [5])]:
            r = read(reader, oid, ha, positions, job=3)
            assert r.ok and r.blocks is not None, r.reason
            assert [x.tobytes() for x in r.blocks] == [block(p) for p in positions]
            r.release()
        assert b.stats().requests == {"PutObject": 1, "GetObject": 3}  # one GET per run, as boto3's
        assert b.scan().found == a.scan().found == {"by-boto3": ha, "by-nixl": hb}
    finally:
        a.close()
        b.close()


def test_restart_finds_previous_writes_with_manifest_or_headers(s3_server: MotoServer, s3_bucket: str) -> None:
    a = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 0, BLOCK))
    headers = {f"c{i}": write(a, f"c{i}", 10 * i, 3, job=i) for i in range(3)}
    a.close()  # writes a's manifest
    assert requests(a)["PutObject"] == 4

    b = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 0, BLOCK))
    try:
        found = b.scan().found
        assert found == headers
        rep = b.last_scan
        assert (rep.list_requests, rep.manifest_gets, rep.header_gets, rep.from_manifests) == (1, 1, 0, 3)
        r = read(b, "c2", found["c2"], [0, 1, 2])
        assert r.ok and [x.tobytes() for x in r.blocks or []] == [block(20), block(21), block(22)]
        r.release()
        # Written since the last manifest: found by its header (one ranged GET).
        headers["c9"] = write(b, "c9", 90, 2, job=9)
        again = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 0, BLOCK))
        assert again.scan().found == headers
        assert (again.last_scan.header_gets, again.last_scan.from_manifests) == (1, 3)
        again.close()
    finally:
        b.close()

    # Without any manifest: one ranged GET per object; a manifest entry whose object is
    # gone is ignored (the listing is the truth).
    client = s3_server.client()
    client.delete_object(Bucket=s3_bucket, Key=b.key("c0"))
    for m in client.list_objects_v2(Bucket=s3_bucket, Prefix=f"kv/{NS}/r0/manifest/")["Contents"][:1]:
        client.delete_object(Bucket=s3_bucket, Key=m["Key"])
    c = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 0, BLOCK))
    try:
        found = c.scan().found
        assert set(found) == {"c1", "c2", "c9"}
        assert c.last_scan.header_gets + c.last_scan.from_manifests == 3
    finally:
        c.close()


def test_namespaces_and_prefixes_are_isolated(s3_server: MotoServer, s3_bucket: str) -> None:
    a = S3Store(config(s3_server, s3_bucket), StoreContext("nsA", 0, BLOCK))
    b = S3Store(config(s3_server, s3_bucket), StoreContext("nsB", 0, BLOCK))
    other_prefix = S3Store(config(s3_server, s3_bucket, prefix="elsewhere/"), StoreContext("nsA", 0, BLOCK))
    other_rank = S3Store(config(s3_server, s3_bucket), StoreContext("nsA", 1, BLOCK))
    try:
        write(a, "x1", 0, 2)
        assert b.scan().found == {} and other_prefix.scan().found == {} and other_rank.scan().found == {}
        # nsA's bytes copied under nsB's key: the header's namespace does not verify.
        client = s3_server.client()
        client.copy_object(Bucket=s3_bucket, Key=b.key("x1"), CopySource={"Bucket": s3_bucket, "Key": a.key("x1")})
        assert b.scan().found == {} and b.last_scan.problems == {"namespace": 1}
        assert set(a.scan().found) == {"x1"}
    finally:
        for s in (a, b, other_prefix, other_rank):
            s.close()


def test_write_queue_is_bounded(s3_server: MotoServer, s3_bucket: str) -> None:
    proxy = FaultProxy(s3_server.url)
    s = S3Store(config(s3_server, s3_bucket, endpoint_url=proxy.url, max_queued_writes=1, read_timeout_s=0.5,
                       max_attempts=1), StoreContext(NS, 0, BLOCK))
    try:
        proxy.hang(5)
        assert s.submit_write(1, "q1", chunk(0, 1))
        wb = chunk(1, 1)
        assert not s.submit_write(2, "q2", wb)  # refused, nothing queued: the caller keeps wb
        wb.buf.close()
        r = wait(s, 1)
        assert not r.ok and r.reason == "timeout"
    finally:
        proxy.close()
        s.close()


# ---- faults -----------------------------------------------------------------------------------


def test_slowdown_is_retried_with_backoff(s3_server: MotoServer, s3_bucket: str) -> None:
    proxy = FaultProxy(s3_server.url)
    s = S3Store(config(s3_server, s3_bucket, endpoint_url=proxy.url, breaker_failures=10),
                StoreContext(NS, 0, BLOCK))
    try:
        proxy.slowdown(2)
        h = write(s, "slow", 0, 3)
        proxy.slowdown(2)
        r = read(s, "slow", h, [0, 1, 2])
        assert r.ok and r.blocks is not None and r.blocks[2].tobytes() == block(2)
        r.release()
        st = s.stats()
        assert proxy.injected == 4 and st.retries == 4
        assert st.requests == {"PutObject": 3, "GetObject": 3}  # every attempt is a request
        assert st.breaker.state is BreakerState.CLOSED and not st.failures
    finally:
        proxy.close()
        s.close()


def test_persistent_slowdown_fails_within_the_deadline(s3_server: MotoServer, s3_bucket: str) -> None:
    proxy = FaultProxy(s3_server.url)
    cfg = config(s3_server, s3_bucket, endpoint_url=proxy.url, max_attempts=100, deadline_s=1.0,
                 breaker_failures=1000)
    s = S3Store(cfg, StoreContext(NS, 0, BLOCK))
    try:
        h = write(s, "w", 0, 2)
        proxy.slowdown(None)
        t0 = time.monotonic()
        r = read(s, "w", h, [0, 1])
        took = time.monotonic() - t0
        # Either the last retry's 503 or the deadline itself ends it, depending on timing.
        assert not r.ok and r.reason in ("throttled", "deadline")
        assert took < cfg.deadline_s + 0.5
        assert s.stats().retries >= 1  # it did back off and retry before giving up
        t0 = time.monotonic()
        assert s.submit_write(5, "w2", chunk(5, 1))
        r = wait(s, 5)
        assert not r.ok and r.reason in ("throttled", "deadline")
        assert time.monotonic() - t0 < cfg.deadline_s + 0.5
    finally:
        proxy.close()
        s.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_unanswered_request_is_a_deadline_miss_not_a_stall(s3_server: MotoServer, s3_bucket: str,
                                                           engine: str) -> None:
    proxy = FaultProxy(s3_server.url)
    cfg = config(s3_server, s3_bucket, endpoint_url=proxy.url, deadline_s=0.8, read_timeout_s=5.0,
                 io_engine=engine)
    s = S3Store(cfg, StoreContext(NS, 0, BLOCK))
    try:
        h = write(s, "h", 0, 2)
        proxy.hang(2.0)
        t0 = time.monotonic()
        s.submit_read(7, "h", h, [0], [h.keys[0]])
        assert time.monotonic() - t0 < 0.3  # submit never blocks (it does not wait 0.8 s)
        r = wait(s, 7)
        took = time.monotonic() - t0
        assert not r.ok and r.reason == "deadline"
        assert cfg.deadline_s <= took < cfg.deadline_s + 0.5  # reported by poll, at the deadline
        if engine == "nixl":
            # NIXL cannot cancel the held GET: aws-sdk-cpp retries it once the proxy drops
            # it. Let that retry through and finish, so that no request of this test lands
            # on a later test's proxy (which may get this one's port).
            seen = proxy.seen
            proxy.passthrough()
            end = time.monotonic() + 10
            while proxy.seen == seen:
                assert time.monotonic() < end, "the held GET was never retried"
                time.sleep(0.05)
            time.sleep(0.2)
    finally:
        s.close()
        proxy.close()  # releases a held request


def test_server_stopped_then_restarted(tmp_path: Path) -> None:
    with aws_test_env():
        server = MotoServer(tmp_path)
        server.start()
        bucket = server.create_bucket()
        cfg = config(server, bucket)
        s = S3Store(cfg, StoreContext(NS, 0, BLOCK))
        try:
            h = write(s, "before", 0, 2, job=1)
            server.stop()
            # Reads and writes fail, each within its deadline; the breaker opens.
            for job in range(10, 13):
                t0 = time.monotonic()
                r = read(s, "before", h, [0, 1], job=job)
                assert not r.ok and r.reason in ("unavailable", "breaker_open")
                assert time.monotonic() - t0 < cfg.deadline_s + 0.5
            assert s.breaker.state is BreakerState.OPEN
            # While open: requests fail at once, none is sent.
            sent = sum(requests(s).values())
            t0 = time.monotonic()
            assert s.submit_write(20, "during", chunk(5, 1))
            r = wait(s, 20)
            assert not r.ok and r.reason == "breaker_open" and time.monotonic() - t0 < 1.0
            assert sum(requests(s).values()) == sent
            snap = s.breaker.snapshot()
            assert snap.opens >= 1 and snap.rejected >= 1

            server.start()  # same port, empty again
            server.create_bucket(bucket)
            time.sleep(cfg.breaker_cooldown_s)
            assert s.breaker.state is BreakerState.HALF_OPEN
            h2 = write(s, "after", 30, 2, job=30)  # the probe succeeds: closed again
            assert s.breaker.state is BreakerState.CLOSED
            r = read(s, "after", h2, [1], job=31)
            assert r.ok and r.blocks is not None and r.blocks[0].tobytes() == block(31)
            r.release()
            assert read(s, "before", h, [0], job=32).reason == "missing"  # moto forgot it
        finally:
            s.close(timeout_s=5)
            server.stop()


def test_tls_endpoint_with_a_private_ca_bundle(tmp_path: Path) -> None:
    """On-prem S3 (MinIO, Ceph RGW) behind a certificate from the site's own CA."""
    with aws_test_env():
        server = MotoServer(tmp_path, tls_dir=tmp_path)
        server.start()
        try:
            bucket = server.create_bucket()
            s = S3Store(config(server, bucket, ca_bundle=server.ca_bundle), StoreContext(NS, 0, BLOCK))
            h = write(s, "tls", 0, 2)
            r = read(s, "tls", h, [1])
            assert r.ok and r.blocks is not None and r.blocks[0].tobytes() == block(1)
            r.release()
            s.close()
            # Without the CA the certificate does not verify: a prompt failure, not retried.
            untrusted = S3Store(config(server, bucket, deadline_s=10.0), StoreContext(NS, 0, BLOCK))
            t0 = time.monotonic()
            r = read(untrusted, "tls", h, [1])
            assert not r.ok and r.reason == "tls" and time.monotonic() - t0 < 2.0
            assert untrusted.stats().retries == 0
            untrusted.close()
        finally:
            server.stop()


def test_credentials_never_in_repr_or_logs(s3_server: MotoServer, s3_bucket: str,
                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    proxy = FaultProxy(s3_server.url)
    s = S3Store(config(s3_server, s3_bucket, endpoint_url=proxy.url, breaker_failures=2),
                StoreContext(NS, 0, BLOCK))
    try:
        h = write(s, "c", 0, 1)
        proxy.slowdown(None)
        texts = [repr(s), repr(s.config), repr(s.stats()), repr(s.last_scan)]
        for job in range(3):
            r = read(s, "c", h, [0], job=10 + job)
            texts.append(repr(r))
        s.scan()
        texts.append(repr(s.last_scan))
    finally:
        proxy.close()
        s.close()
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("vllm_kvtier")]
    assert any("throttled" in m for m in ours)  # failures were logged...
    everything = "\n".join(texts + ours)
    assert SECRET_ACCESS_KEY not in everything and ACCESS_KEY_ID not in everything  # ...without credentials
    # botocore's own DEBUG logging signs requests but never prints the secret.
    assert all(SECRET_ACCESS_KEY not in r.getMessage() for r in caplog.records)
    assert ACCESS_KEY_ID in os.environ["AWS_ACCESS_KEY_ID"]  # the test really had them set


# ---- pure parts (no server) -------------------------------------------------------------------


def test_config_validation_names_the_field(tmp_path: Path) -> None:
    ok = S3Config(bucket="my-bucket")
    cases = {
        "s3.bucket": dict(bucket="No_Such!"),
        "s3.endpoint_url": dict(endpoint_url="http://user:pw@host:9000"),
        "s3.ca_bundle": dict(ca_bundle=str(tmp_path / "missing.pem")),
        "s3.deadline_s": dict(deadline_s=0),
        "s3.scan_deadline_s": dict(scan_deadline_s=0),
        "s3.multipart_part_bytes": dict(multipart_part_bytes=1 << 20),
        "s3.io_threads": dict(io_threads=0),
        "s3.prefix": dict(prefix="/abs"),
        "s3.io_engine": dict(io_engine="curl"),
    }
    for field, kw in cases.items():
        with pytest.raises(ConfigError) as e:
            replace(ok, **kw)
        assert e.value.field == field
    with pytest.raises(ConfigError, match="export AWS_PROFILE") as e:
        replace(ok, io_engine="nixl", profile="team")  # aws-sdk-cpp's chain takes no per-client profile
    assert e.value.field == "s3.io_engine"
    with pytest.raises(ConfigError, match="must not embed credentials") as e:
        S3Config(bucket="b-1", endpoint_url="https://AKIA:secret@s3.example.com")
    assert "secret" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        replace(ok, scan_deadline_s=2 * 86400.0)
    assert e.value.field == "s3.scan_deadline_s"


def test_breaker_opens_fails_fast_and_probes_after_cooldown() -> None:
    now = [0.0]
    b = CircuitBreaker(failures=3, cooldown_s=10.0, clock=lambda: now[0])
    for _ in range(2):
        assert b.allow()
        b.record_failure()
    assert b.state is BreakerState.CLOSED
    assert b.allow()
    b.record_success()  # a success resets the count
    for _ in range(3):
        assert b.allow()
        b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allow()
    now[0] = 10.0
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow()  # the one probe
    assert not b.allow()  # others wait for its outcome
    b.record_failure()  # probe failed: open again, for a full cool-down
    assert b.state is BreakerState.OPEN and not b.allow()
    now[0] = 20.0
    assert b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allow()
    snap = b.snapshot()
    assert (snap.opens, snap.rejected, snap.consecutive_failures) == (2, 3, 0)


def test_manifest_round_trip_and_damage() -> None:
    from vllm_kvtier.chunkformat import ChunkFormatError, make_header

    rng = random.Random(0)
    entries = [(f"obj-{i}", make_header(NS, [key(i * 10 + j) for j in range(1 + i % 70)],
                                        [rng.getrandbits(32) for _ in range(1 + i % 70)], BLOCK))
               for i in range(100)]
    data = encode_manifest(NS, entries)
    assert len(data) < 100 * 4096 // 4  # the headers' zero padding is compressed away
    assert decode_manifest(data, NS) == dict(entries)
    with pytest.raises(ChunkFormatError, match="namespace"):
        decode_manifest(data, "other")
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(ChunkFormatError):
        decode_manifest(bytes(bad), NS)


def test_missing_boto3_gives_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    with pytest.raises(ImportError, match=re.escape("pip install 'vllm-kvtier[s3]'")):
        S3Store(S3Config(bucket="b-1"), StoreContext(NS, 0, BLOCK))


def test_missing_nixl_gives_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    pytest.importorskip("boto3")
    for m in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        monkeypatch.setitem(sys.modules, m, None)  # as if not installed
    with pytest.raises(ConfigError, match=re.escape("pip install nixl-cu12")) as e:
        S3Store(S3Config(bucket="b-1", io_engine="nixl"), StoreContext(NS, 0, BLOCK))
    assert e.value.field == "s3.io_engine"


def test_block_crc_is_zlib_crc32_whatever_the_implementation() -> None:
    import zlib

    from vllm_kvtier.chunkformat import block_crc

    data = os.urandom(1 << 20)
    assert block_crc(data) == block_crc(memoryview(data)) == zlib.crc32(data)
    assert block_crc(b"") == 0


def test_read_body_into_without_urllib3_layers_goes_through_readinto() -> None:
    import io

    from vllm_kvtier.chunkformat import ChunkFormatError
    from vllm_kvtier.tiers.s3.store import read_body_into

    out = bytearray(10)
    read_body_into(io.BytesIO(b"0123456789"), memoryview(out))
    assert out == b"0123456789"
    with pytest.raises(ChunkFormatError, match="truncated"):
        read_body_into(io.BytesIO(b"0123"), memoryview(bytearray(10)))


def test_start_up_scan_stops_at_its_deadline_and_the_next_scan_goes_on(s3_server: MotoServer,
                                                                      s3_bucket: str) -> None:
    """A slow endpoint (0.3 s a request) and 30 objects whose headers need a GET each (no
    manifest): the start-up scan through ``s3.scan_deadline_s`` (here 1.5 s) starts no
    request after it, indexes what it verified by then (a partial index, ``cut_short``,
    the objects left out counted as ``deadline``), and the next scan GETs only the
    headers the first did not read. The planner built on it counts ``scan_cut_short``."""
    from vllm_kvtier.config.lower import S3TierConfig
    from vllm_kvtier.config.sections import KVTierConfig
    from vllm_kvtier.engine.lower import make_planners
    from vllm_kvtier.metrics import Counters

    writer = S3Store(config(s3_server, s3_bucket, manifest_every_writes=0), StoreContext(NS, 0, BLOCK))
    for i in range(30):
        write(writer, f"c{i:02d}", i, 1, job=i + 1)
    writer.close()
    s3_server.client().delete_object(Bucket=s3_bucket, Key=writer.manifest_key())
    proxy = FaultProxy(s3_server.url)
    cfg = config(s3_server, s3_bucket, endpoint_url=proxy.url, scan_deadline_s=1.5, writer_id="reader")
    proxy.delay(0.3)
    st = S3Store(cfg, StoreContext(NS, 0, BLOCK))
    try:
        found = st.scan(deadline=time.monotonic() + cfg.scan_deadline_s).found
        rep = st.last_scan
        assert rep.cut_short and rep.complete
        assert len(found) < 30 and rep.problems == {"deadline": 30 - len(found)}
        proxy.passthrough()
        assert len(st.scan().found) == 30
        assert st.last_scan.header_gets == 30 - len(found) and not st.last_scan.cut_short

        proxy.delay(0.3)
        counters = Counters()
        (p,) = make_planners(KVTierConfig(s3=S3TierConfig(store=cfg, rescan_interval_s=0)), namespace=NS,
                             world_size=1, block_bytes_per_rank=BLOCK, counters=counters)
        try:
            assert counters.totals["scan_cut_short|s3"] == 1
            assert len(p.index) < 30
        finally:
            p.close()
    finally:
        proxy.close()
        st.close()


def test_two_instances_on_one_host_write_as_two_writers(s3_server: MotoServer, s3_bucket: str, tmp_path) -> None:
    """Instances on one host name (several per node, outside Kubernetes) each have their
    own NVMe path: the default writer id tells them apart, so neither takes the other's
    manifest or chunks for its own. The same instance restarted keeps its id."""
    from vllm_kvtier.config.parse import parse_config
    from vllm_kvtier.engine.lower import TierContext
    from vllm_kvtier.metrics import Counters
    from vllm_kvtier.tiers.registry import open_store, tier_spec

    def writer(nvme: str | None) -> str:
        extra: dict[str, Any] = {"s3": {"bucket": s3_bucket, "endpoint_url": s3_server.url, "path_style": True}}
        if nvme is not None:
            extra["nvme"] = {"path": nvme, "capacity_bytes": 1 << 30}
        cfg = parse_config(extra)
        tier_ctx = TierContext.of(cfg, namespace=NS, block_bytes=BLOCK, kv_dtype=None, counters=Counters())
        spec = tier_spec("s3")
        assert cfg.s3 is not None
        _, ctx = tier_ctx.store_context(spec, cfg.s3, rank=0, lookup_only=True)
        st = open_store(spec, cfg.s3, ctx)
        try:
            assert isinstance(st, S3Store)
            return st.writer_id
        finally:
            st.close()

    a, b = writer(str(tmp_path / "a")), writer(str(tmp_path / "b"))
    assert a != b
    assert writer(str(tmp_path / "a")) == a  # a restart: the same writer
    assert writer(None) == writer(None) not in (a, b)  # no NVMe path: the host's id, as before
