"""Forged manifests in a shared bucket cost the reader bounded work, counted, never paid twice.

A thousand 1 MiB manifests sit next to a real writer's on a real S3 server (moto) on
127.0.0.1. Each is a zip bomb that would inflate to about 270 MB of entries if decoded.
With a key, a manifest's name must carry a tag only key holders make: a forged name is
refused from the listing alone, with no GET, once. One under a real writer's name is read
(one GET) but never decoded: the signature is checked first, over the raw bytes.
Without a key a manifest cannot be verified: each is cut off after a bounded inflation.
The writer's manifest still covers its objects (no header GET for them). The outcomes are
counts from the scan's own report; the CPU they cost is measured by
bench/forged_manifests.py, not here.
"""

from __future__ import annotations

import functools
import random
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
from vllm_kvtier.tiers.registry import StoreContext
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


def forged_names(store: S3Store, n: int, seed: int = 1) -> list[str]:
    """``n`` manifest keys a forger without the key can make: every other one a random
    writer id (with a random tag, or none), the rest the real writer's id with a wrong tag."""
    rng = random.Random(seed)
    root = f"{store.medium.prefix}manifest/"
    names = []
    for i in range(n):
        if i % 2:
            names.append(f"{root}{store.writer_id}.{rng.randbytes(8).hex()}.kvm")
        elif i % 4:
            names.append(f"{root}forged-{i:04d}.{rng.randbytes(8).hex()}.kvm")
        else:
            names.append(f"{root}forged-{i:04d}.kvm")
    return names


def plant(server: MotoServer, bucket: str, store: S3Store, bodies: list[bytes], n: int,
          names: list[str] | None = None) -> None:
    """``n`` manifests under ``names`` (default: other writers' names as ``store`` makes
    them), cycling through ``bodies`` (one upload each, then server-side copies)."""
    keys = names or [store.manifest_key(f"forged-{i:04d}") for i in range(n)]
    c = server.client()
    for i, body in enumerate(bodies):
        c.put_object(Bucket=bucket, Key=keys[i], Body=body)
    for i in range(len(bodies), n):
        c.copy_object(Bucket=bucket, Key=keys[i], CopySource={"Bucket": bucket, "Key": keys[i % len(bodies)]})


def count_gets(store: S3Store) -> list[str]:
    """The keys of every GetObject ``store``'s boto3 client sends from now on."""
    keys: list[str] = []
    client: Any = store.medium.client
    client.meta.events.register("before-parameter-build.s3.GetObject", lambda params, **_: keys.append(params["Key"]))
    return keys


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


def test_forged_manifests_are_refused_by_name_with_a_key(s3_server: MotoServer, s3_bucket: str) -> None:
    """With a key, a forger cannot make a manifest name a reader reads: a thousand forged
    names (random, or the real writer's id with a wrong tag) cost no GET. Each is refused
    once (``manifests_refused``), never checked again. Before: each was fetched (one GET
    of 1 MiB), and 64 per scan, for 16 scans."""
    cfg = config(s3_server, s3_bucket, read_timeout_s=30.0, deadline_s=30.0)  # moto lists 1,000 keys slowly
    writer = S3Store(replace(cfg, writer_id="writer"), StoreContext(NS, 0, BLOCK, auth=AUTH),
                     max_chunk_blocks=16)
    for i in range(3):
        write(writer, f"c{i}", 10 * i, 2, job=i + 1)
    writer.close()
    real = writer.manifest_key()
    good = s3_server.client().head_object(Bucket=s3_bucket, Key=real)["ContentLength"]
    wrong_mac = bomb() + SIG_MAGIC + AUTH.key_id + bytes(32)
    names = forged_names(writer, FORGED)
    plant(s3_server, s3_bucket, writer, [bomb(), wrong_mac], FORGED, names)

    reader = S3Store(replace(cfg, writer_id="reader"), StoreContext(NS, 0, BLOCK, auth=AUTH),
                     max_chunk_blocks=16)
    gets = count_gets(reader)
    try:
        assert set(reader.scan(collect=True).found) == {"c0", "c1", "c2"}
        r = reader.last_scan
        assert gets == [real]  # the writer's manifest alone: no forged one is fetched
        assert r.from_manifests == 3 and r.header_gets == 0 and r.manifest_gets == 1
        assert r.manifests_refused == FORGED and r.manifests_deferred == 0
        assert r.manifests_decoded == 1 and r.manifest_bytes_decoded == good - len(SIG_MAGIC) - 8 - 32
        assert r.problems == {"manifest_unauthenticated": FORGED // 4, "manifest_auth_failed": FORGED - FORGED // 4}
        reader.scan(collect=True)  # nothing changed: only the listing
        r = reader.last_scan
        assert gets == [real] and r.manifest_gets == 0 and r.manifests_refused == 0
        assert r.problems == {"manifest_unauthenticated": FORGED // 4, "manifest_auth_failed": FORGED - FORGED // 4}
    finally:
        reader.close()


def test_a_forged_body_under_a_real_name_costs_one_get_and_no_decode(s3_server: MotoServer,
                                                                     s3_bucket: str) -> None:
    """A forger may overwrite real writers' manifests (their names verify). Each costs one
    GET and an HMAC pass, never a decode, and is not read again while unchanged."""
    n = 8
    cfg = config(s3_server, s3_bucket, read_timeout_s=30.0, deadline_s=30.0)
    writer = S3Store(replace(cfg, writer_id="writer"), StoreContext(NS, 0, BLOCK, auth=AUTH),
                     max_chunk_blocks=16)
    for i in range(3):
        write(writer, f"c{i}", 10 * i, 2, job=i + 1)
    writer.close()
    wrong_mac = bomb() + SIG_MAGIC + AUTH.key_id + bytes(32)
    plant(s3_server, s3_bucket, writer, [bomb(), wrong_mac], n)  # names made with the key
    reader = S3Store(replace(cfg, writer_id="reader"), StoreContext(NS, 0, BLOCK, auth=AUTH),
                     max_chunk_blocks=16)
    gets = count_gets(reader)
    try:
        assert set(reader.scan(collect=True).found) == {"c0", "c1", "c2"}
        r = reader.last_scan
        assert len(gets) == n + 1 and r.manifests_refused == n and r.manifests_decoded == 1
        assert r.problems == {"manifest_unauthenticated": n // 2, "manifest_auth_failed": n // 2}
        reader.scan(collect=True)
        assert len(gets) == n + 1 and reader.last_scan.manifests_refused == 0
    finally:
        reader.close()


def test_a_manifest_named_under_a_verify_key_is_read(s3_server: MotoServer, s3_bucket: str) -> None:
    """Key rotation: a writer still signing with the old key names its manifest with it;
    a reader that signs with the new key and verifies the old one reads it (no header GET)."""
    old, new = ChunkAuth(bytes(range(32, 64))), ChunkAuth(bytes(range(64, 96)), [bytes(range(32, 64))])
    cfg = config(s3_server, s3_bucket, read_timeout_s=30.0, deadline_s=30.0)
    writer = S3Store(replace(cfg, writer_id="writer"), StoreContext(NS, 0, BLOCK, auth=old),
                     max_chunk_blocks=16)
    write(writer, "c0", 0, 2)
    writer.close()
    reader = S3Store(replace(cfg, writer_id="reader"), StoreContext(NS, 0, BLOCK, auth=new),
                     max_chunk_blocks=16)
    try:
        assert writer.manifest_key() != reader.manifest_key("writer")  # named under another key
        assert set(reader.scan().found) == {"c0"}
        r = reader.last_scan
        assert r.from_manifests == 1 and r.header_gets == 0 and r.manifests_refused == 0 and not r.problems
    finally:
        reader.close()


def test_a_writer_replaces_its_manifest_of_an_earlier_build(s3_server: MotoServer, s3_bucket: str) -> None:
    """A manifest under an earlier build's name (no tag) is not read by scans with a key.
    Its writer merges it at its next manifest write (its signature proves it its own),
    writes the tagged name, and deletes the old one. Another writer's old name stays."""
    cfg = config(s3_server, s3_bucket, read_timeout_s=30.0, deadline_s=30.0)
    c = s3_server.client()
    root = f"kv/{NS}/r0/manifest/"
    old = S3Store(replace(cfg, writer_id="writer"), StoreContext(NS, 0, BLOCK, auth=AUTH),
                  max_chunk_blocks=16)
    write(old, "c0", 0, 2)
    old.close()
    legacy = f"{root}writer.kvm"  # as an earlier build named it: the same signed bytes
    c.copy_object(Bucket=s3_bucket, Key=legacy, CopySource={"Bucket": s3_bucket, "Key": old.manifest_key()})
    c.copy_object(Bucket=s3_bucket, Key=f"{root}other.kvm", CopySource={"Bucket": s3_bucket, "Key": legacy})
    c.delete_object(Bucket=s3_bucket, Key=old.manifest_key())

    again = S3Store(replace(cfg, writer_id="writer"), StoreContext(NS, 0, BLOCK, auth=AUTH),
                    max_chunk_blocks=16)
    gets = count_gets(again)
    try:
        assert set(again.scan().found) == {"c0"}
        r = again.last_scan
        assert r.from_manifests == 0 and r.problems == {"manifest_unauthenticated": 2}
        assert not any(k.endswith(".kvm") for k in gets)  # neither old name fetched by the scan
        write(again, "c1", 10, 2)
        assert again.flush_manifest()
        keys = {o["Key"] for o in c.list_objects_v2(Bucket=s3_bucket, Prefix=root)["Contents"]}
        assert keys == {again.manifest_key(), f"{root}other.kvm"}
    finally:
        again.close()
    reader = S3Store(replace(cfg, writer_id="reader"), StoreContext(NS, 0, BLOCK, auth=AUTH),
                     max_chunk_blocks=16)
    try:
        assert set(reader.scan().found) == {"c0", "c1"}
        assert reader.last_scan.from_manifests == 2 and reader.last_scan.header_gets == 0
    finally:
        reader.close()


def test_forged_manifests_cost_bounded_decoding_without_a_key(s3_server: MotoServer, s3_bucket: str) -> None:
    """Without a key a manifest is decoded as it arrives; a bomb is cut off once it
    inflates 128 times its compressed bytes (plus 4 MiB), within its first 256 KiB, and
    refused for good. Before: every one inflated to its last entry at every rescan."""
    n = 40
    cfg = config(s3_server, s3_bucket, read_timeout_s=30.0, deadline_s=30.0)  # moto lists 1,000 keys slowly
    writer = S3Store(replace(cfg, writer_id="writer"), StoreContext(NS, 0, BLOCK), max_chunk_blocks=16)
    for i in range(3):
        write(writer, f"c{i}", 10 * i, 2, job=i + 1)
    writer.close()
    good = s3_server.client().head_object(Bucket=s3_bucket, Key=writer.manifest_key())["ContentLength"]
    plant(s3_server, s3_bucket, writer, [bomb()], n)

    reader = S3Store(replace(cfg, writer_id="reader"), StoreContext(NS, 0, BLOCK), max_chunk_blocks=16)
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
    writer = S3Store(replace(cfg, writer_id="writer"), StoreContext(NS, 0, BLOCK, auth=AUTH),
                     max_chunk_blocks=16)
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
    reader = S3Store(replace(cfg, writer_id="reader"), StoreContext(NS, 0, BLOCK, auth=AUTH),
                     max_chunk_blocks=16)
    try:
        assert set(reader.scan().found) == {"real"}
        r = reader.last_scan
        assert r.from_manifests == 1 and r.header_gets == 0 and r.problems == {}
        assert r.manifests_decoded == 1 and r.manifest_bytes_decoded == len(body)
        assert reader.stats().requests.get("GetObject") == 2
    finally:
        reader.close()
