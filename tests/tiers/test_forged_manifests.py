"""Forged manifests in a shared bucket cost the reader bounded work, counted, never paid twice.

A thousand 1 MiB manifests sit next to a real writer's on a real S3 server (moto) on
127.0.0.1. Each is a zip bomb that would inflate to about 270 MB of entries if decoded.
With a key, none is decoded (the signature is checked first, over the raw bytes); each is
refused once and not read again while unchanged; a scan reads a bounded number of them.
Without a key a manifest cannot be verified: each is cut off after a bounded inflation.
The writer's manifest still covers its objects (no header GET for them). The outcomes are
counts from the scan's own report; the CPU they cost is measured by
bench/forged_manifests.py, not here.
"""

from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import replace
from typing import Any

import pytest

from testkit import s3_server as s3srv
from testkit.s3_server import MotoServer
from tests.tiers.test_s3_store import BLOCK, NS, config, write
from vllm_kvtier.chunkformat import header_bytes_for
from vllm_kvtier.tiers.auth import ChunkAuth
from vllm_kvtier.tiers.s3.manifest import MAGIC, SIG_MAGIC, VERSION
from vllm_kvtier.tiers.s3.medium import MANIFEST_STEP_BYTES
from vllm_kvtier.tiers.s3.scan import MANIFEST_READS_PER_SCAN
from vllm_kvtier.tiers.s3.store import S3Store

pytestmark = pytest.mark.s3
s3_server = s3srv.s3_server
s3_bucket = s3srv.s3_bucket

MIB = 1 << 20
FORGED = 1000
AUTH = ChunkAuth(bytes(range(32)))


@functools.cache
def bomb(nbytes: int = MIB) -> bytes:
    """A well-formed unsigned manifest of ``nbytes``: 65,536 entries of zero headers of the
    largest 16-block size (about 270 MB inflated), then padding, then a valid CRC."""
    hlen = header_bytes_for(16, True)
    entry = struct.pack("<H", 1) + b"x" + struct.pack("<I", hlen) + bytes(hlen)
    payload = zlib.compress(entry * 65536, 9)
    payload += bytes(range(256)) * ((nbytes - 44 - len(payload)) // 256 + 1)
    payload = payload[: nbytes - 44]
    out = struct.pack("<8sI16sIQ", MAGIC, VERSION, NS.encode(), 65536, len(payload)) + payload
    return out + struct.pack("<I", zlib.crc32(out))


def plant(server: MotoServer, bucket: str, store: S3Store, bodies: list[bytes], n: int) -> None:
    """``n`` manifests named like other writers', cycling through ``bodies`` (one upload
    each, then server-side copies)."""
    c = server.client()
    for i, body in enumerate(bodies):
        c.put_object(Bucket=bucket, Key=store.manifest_key(f"forged-{i:04d}"), Body=body)
    for i in range(len(bodies), n):
        src = store.manifest_key(f"forged-{i % len(bodies):04d}")
        c.copy_object(Bucket=bucket, Key=store.manifest_key(f"forged-{i:04d}"), CopySource={"Bucket": bucket, "Key": src})


def scan_until_read(store: S3Store) -> dict[str, Any]:
    """Rescans until no changed manifest is left for later; what they did, summed."""
    total = {"scans": 0, "gets": 0, "refused": 0, "decoded": 0, "decoded_bytes": 0, "found": set()}
    while True:
        found = store.scan(collect=True).found
        r = store.last_scan
        assert r.manifest_gets <= MANIFEST_READS_PER_SCAN
        total["scans"] += 1
        total["gets"] += r.manifest_gets
        total["refused"] += r.manifests_refused
        total["decoded"] += r.manifests_decoded
        total["decoded_bytes"] += r.manifest_bytes_decoded
        total["found"] = set(found)
        if not r.manifests_deferred:
            return total


def test_forged_manifests_are_refused_undecoded_with_a_key(s3_server: MotoServer, s3_bucket: str) -> None:
    """Half unsigned, half signed with an accepted key id and a wrong MAC. Before: each
    was inflated entry by entry before its signature was checked (about a second of CPU
    per MiB), and read again at every rescan."""
    cfg = config(s3_server, s3_bucket, read_timeout_s=30.0, deadline_s=30.0)  # moto lists 1,000 keys slowly
    writer = S3Store(replace(cfg, writer_id="writer"), NS, 0, BLOCK, max_chunk_blocks=16, auth=AUTH)
    for i in range(3):
        write(writer, f"c{i}", 10 * i, 2, job=i + 1)
    writer.close()
    good = s3_server.client().head_object(Bucket=s3_bucket, Key=writer.manifest_key())["ContentLength"]
    wrong_mac = bomb() + SIG_MAGIC + AUTH.key_id + bytes(32)
    plant(s3_server, s3_bucket, writer, [bomb(), wrong_mac], FORGED)

    reader = S3Store(replace(cfg, writer_id="reader"), NS, 0, BLOCK, max_chunk_blocks=16, auth=AUTH)
    try:
        reader.scan(collect=True)
        first = reader.last_scan
        assert first.from_manifests == 3 and first.header_gets == 0  # the writer's manifest still serves
        total = scan_until_read(reader)
        assert total["found"] == {"c0", "c1", "c2"}
        assert first.manifests_refused + total["refused"] == FORGED
        # Only the writer's manifest reached the decoder, and only its signed bytes.
        assert first.manifests_decoded + total["decoded"] == 1
        assert first.manifest_bytes_decoded + total["decoded_bytes"] == good - len(SIG_MAGIC) - 8 - 32
        reader.scan(collect=True)  # nothing changed: nothing is read again
        r = reader.last_scan
        assert r.manifest_gets == 0 and r.manifests_refused == 0
        assert r.problems == {"manifest_unauthenticated": FORGED // 2, "manifest_auth_failed": FORGED // 2}
    finally:
        reader.close()


def test_forged_manifests_cost_bounded_decoding_without_a_key(s3_server: MotoServer, s3_bucket: str) -> None:
    """Without a key a manifest is decoded as it arrives; a bomb is cut off once it
    inflates 128 times its compressed bytes (plus 4 MiB), within its first 256 KiB, and
    refused for good. Before: every one inflated to its last entry at every rescan."""
    n = 40
    cfg = config(s3_server, s3_bucket, read_timeout_s=30.0, deadline_s=30.0)  # moto lists 1,000 keys slowly
    writer = S3Store(replace(cfg, writer_id="writer"), NS, 0, BLOCK, max_chunk_blocks=16)
    for i in range(3):
        write(writer, f"c{i}", 10 * i, 2, job=i + 1)
    writer.close()
    good = s3_server.client().head_object(Bucket=s3_bucket, Key=writer.manifest_key())["ContentLength"]
    plant(s3_server, s3_bucket, writer, [bomb()], n)

    reader = S3Store(replace(cfg, writer_id="reader"), NS, 0, BLOCK, max_chunk_blocks=16)
    try:
        total = scan_until_read(reader)
        assert total["found"] == {"c0", "c1", "c2"}
        assert total["refused"] == n
        assert total["decoded"] == n + 1
        # Each bomb is cut off within the first piece of its body handed to the decoder.
        assert total["decoded_bytes"] - good <= n * MANIFEST_STEP_BYTES
        reader.scan(collect=True)
        r = reader.last_scan
        assert r.manifest_gets == 0 and r.problems == {"manifest_too_large": n}
    finally:
        reader.close()


def test_a_signed_manifest_too_long_to_hold_is_verified_then_read_again(s3_server: MotoServer, s3_bucket: str) -> None:
    """A good signed manifest longer than a scan holds in memory (4 MiB): verified on a
    first GET, then decoded from a second GET of the same version (by its ETag)."""
    import random

    from vllm_kvtier.chunkformat import make_header
    from vllm_kvtier.tiers.s3.manifest import encode_manifest, sign_manifest

    cfg = config(s3_server, s3_bucket, read_timeout_s=30.0, deadline_s=30.0)
    writer = S3Store(replace(cfg, writer_id="writer"), NS, 0, BLOCK, max_chunk_blocks=16, auth=AUTH)
    real = write(writer, "real", 0, 2)
    writer.close()
    c = s3_server.client()
    c.delete_object(Bucket=s3_bucket, Key=writer.manifest_key())  # the big one alone covers it
    rng = random.Random(2)
    ghosts = ((f"ghost-{i:06d}", make_header(NS, [rng.randbytes(32) for _ in range(16)],
                                             [rng.getrandbits(32) for _ in range(16)], BLOCK)) for i in range(20_000))
    body = encode_manifest(NS, [("real", real), *ghosts])
    assert len(body) > 4 * MIB
    c.put_object(Bucket=s3_bucket, Key=writer.manifest_key("big"),
                 Body=sign_manifest(body, AUTH.key_id, AUTH.manifest_mac(NS, 0, "big", body)))
    reader = S3Store(replace(cfg, writer_id="reader"), NS, 0, BLOCK, max_chunk_blocks=16, auth=AUTH)
    try:
        assert set(reader.scan().found) == {"real"}
        r = reader.last_scan
        assert r.from_manifests == 1 and r.header_gets == 0 and r.problems == {}
        assert r.manifests_decoded == 1 and r.manifest_bytes_decoded == len(body)
        assert reader.stats().requests.get("GetObject") == 2
    finally:
        reader.close()
