"""``kvtier plan --trace`` against the engine: a sampled, scaled Mooncake trace replayed on a
real vLLM engine with the plugin gives the CPU tier's hit share the replay predicts.

The trace: 3% of the conversations of the first half of Mooncake's conversation trace
(``sample_conversations``, committed under tests/unit/data), each request cut to its first
``MAX_BLOCKS`` blocks and scaled to the engine's block (one trace block = one 32-token engine
block, its tokens drawn from the block's id, so equal ids are equal prefixes), plus one token
of its own (a partial block: every full block can be loaded, as the replay assumes). The
requests go one after the other, as the replay models them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.conftest import BLOCK_SIZE, close_llm, generate, kvtier_config, kvtier_counters, make_llm
from vllm_kvtier.ops.trace_sim import LowerTier, TierSetup, make_trace, simulate_tiers

SAMPLE = Path(__file__).parents[1] / "unit" / "data" / "mooncake_conversation_sampled3pct.jsonl"
#: one block of the tiny model: layers x KV heads x block x (K, V) x head dim x fp32
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4
MAX_BLOCKS = 40
CPU_BLOCKS = 300


def scaled_records() -> list[dict]:
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    return [{"timestamp": r["timestamp"], "input_length": BLOCK_SIZE * len(r["hash_ids"][:MAX_BLOCKS]) + 1,
             "hash_ids": [*r["hash_ids"][:MAX_BLOCKS], -(i + 1)]} for i, r in enumerate(rows)]


def prompt_of(ids: list[int]) -> list[int]:
    tokens: list[int] = []
    for h in ids[:-1]:
        rng = random.Random(h)
        tokens += [rng.randrange(3, 1000) for _ in range(BLOCK_SIZE)]
    return [*tokens, 3]


@pytest.mark.parametrize("eviction", ["kvaware", "s3fifo", "lru"])
def test_the_engine_hits_what_plan_trace_predicts(tiny_model, eviction):
    records = scaled_records()
    trace = make_trace(records, BLOCK_SIZE)
    predicted = simulate_tiers(trace, TierSetup(cpu_blocks=CPU_BLOCKS, cpu_eviction=eviction,
                                                save_partial_blocks=False))
    cpu = predicted.tiers[0]
    llm = make_llm(tiny_model, kvtier_config({"cpu": {"capacity_bytes": CPU_BLOCKS * BLOCK_BYTES,
                                                      "eviction": eviction}}))
    try:
        got = [generate(llm, prompt_of(r["hash_ids"]), max_tokens=1) for r in
               sorted(records, key=lambda r: r["timestamp"])]
    finally:
        close_llm(llm)
    measured_tokens = sum(g.loaded for g in got) * BLOCK_SIZE
    measured = measured_tokens / predicted.prompt_tokens
    print(f"{eviction}: predicted {predicted.share(cpu):.4f} ({cpu.hit_blocks} blocks), measured {measured:.4f} "
          f"({sum(g.loaded for g in got):.0f} blocks) of {predicted.prompt_tokens} prompt tokens")
    assert cpu.hit_blocks > 0.1 * sum(len(k) for k in trace.keys)  # a test with hits to predict
    assert abs(measured - predicted.share(cpu)) <= 0.03


def test_the_engine_hits_each_tier_as_plan_trace_predicts(tiny_model, tmp_path):
    """CPU and NVMe (write-back, admit 1, no background flush): the share each tier serves.

    Requests sent back to back find the previous request's NVMe writes still in flight (the
    worker confirms a chunk at the first step after its write ends), so the replay confirms
    each request's writes one request later (``confirm_lag_requests=1``; a lag of 0, 1, 2
    predicts NVMe 0.3715, 0.3712, 0.3528). Measured here (kvaware): CPU 0.1162 predicted and
    served; NVMe 0.3712 predicted, 0.3684 served: a few writes landed a request later still.
    In lock step (every write confirmed before the next lookup: bench/fleet_agreement.py
    --instances 1 --shared none) the engine serves the no-lag prediction exactly."""
    records = scaled_records()
    trace = make_trace(records, BLOCK_SIZE)
    cpu_blocks, chunk = 100, 4
    predicted = simulate_tiers(trace, TierSetup(
        cpu_blocks=cpu_blocks, cpu_eviction="kvaware", save_partial_blocks=False, confirm_lag_requests=1,
        lower=(LowerTier("nvme", None, "write-back", admit_min_seen=1, chunk_blocks=chunk, block_bytes=BLOCK_BYTES),)))
    llm = make_llm(tiny_model, kvtier_config({
        "cpu": {"capacity_bytes": cpu_blocks * BLOCK_BYTES},
        "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 512 * 2**20, "admit_min_seen": 1,
                 "chunk_blocks": chunk, "flush_interval_s": 0}}))
    try:
        for r in sorted(records, key=lambda r: r["timestamp"]):
            generate(llm, prompt_of(r["hash_ids"]), max_tokens=1)
        counters = kvtier_counters(llm)
    finally:
        close_llm(llm)
    for t in predicted.tiers:
        measured = counters.get(f"hit_blocks|{t.name}", 0) * BLOCK_SIZE / predicted.prompt_tokens
        print(f"{t.name}: predicted {predicted.share(t):.4f} ({t.hit_blocks} blocks), measured {measured:.4f}")
        assert abs(measured - predicted.share(t)) <= 0.03, t.name
    assert predicted.tiers[1].hit_blocks > 0.05 * sum(len(k) for k in trace.keys)  # NVMe serves a share
