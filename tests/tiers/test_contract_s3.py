"""The store contract, bound to the S3 store against the real moto server: chunk objects
moved by the ``boto3`` engine and by NIXL's OBJ backend (``nixl``; skipped with the reason
where nixl or its OBJ plugin is missing). Damage is done to the objects themselves, with a
plain boto3 client. Also S3's own adversarial cases: forged sizes met by the start-up scan
(in a listed object's header and in a manifest), each dropped with a named reason and at a
bounded memory cost."""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest

from testkit import s3_server as s3srv
from testkit.s3_server import MotoServer
from tests.nixl_env import nixl_engine_env, nixl_env, or_skip, requires_nixl
from tests.tiers.contract import BLOCK, KEY, MAX_BLOCKS, NS, OTHER_KEY, StoreContract, key
from vllm_kvtier.chunkformat import encode_header, make_header
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.auth import ChunkAuth
from vllm_kvtier.tiers.buffers import BufferPool
from vllm_kvtier.tiers.registry import StoreContext
from vllm_kvtier.tiers.s3.manifest import MAGIC, SIG_BYTES, VERSION, encode_manifest, sign_manifest
from vllm_kvtier.tiers.s3.store import S3Config, S3Store

pytestmark = pytest.mark.s3
s3_server = s3srv.s3_server  # fixtures: a moto server for this module, a fresh bucket per test
s3_bucket = s3srv.s3_bucket
nixl_env = nixl_env  # fixtures: the UCX/NIXL environment of the nixl binding
nixl_engine_env = nixl_engine_env

#: What a scan of a few objects may allocate at most (listing XML, a header probe, the
#: scan's threads), however large the sizes the stored bytes claim.
SCAN_SMALL = 2 << 20


class S3Binding(StoreContract):
    io_engine = "boto3"

    @pytest.fixture(autouse=True)
    def _server(self, s3_server: MotoServer, s3_bucket: str) -> None:
        self.server, self.bucket = s3_server, s3_bucket
        self.raw = s3_server.client()

    def config(self, **kw: Any) -> S3Config:
        base: dict[str, Any] = dict(bucket=self.bucket, prefix="kv/", endpoint_url=self.server.url, path_style=True,
                                    io_threads=2, connect_timeout_s=0.5, read_timeout_s=2.0, deadline_s=5.0,
                                    backoff_base_s=0.02, backoff_max_s=0.2, io_engine=self.io_engine)
        base.update(kw)
        return S3Config(**base)

    def make_store(self, tmp_path: Path, **kw: Any) -> S3Store:
        queued = kw.pop("max_queued_writes", 64)
        rank = kw.pop("rank", 0)
        ctx = StoreContext(NS, rank, BLOCK, buffers=kw.pop("buffers", None), auth=kw.pop("auth", None))
        return or_skip(lambda: S3Store(self.config(max_queued_writes=queued), ctx, **kw))

    def get_raw(self, store: S3Store, chunk_id: str) -> bytes:  # type: ignore[override]
        return bytes(self.raw.get_object(Bucket=self.bucket, Key=store.key(chunk_id))["Body"].read())

    def put_raw(self, store: S3Store, chunk_id: str, data: bytes) -> None:  # type: ignore[override]
        self.raw.put_object(Bucket=self.bucket, Key=store.key(chunk_id), Body=data)

    # ---- S3's own: what the start-up scan reads is bounded too ------------------------------

    def scan_bounded(self, store: S3Store, **kw: Any) -> Any:
        tracemalloc.start()
        try:
            res = store.scan(**kw)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak <= SCAN_SMALL, peak
        return res

    @pytest.mark.parametrize("forge", ["nblocks", "many_keys"])
    def test_forged_header_in_the_bucket_is_dropped_at_scan(self, store: S3Store, pool: BufferPool,
                                                            forge: str) -> None:
        self.write(store, pool, "ok", 0, 1)
        if forge == "nblocks":  # a real chunk whose block count says 2**32 - 1
            self.write(store, pool, "forged", 0, 2, job=2)
            data = bytearray(self.get_raw(store, "forged"))
            data[28:32] = ((1 << 32) - 1).to_bytes(4, "little")
        else:  # a header that verifies, claiming more blocks than this store writes
            n = MAX_BLOCKS * 40
            fake = make_header(NS, [key(i) for i in range(n)], [0] * n, BLOCK)
            data = bytearray(fake.header_bytes + BLOCK)
            encode_header(fake, memoryview(data))
        self.put_raw(store, "forged", bytes(data))
        other = self.make_store(Path("."), max_chunk_blocks=MAX_BLOCKS)
        try:
            res = self.scan_bounded(other, cleanup=True)
        finally:
            other.close(timeout_s=10)
        assert set(res.found) == {"ok"}
        assert res.problems == {FailureReason.TOO_LARGE: 1}
        assert FailureReason.TOO_LARGE.damaged
        keys = [o["Key"] for o in self.raw.list_objects_v2(Bucket=self.bucket)["Contents"]]
        assert store.key("forged") not in keys and store.key("ok") in keys  # the owner's scan deletes it

    @pytest.mark.parametrize("forge", ["entries", "zip_bomb", "header_length", "checksum"])
    def test_forged_manifest_is_ignored_at_scan(self, store: S3Store, pool: BufferPool, forge: str) -> None:
        h = self.write(store, pool, "ok", 0, 2)
        fixed = struct.Struct("<8sI16sIQ")
        if forge == "entries":
            payload = zlib.compress(b"")
            body = fixed.pack(MAGIC, VERSION, NS.encode(), (1 << 32) - 1, len(payload)) + payload
        elif forge == "zip_bomb":  # 64 KiB that inflate to 64 MiB (an id length of 65535 first)
            z = zlib.compressobj(9)
            payload = b"".join(z.compress(b"\xff" * (1 << 20)) for _ in range(64)) + z.flush()
            body = fixed.pack(MAGIC, VERSION, NS.encode(), 1, len(payload)) + payload
        elif forge == "header_length":  # one entry announcing a 4 GiB header
            entry = struct.pack("<H", 2) + b"ok" + struct.pack("<I", (1 << 32) - 1)
            payload = zlib.compress(entry)
            body = fixed.pack(MAGIC, VERSION, NS.encode(), 1, len(payload)) + payload
        else:
            payload = zlib.compress(b"x")
            body = fixed.pack(MAGIC, VERSION, NS.encode(), 1, len(payload)) + payload
            body += struct.pack("<I", zlib.crc32(body) ^ 1)
        if forge != "checksum":
            body += struct.pack("<I", zlib.crc32(body))
        self.raw.put_object(Bucket=self.bucket, Key=store.manifest_key("forger"), Body=body)
        res = self.scan_bounded(store)
        assert res.found == {"ok": h}  # found by its own header instead
        assert len(res.problems) == 1
        (what,) = res.problems
        assert what.startswith("manifest_") and FailureReason(what.removeprefix("manifest_")).damaged, what
        assert store.last_scan.header_gets == 1

    @pytest.mark.parametrize("forge", ["unsigned", "other_writer", "other_rank", "other_key", "edited"])
    def test_manifest_is_signed_and_a_forged_one_is_ignored(self, signed: S3Store, pool: BufferPool,
                                                            forge: str) -> None:
        """With a key, a writer's manifest is signed (bound to namespace, rank and writer
        id) and a reader with the key trusts it (no header GET). Forged (unsigned, moved to
        another writer's name or another rank, signed with another key, or edited), it is
        ignored and counted; each object's own header is read instead."""
        h = self.write_signed(signed, pool, "ok", 0, 2)
        assert signed.flush_manifest()
        body = self.raw.get_object(Bucket=self.bucket, Key=signed.manifest_key())["Body"].read()
        reader = self.make_store(Path("."), max_chunk_blocks=MAX_BLOCKS, auth=ChunkAuth(KEY))
        try:
            res = self.scan_bounded(reader)
            assert res.found == {"ok": h} and not res.problems
            assert reader.last_scan.manifest_gets == 1 and reader.last_scan.header_gets == 0
            self.raw.delete_object(Bucket=self.bucket, Key=signed.manifest_key())
            target, expected = signed.manifest_key("forger"), "manifest_auth_failed"
            if forge == "unsigned":
                body, expected = encode_manifest(NS, [("ok", h)]), "manifest_unauthenticated"
            elif forge == "other_writer":
                pass  # the same signed bytes under another writer's name
            elif forge == "other_rank":
                target = signed.manifest_key().replace("/r0/", "/r1/")
                other = self.make_store(Path("."), max_chunk_blocks=MAX_BLOCKS, auth=ChunkAuth(KEY), rank=1)
                try:
                    self.raw.put_object(Bucket=self.bucket, Key=other.key("ok"), Body=self.get_raw(signed, "ok"))
                    self.raw.put_object(Bucket=self.bucket, Key=other.manifest_key(signed.writer_id), Body=body)
                    res = self.scan_bounded(other)
                finally:
                    other.close(timeout_s=10)
                assert res.found == {} and res.problems == {"manifest_auth_failed": 1, FailureReason.KEY_MISMATCH: 1}
                return
            elif forge == "other_key":
                fake = ChunkAuth(OTHER_KEY)
                plain = body[: -SIG_BYTES]
                body = sign_manifest(plain, ChunkAuth(KEY).key_id, fake.manifest_mac(NS, 0, "forger", plain))
            else:
                body = body[:-1] + bytes([body[-1] ^ 1])
                target = signed.manifest_key()
            self.raw.put_object(Bucket=self.bucket, Key=target, Body=body)
            fresh = self.make_store(Path("."), max_chunk_blocks=MAX_BLOCKS, auth=ChunkAuth(KEY))
            try:
                res = self.scan_bounded(fresh)
                assert res.found == {"ok": h}  # found by its own header instead
                assert res.problems == {expected: 1}, res.problems
                assert fresh.last_scan.header_gets == 1
            finally:
                fresh.close(timeout_s=10)
        finally:
            reader.close(timeout_s=10)

    def test_a_signed_manifest_is_ignored_without_a_key(self, store: S3Store, signed: S3Store,
                                                        pool: BufferPool) -> None:
        self.write_signed(signed, pool, "ok", 0, 2)
        assert signed.flush_manifest()
        res = self.scan_bounded(store)
        assert res.found == {} and res.problems == {"manifest_unauthenticated": 1,
                                                    FailureReason.UNAUTHENTICATED: 1}, res.problems

    def test_every_block_is_one_plain_get_and_a_short_object_is_truncated(self, store: S3Store,
                                                                          pool: BufferPool) -> None:
        h0 = self.write(store, pool, "c0", 0, 4)
        before = store.stats().requests.get("GetObject", 0)
        r = self.read(store, "c0", h0, [3, 2, 1, 0])
        assert r.ok and r.nbytes == h0.total_bytes, r.reason
        r.release()
        assert store.stats().requests["GetObject"] == before + 1
        # Another chunk (the pooled buffer holds c0's bytes), stored with its last block short.
        h = self.write(store, pool, "c1", 10, 4, job=2)
        self.put_raw(store, "c1", self.get_raw(store, "c1")[: h.block_offset(3) + BLOCK - 1])
        # A short GET that the engine does not notice (NIXL's) leaves the buffer's old bytes
        # in place: poison the pool's buffers, so those cannot be c1's own from its write.
        spare = [pool.take(h.total_bytes) for _ in range(8)]
        for b in spare:
            b.view[:] = b"\xee" * b.nbytes
            b.close()
        self.assert_miss(store, pool, "c1", h, [0, 1, 2, 3], FailureReason.TRUNCATED, [key(10 + i) for i in range(4)])


class TestS3Boto3(S3Binding):
    io_engine = "boto3"


@pytest.mark.nixl
@requires_nixl
class TestS3Nixl(S3Binding):
    io_engine = "nixl"
