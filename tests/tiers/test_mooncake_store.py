"""The Mooncake tier's submit/poll store against a real mooncake_master on 127.0.0.1:
round trips, misses, damaged values (overwritten through a raw client), another
namespace's bytes, the master going away and coming back, and the configuration's checks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit import mooncake_server as mcsrv
from testkit.mooncake_server import MooncakeMaster, requires_mooncake
from vllm_kvtier.chunkformat import ChunkHeader
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.tiers.base import IOResult
from vllm_kvtier.tiers.buffers import WriteBuffer
from vllm_kvtier.tiers.mooncake.store import MooncakeConfig, MooncakeStore
from vllm_kvtier.tiers.registry import StoreContext

mooncake_master = mcsrv.mooncake_master  # fixture: one master for this module

BLOCK = 5000  # not a multiple of 4096: the chunk format pads it
NS = "mctest000000000"


def block(chunk: int, i: int) -> bytes:
    return bytes((chunk * 31 + i * 7 + j) % 251 for j in range(BLOCK))


def bkey(chunk: int, i: int) -> bytes:
    return (chunk * 100 + i).to_bytes(4, "big") * 8


def write_buffer(chunk: int, nblocks: int) -> WriteBuffer:
    wb = WriteBuffer([bkey(chunk, i) for i in range(nblocks)], BLOCK)
    for i in range(nblocks):
        with wb.block(i) as dst:
            dst[:] = block(chunk, i)
    return wb


def wait_for(store: MooncakeStore, job_id: int, limit_s: float = 20.0) -> IOResult:
    """Poll until ``job_id`` completes (the test fails if it never does)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for r in store.poll():
            if r.job_id == job_id:
                return r
            r.release()
        store.wait(0.01)
    raise AssertionError(f"job {job_id} did not complete within {limit_s} s")


def put(store: MooncakeStore, job_id: int, chunk_id: str, chunk: int, nblocks: int) -> ChunkHeader:
    assert store.submit_write(job_id, chunk_id, write_buffer(chunk, nblocks))
    res = wait_for(store, job_id)
    assert res.ok, res.reason
    assert res.header is not None and res.header.keys == tuple(bkey(chunk, i) for i in range(nblocks))
    return res.header


def read(store: MooncakeStore, job_id: int, chunk_id: str, header: ChunkHeader | None,
         positions: list[int], chunk: int) -> tuple[IOResult, list[bytes]]:
    """Read ``positions`` of ``chunk_id``, which must hold chunk number ``chunk``'s keys."""
    store.submit_read(job_id, chunk_id, header, positions, [bkey(chunk, p) for p in positions])
    res = wait_for(store, job_id)
    data = [b.tobytes() for b in res.blocks] if res.ok and res.blocks is not None else []
    res.release()
    return res, data


@pytest.fixture
def store(mooncake_master: MooncakeMaster) -> Iterator[MooncakeStore]:
    s = MooncakeStore(mooncake_master.config(), StoreContext(NS, 0, BLOCK))
    yield s
    s.close(30.0)



@pytest.mark.mooncake
@requires_mooncake
def test_round_trip(store: MooncakeStore) -> None:
    h = put(store, 1, "chunk-a", 1, 3)
    res, data = read(store, 2, "chunk-a", h, [2, 0], 1)
    assert res.ok and data == [block(1, 2), block(1, 0)]
    assert res.nbytes == h.total_bytes
    # Without the header (another instance wrote it): read, verified, and handed back.
    res, data = read(store, 3, "chunk-a", None, [1], 1)
    assert res.ok and data == [block(1, 1)]
    assert res.header == h
    assert store.exists(["chunk-a", "chunk-none"]) == [True, False]
    reqs = store.stats().requests
    assert reqs["batch_put_from"] >= 1 and reqs["batch_get_into"] >= 2


@pytest.mark.mooncake
@requires_mooncake
def test_many_jobs_in_flight(store: MooncakeStore) -> None:
    """Jobs queued together are moved in batches; every one completes with its own bytes."""
    n = 12
    for c in range(n):
        assert store.submit_write(c, f"many-{c}", write_buffer(c, 2))
    done = wait_all(store, set(range(n)))
    assert all(r.ok for r in done.values())
    for c in range(n):
        store.submit_read(100 + c, f"many-{c}", done[c].header, [1], [bkey(c, 1)])
    got = wait_all(store, {100 + c for c in range(n)})
    for c in range(n):
        res = got[100 + c]
        assert res.ok and res.blocks is not None and res.blocks[0].tobytes() == block(c, 1)
        res.release()


def wait_all(store: MooncakeStore, jobs: set[int], limit_s: float = 20.0) -> dict[int, IOResult]:
    done: dict[int, IOResult] = {}
    deadline = time.monotonic() + limit_s
    while set(done) != jobs:
        assert time.monotonic() < deadline, f"jobs {sorted(jobs - set(done))} did not complete"
        for r in store.poll():
            done[r.job_id] = r
        store.wait(0.01)
    return done


@pytest.mark.mooncake
@requires_mooncake
def test_missing_chunk_is_a_miss(store: MooncakeStore) -> None:
    t0 = time.monotonic()
    res, _ = read(store, 1, "never-written", None, [0], 0)
    assert not res.ok and res.reason == "missing"
    assert time.monotonic() - t0 < store.config.deadline_s  # an answer, not a timeout
    h = put(store, 2, "deleted", 2, 1)
    store.submit_delete("deleted")
    deadline = time.monotonic() + 10
    while store.exists(["deleted"]) != [False]:
        assert time.monotonic() < deadline, "delete did not take effect"
        store.poll()
        time.sleep(0.02)
    res, _ = read(store, 3, "deleted", h, [0], 2)
    assert not res.ok and res.reason == "missing"


@pytest.mark.mooncake
@requires_mooncake
def test_damaged_value_fails_its_checksum(store: MooncakeStore, mooncake_master: MooncakeMaster) -> None:
    h = put(store, 1, "damaged", 3, 2)
    with mooncake_master.raw_client() as raw:
        value = bytearray(raw.get(store.key("damaged")))
        assert len(value) == h.total_bytes
        value[h.block_offset(1) + 17] ^= 0xFF  # one byte of block 1
        assert raw.upsert(store.key("damaged"), bytes(value)) == 0
        res, _ = read(store, 2, "damaged", h, [1], 3)
        assert not res.ok and res.reason == "checksum"
        res, data = read(store, 3, "damaged", h, [0], 3)  # only the requested blocks are checked
        assert res.ok and data == [block(3, 0)]
        # Garbage in place of the header: unreadable whether or not we hold the header.
        assert raw.upsert(store.key("damaged"), bytes(h.total_bytes)) == 0
        res, _ = read(store, 4, "damaged", h, [0], 3)
        assert not res.ok and res.reason == "checksum"
        res, _ = read(store, 5, "damaged", None, [0], 3)
        assert not res.ok and res.reason == "format"
    assert store.stats().failures.get("checksum") == 2


@pytest.mark.mooncake
@requires_mooncake
def test_another_namespace_is_never_read(store: MooncakeStore, mooncake_master: MooncakeMaster) -> None:
    """A value copied under our key from another namespace (an incompatible engine) is refused."""
    other = MooncakeStore(mooncake_master.config(global_segment_bytes=0),
                          StoreContext("othermodel00000", 0, BLOCK))
    try:
        put(other, 1, "shared", 4, 1)
        with mooncake_master.raw_client() as raw:
            assert raw.put(store.key("shared"), raw.get(other.key("shared"))) == 0
        res, _ = read(store, 2, "shared", None, [0], 4)
        assert not res.ok and res.reason == "namespace"
    finally:
        other.close(30.0)


@pytest.mark.mooncake
@requires_mooncake
def test_closed_store_refuses_work(mooncake_master: MooncakeMaster) -> None:
    s = MooncakeStore(mooncake_master.config(), StoreContext(NS, 1, BLOCK))
    s.close(30.0)
    wb = write_buffer(5, 1)
    assert not s.submit_write(1, "late", wb)
    wb.buf.close()
    s.submit_read(2, "late", None, [0], [bkey(5, 0)])
    res = wait_for(s, 2)
    assert not res.ok and res.reason == "closed"
    s.close()  # idempotent


@pytest.mark.slow  # waits out the client's own RPC timeouts (~14 s)
@pytest.mark.mooncake
@requires_mooncake
def test_master_gone_reads_fail_within_the_deadline(tmp_path: Path) -> None:
    master = MooncakeMaster(tmp_path)
    master.start()
    s = MooncakeStore(master.config(deadline_s=1.0, breaker_cooldown_s=0.5), StoreContext(NS, 0, BLOCK))
    try:
        h = put(s, 1, "before", 6, 1)
        master.stop()
        for job in range(10, 14):  # the first fails at once (connection closed), later ones block in the client
            t0 = time.monotonic()
            res, _ = read(s, job, "before", h, [0], 6)
            assert not res.ok and res.reason in ("unavailable", "deadline", "breaker_open"), res.reason
            assert time.monotonic() - t0 < s.config.deadline_s + 0.5
        assert s.exists(["before"]) == [False]
        # The master comes back (empty): the store recovers without a restart.
        master.start()
        deadline = time.monotonic() + 30
        job = 100
        while True:
            job += 1
            wb = write_buffer(7, 1)
            if not s.submit_write(job, "after", wb):
                wb.buf.close()
            else:
                res = wait_for(s, job)
                if res.ok:
                    break
            assert time.monotonic() < deadline, "the store did not recover after the master came back"
            time.sleep(0.2)
        res, data = read(s, 999, "after", res.header, [0], 7)
        assert res.ok and data == [block(7, 0)]
    finally:
        t0 = time.monotonic()
        s.close(60.0)
        assert time.monotonic() - t0 < 60
        master.stop()


@pytest.mark.mooncake
@requires_mooncake
def test_unreachable_master_fails_fast(tmp_path: Path) -> None:
    cfg = MooncakeConfig(master=f"127.0.0.1:{mcsrv.free_port()}", connect_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="not reachable"):
        MooncakeStore(cfg, StoreContext(NS, 0, BLOCK))
    assert time.monotonic() - t0 < 5  # not Mooncake's own 90 s of setup retries


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"master": "no-port"}, "mooncake.master"),
        ({"master": "host:70000"}, "mooncake.master"),
        ({"protocol": "udp"}, "mooncake.protocol"),
        ({"metadata_server": ""}, "mooncake.metadata_server"),
        ({"device_name": "mlx5_0, mlx5_1"}, "mooncake.device_name"),
        ({"global_segment_bytes": -1}, "mooncake.global_segment_bytes"),
        ({"transfer_buffer_bytes": 4096}, "mooncake.transfer_buffer_bytes"),
        ({"deadline_s": 0}, "mooncake.deadline_s"),
        ({"io_threads": 0}, "mooncake.io_threads"),
        ({"replicas": 0}, "mooncake.replicas"),
    ],
)
def test_config_names_the_bad_field(kw: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"master": "127.0.0.1:50051", **kw}
    with pytest.raises(ConfigError) as e:
        MooncakeConfig(**args)  # type: ignore[arg-type]
    assert e.value.field == field


def test_config_defaults() -> None:
    cfg = MooncakeConfig(master="[::1]:50051", protocol="rdma", device_name="mlx5_0,mlx5_1")
    assert cfg.master_host_port == ("::1", 50051)
    assert cfg.metadata_server == "P2PHANDSHAKE"
