"""One contract suite, run against every BlockTier (vllm_kvtier.tiers.base).

Each tier is the real medium: a dict, a CPU pool, chunk files in tmp_path, objects in a
bucket of a moto S3 server on 127.0.0.1. The NVMe and S3 tiers run twice: with their default
I/O engine and with NIXL's (``nvme-nixl``: the POSIX backend; ``s3-nixl``: the OBJ backend). Damage is done through the medium (a stored
bytearray, the pool's plane, the file on disk, the object overwritten with boto3, the value
overwritten through a raw Mooncake client), never by calling into the tier's private state.
The Mooncake tier runs against a real ``mooncake_master`` on 127.0.0.1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from testkit import mooncake_server as mcsrv
from testkit import s3_server as s3srv
from testkit.mooncake_server import MooncakeMaster, requires_mooncake
from testkit.s3_server import MotoServer, plain_client, requires_s3
from tests.nixl_env import nixl_env, or_skip, requires_nixl
from vllm_kvtier.metrics import sample_key
from vllm_kvtier.tiers.base import MAX_KEY_BYTES, BlockTier
from vllm_kvtier.tiers.keyed import CPUTier, MooncakeTier, NVMeTier, S3Tier
from vllm_kvtier.tiers.memory import MemoryTier

BLOCK = 3000  # deliberately not a multiple of 4096: the disk format pads it
FITS = 6  # blocks each tier is sized to hold
s3_server = s3srv.s3_server  # fixture: a moto server for this module, started by the s3 tier only
mooncake_master = mcsrv.mooncake_master  # fixture: a mooncake_master, started by the mooncake tier only
nixl_env = nixl_env  # fixture: UCX/NIXL environment, used by the nixl variants only


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8  # 32 bytes, like a hash


def block(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(BLOCK))


@pytest.fixture(params=[
    "memory", "cpu", "nvme",
    pytest.param("nvme-nixl", marks=[pytest.mark.nixl, requires_nixl]),
    pytest.param("s3", marks=[pytest.mark.s3, requires_s3]),
    pytest.param("s3-nixl", marks=[pytest.mark.s3, pytest.mark.nixl, requires_s3, requires_nixl]),
    pytest.param("mooncake", marks=[pytest.mark.mooncake, requires_mooncake]),
])
def tier(request: pytest.FixtureRequest, tmp_path) -> Iterator[BlockTier]:
    t: BlockTier
    if request.param.endswith("-nixl"):
        request.getfixturevalue("nixl_env")
    if request.param == "memory":
        t = MemoryTier(FITS * BLOCK, BLOCK)
    elif request.param == "cpu":
        t = CPUTier(FITS * BLOCK, BLOCK)
    elif request.param in ("nvme", "nvme-nixl"):
        engine = "nixl" if request.param == "nvme-nixl" else "posix"
        t = or_skip(lambda: NVMeTier(tmp_path / "nvme", FITS * NVMeTier.file_bytes(BLOCK), BLOCK, io_engine=engine))
    elif request.param == "mooncake":
        master: MooncakeMaster = request.getfixturevalue("mooncake_master")
        # timeout_s: close waits for the client to leave the pool (~2 s), inside the test.
        t = MooncakeTier(master.config(), FITS * MooncakeTier.file_bytes(BLOCK), BLOCK, timeout_s=15.0)
    else:
        from vllm_kvtier.tiers.s3 import S3Config

        server: MotoServer = request.getfixturevalue("s3_server")
        cfg = S3Config(bucket=server.create_bucket(), prefix="contract/", endpoint_url=server.url,
                       path_style=True, io_threads=2, io_engine="nixl" if request.param == "s3-nixl" else "boto3")
        t = or_skip(lambda: S3Tier(cfg, FITS * S3Tier.file_bytes(BLOCK), BLOCK))
    yield t
    t.close()


def count(t: BlockTier, metric: str) -> float:
    return t.counters.totals.get(sample_key(metric, t.name), 0)


def corrupt(t: BlockTier, k: bytes) -> None:
    """Flip one byte of the stored block, through the medium."""
    if isinstance(t, MemoryTier):
        raw = t.raw(k)
        assert raw is not None
        raw[BLOCK // 2] ^= 0xFF
    elif isinstance(t, CPUTier):
        slot = t.slot_of(k)
        assert slot is not None
        t.pool.planes[0][slot][BLOCK // 2] ^= 0xFF
    elif isinstance(t, NVMeTier):
        loc = t.location(k)
        assert loc is not None
        path, offset = loc
        with open(path, "r+b") as f:
            f.seek(offset + BLOCK // 2)
            b = f.read(1)
            f.seek(offset + BLOCK // 2)
            f.write(bytes([b[0] ^ 0xFF]))
    elif isinstance(t, S3Tier):
        # The whole object replaced by garbage of the same size, straight through boto3.
        loc = t.location(k)
        assert loc is not None
        cfg = t.store.config
        assert cfg.endpoint_url is not None
        client, bucket = plain_client(cfg.endpoint_url, cfg.ca_bundle), cfg.bucket
        size = client.head_object(Bucket=bucket, Key=loc[0])["ContentLength"]
        client.put_object(Bucket=bucket, Key=loc[0], Body=os.urandom(size))
    elif isinstance(t, MooncakeTier):
        # One byte of the block flipped, written back over the value through a raw client.
        loc = t.location(k)
        assert loc is not None
        mkey, offset = loc
        with mcsrv.raw_client(t.store.config.master) as client:
            value = bytearray(client.get(mkey))
            value[offset + BLOCK // 2] ^= 0xFF
            assert client.upsert(mkey, bytes(value)) == 0
    else:
        raise AssertionError(f"no fault drill for {type(t)}")


def test_is_a_block_tier(tier: BlockTier) -> None:
    assert isinstance(tier, BlockTier)
    assert tier.block_bytes == BLOCK
    assert tier.usage_bytes() == 0


def test_round_trip(tier: BlockTier) -> None:
    assert tier.put(key(1), block(1))
    assert tier.put(key(2), memoryview(block(2)))  # memoryview accepted too
    assert tier.contains(key(1)) and tier.contains(key(2))
    assert tier.get(key(1)) == block(1)
    assert tier.get(key(2)) == block(2)
    assert 0 < tier.usage_bytes() <= tier.capacity_bytes


def test_put_is_idempotent(tier: BlockTier) -> None:
    assert tier.put(key(1), block(1))
    usage = tier.usage_bytes()
    assert tier.put(key(1), block(1))
    assert tier.usage_bytes() == usage
    assert tier.get(key(1)) == block(1)


def test_missing_key_is_a_miss(tier: BlockTier) -> None:
    assert tier.get(key(9)) is None
    assert not tier.contains(key(9))
    assert not tier.delete(key(9))
    assert count(tier, "load_failures") == 0  # a plain miss is not a failure


def test_delete(tier: BlockTier) -> None:
    assert tier.put(key(1), block(1)) and tier.put(key(2), block(2))
    usage = tier.usage_bytes()
    assert tier.delete(key(1))
    assert not tier.contains(key(1)) and tier.get(key(1)) is None
    assert tier.usage_bytes() < usage
    assert tier.get(key(2)) == block(2)
    assert tier.put(key(1), block(1)) and tier.get(key(1)) == block(1)  # can store again


def test_capacity_bound_and_lru(tier: BlockTier) -> None:
    assert tier.put(key(0), block(0))
    per_block = tier.usage_bytes()
    fits = tier.capacity_bytes // per_block
    assert fits == FITS
    n = 4 * fits
    for i in range(1, n):
        assert tier.put(key(i), block(i))
        assert tier.usage_bytes() <= tier.capacity_bytes
    assert count(tier, "evictions") == n - fits
    assert not tier.contains(key(0)) and tier.get(key(0)) is None
    for i in range(n - fits, n):
        assert tier.get(key(i)) == block(i)
    # A hit refreshes recency: the oldest survivor, just read, outlives the next one.
    oldest = n - fits
    assert tier.get(key(oldest)) == block(oldest)
    assert tier.put(key(n), block(n))
    assert tier.contains(key(oldest)) and not tier.contains(key(oldest + 1))


def test_refused_puts(tier: BlockTier) -> None:
    assert not tier.put(key(1), block(1)[:-1])
    assert not tier.put(key(1), block(1) + b"x")
    assert not tier.put(b"", block(1))
    assert not tier.put(b"k" * (MAX_KEY_BYTES + 1), block(1))
    assert count(tier, "store_failures") == 4
    assert not tier.contains(key(1)) and tier.usage_bytes() == 0


def test_checksum_failure_is_a_counted_miss(tier: BlockTier) -> None:
    assert tier.put(key(1), block(1)) and tier.put(key(2), block(2))
    corrupt(tier, key(1))
    assert tier.contains(key(1))  # contains does no verification
    assert tier.get(key(1)) is None
    assert not tier.contains(key(1))
    assert count(tier, "load_failures") == 1
    assert tier.get(key(2)) == block(2)  # the rest keeps serving
    assert tier.put(key(1), block(1)) and tier.get(key(1)) == block(1)


def test_close(tier: BlockTier) -> None:
    assert tier.put(key(1), block(1))
    tier.close()
    assert not tier.put(key(2), block(2))
    assert tier.get(key(1)) is None
    tier.close()  # idempotent
