"""Manifests (S3's index cache) are stored bytes too: every size in one is bounded before it
sizes memory. Forged entry counts, payload lengths, header lengths and a zip bomb end as a
ChunkFormatError with a named reason, and cost a bounded amount of memory (asserted)."""

from __future__ import annotations

import gc
import random
import struct
import tracemalloc
import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from vllm_kvtier.chunkformat import ChunkFormatError, make_header
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.registry import StoreContext
from vllm_kvtier.tiers.s3.manifest import MAGIC, VERSION, decode_manifest, encode_manifest
from vllm_kvtier.tiers.s3.store import S3Store

NS = "manifest00000000"
SMALL = 2 << 20  # one step of inflated payload plus an entry


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def manifest(count: int, payload: bytes) -> bytes:
    out = struct.pack("<8sI16sIQ", MAGIC, VERSION, NS.encode(), count, len(payload)) + payload
    return out + struct.pack("<I", zlib.crc32(out))


def bounded(fn: Callable[[], object]) -> ChunkFormatError:
    tracemalloc.start()
    try:
        with pytest.raises(ChunkFormatError) as e:
            fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= SMALL, peak
    return e.value


def test_round_trip_with_bounds() -> None:
    entries = [(f"obj-{i}", make_header(NS, [key(i)], [i], 3000)) for i in range(10)]
    assert decode_manifest(encode_manifest(NS, entries), NS, max_blocks=1, block_bytes=3000) == dict(entries)


def test_huge_entry_count_is_refused_before_decoding() -> None:
    err = bounded(lambda: decode_manifest(manifest(0xFFFFFFFF, zlib.compress(b"")), NS))
    assert err.reason is FailureReason.TOO_LARGE


def test_zip_bomb_payload_inflates_step_by_step() -> None:
    # 1 GiB of zeros claimed by a few MiB object: entry ids of length 0 stop it at the first entry.
    bomb = zlib.compress(bytes(64 << 20), 9)
    err = bounded(lambda: decode_manifest(manifest(1000, bomb), NS))
    assert err.reason is FailureReason.FORMAT


def test_forged_header_length_in_an_entry() -> None:
    body = struct.pack("<H", 3) + b"abc" + struct.pack("<I", 0xFFFFFFF0) + bytes(100)
    err = bounded(lambda: decode_manifest(manifest(1, zlib.compress(body)), NS))
    assert err.reason is FailureReason.TOO_LARGE


def test_entry_header_with_too_many_blocks() -> None:
    h = make_header(NS, [key(i) for i in range(300)], [0] * 300, 3000)
    err = bounded(lambda: decode_manifest(encode_manifest(NS, [("big", h)]), NS, max_blocks=16))
    assert err.reason is FailureReason.TOO_LARGE


def test_payload_shorter_than_its_count() -> None:
    h = make_header(NS, [key(0)], [0], 3000)
    data = encode_manifest(NS, [("one", h)])
    _, version, ns, _, plen = struct.unpack_from("<8sI16sIQ", data)
    forged = manifest(5, data[40 : 40 + plen])
    err = bounded(lambda: decode_manifest(forged, NS))
    assert err.reason is FailureReason.TRUNCATED


# ---- manifests in a bucket: bombs against a real S3 server (moto) on 127.0.0.1 -----------------
#
# A manifest is not signed: whoever can write the bucket can write one. Whatever it holds,
# a scan's memory stays bounded (traced around the scan: a few MiB over the baseline, the
# same on any machine) and no legitimate object is deleted (the bucket is listed after).

MIB = 1 << 20
PEAK_BOUND = 8 * MIB


def _s3_fixtures() -> tuple[Any, Any]:
    from testkit import s3_server as s3srv

    return s3srv.s3_server, s3srv.s3_bucket


s3_server, s3_bucket = _s3_fixtures()


def traced_peak(fn: Callable[[], object]) -> int:
    """Peak traced bytes over the baseline while ``fn`` runs (every thread's)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def bucket_keys(server: Any, bucket: str) -> set[str]:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def chunk_keys(server: Any, bucket: str) -> set[str]:
    return {k for k in bucket_keys(server, bucket) if k.endswith(".kvt")}


@pytest.mark.s3
def test_huge_junk_object_named_like_a_manifest_is_refused_by_its_length(s3_server: Any, s3_bucket: str) -> None:
    """Raw size: 48 MiB of junk at a manifest key. Its ContentLength is beyond what
    ``manifest_max_entries`` entries can need (1,000 entries of 16-block headers: about
    4 MiB): refused before a byte of it is read. Before: read whole, then copied."""
    from tests.tiers.test_s3_store import BLOCK, config, write

    cfg = config(s3_server, s3_bucket, manifest_max_entries=1000)
    writer = S3Store(cfg, StoreContext(NS, 0, BLOCK), max_chunk_blocks=16)
    for i in range(3):
        write(writer, f"c{i}", 10 * i, 2, job=i + 1)
    writer.close()
    s3_server.client().put_object(Bucket=s3_bucket, Key=writer.manifest_key("junk"),
                                  Body=random.Random(0).randbytes(48 * MIB))
    chunks = chunk_keys(s3_server, s3_bucket)
    reader = S3Store(cfg, StoreContext(NS, 0, BLOCK), max_chunk_blocks=16)
    try:
        got: dict[str, Any] = {}
        peak = traced_peak(lambda: got.update(reader.scan(collect=True).found))
        assert peak < PEAK_BOUND, peak
        assert set(got) == {"c0", "c1", "c2"}
        assert reader.last_scan.problems == {"manifest_too_large": 1}
    finally:
        reader.close()
    assert chunk_keys(s3_server, s3_bucket) == chunks


@pytest.mark.s3
def test_manifest_of_the_most_entries_naming_no_listed_object_costs_no_memory(s3_server: Any,
                                                                             s3_bucket: str) -> None:
    """Valid entries: a manifest of ``manifest_max_entries`` well-formed 16-block headers
    naming objects that do not exist. Decoded entry by entry and dropped unlisted: no
    header object is made of them. Before: all of them became objects (~2 KB each)."""
    from tests.tiers.test_s3_store import BLOCK, config, write

    n = 20_000
    cfg = config(s3_server, s3_bucket, manifest_max_entries=n)
    writer = S3Store(cfg, StoreContext(NS, 0, BLOCK), max_chunk_blocks=16)
    write(writer, "real", 0, 2)
    writer.close()
    rng = random.Random(1)
    body = encode_manifest(NS, ((f"ghost-{i:06d}", make_header(NS, [rng.randbytes(32) for _ in range(16)],
                                                               [rng.getrandbits(32) for _ in range(16)], BLOCK))
                                for i in range(n)))
    assert len(body) > 4 * MIB
    s3_server.client().put_object(Bucket=s3_bucket, Key=writer.manifest_key("bomb"), Body=body)
    del body
    chunks = chunk_keys(s3_server, s3_bucket)
    reader = S3Store(cfg, StoreContext(NS, 0, BLOCK), max_chunk_blocks=16)
    try:
        got: dict[str, Any] = {}
        peak = traced_peak(lambda: got.update(reader.scan(collect=True).found))
        assert peak < PEAK_BOUND, peak
        assert set(got) == {"real"}
        assert reader.last_scan.from_manifests == 1 and reader.last_scan.header_gets == 0
    finally:
        reader.close()
    assert chunk_keys(s3_server, s3_bucket) == chunks


@pytest.mark.s3
def test_forged_manifest_naming_real_objects_gets_nothing_deleted(s3_server: Any, s3_bucket: str) -> None:
    """Real objects, wrong headers: a forged manifest names another instance's objects
    with headers of other keys (each with a valid CRC: anyone can compute one). The reader
    indexes them (a manifest is trusted as a cache), its read fails as damaged, and the
    chunk leaves the reader's index: a miss, counted, and the object stays for everyone
    else. Before, the scheduler deleted it."""
    from tests.tiers.test_s3_store import BLOCK, config, read, write
    from vllm_kvtier.catalog.base import Listing
    from vllm_kvtier.jobs import WorkerReport
    from vllm_kvtier.keys import BlockKey
    from vllm_kvtier.metrics import Counters
    from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext

    cfg = config(s3_server, s3_bucket)
    other = S3Store(cfg, StoreContext(NS, 0, BLOCK), max_chunk_blocks=16)  # another instance's writes
    real = {f"c{i}": write(other, f"c{i}", 10 * i, 2, job=i + 1) for i in range(3)}
    other.close()
    s3_server.client().delete_object(Bucket=s3_bucket, Key=other.manifest_key())  # the forged one alone
    forged = {oid: make_header(NS, [key(1000 + 10 * i + j) for j in range(2)], [0, 0], BLOCK)
              for i, oid in enumerate(real)}
    s3_server.client().put_object(Bucket=s3_bucket, Key=other.manifest_key("forged"),
                                  Body=encode_manifest(NS, forged.items()))
    chunks = chunk_keys(s3_server, s3_bucket)

    reader = S3Store(replace(cfg, writer_id="reader"), StoreContext(NS, 0, BLOCK), max_chunk_blocks=16)
    counters = Counters()
    try:
        found = reader.scan(collect=True).found
        assert {oid: h.keys for oid, h in found.items()} == {oid: h.keys for oid, h in forged.items()}
        p = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 16, None), PlannerContext(1, BLOCK, counters), Listing([found]))
        bad: set[tuple[str, str]] = set()
        for job, (oid, h) in enumerate(found.items(), start=10):
            r = read(reader, oid, h, [0, 1], job=job)
            if not r.ok:
                assert r.reason is not None and r.reason.damaged
                bad.add(("s3", oid))
            r.release()
        assert bad, "the forged headers were not used"
        p.on_worker_meta(WorkerReport(bad=bad))
        _, _, deletes = p.take_jobs(set(), lambda k: None)
        for fid in deletes:  # what the workers would do with them
            reader.submit_delete(fid)
        reader.close()
        assert deletes == []
        assert all(p.locate(BlockKey(k)) is None for h in forged.values() for k in h.keys)
        assert counters.totals["forgotten_chunks|s3"] == len(bad)
    finally:
        reader.close()
    assert chunk_keys(s3_server, s3_bucket) == chunks
