"""A tier from outside the package (:mod:`tests.tiers.shelf`), configured by its spec's
path, serves a real vLLM engine: blocks the tiny CPU tier demoted come back from it."""

from __future__ import annotations

import random

from tests.conftest import (
    BLOCK_SIZE,
    close_llm,
    generate,
    kvtier_config,
    kvtier_counters,
    make_llm,
    rand_tokens,
    settle,
)

BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4  # tiny model, fp32: layers x heads x block x 2*head x 4


def test_an_out_of_tree_tier_serves_hits(tiny_model, tmp_path):
    rng = random.Random(7)
    ps = [rand_tokens(rng, 330) for _ in range(4)]
    kv = kvtier_config({"cpu": {"capacity_bytes": 12 * BLOCK_BYTES},
                        "tiers": {"tests.tiers.shelf:SPEC": {"path": str(tmp_path / "shelf")}}})
    llm = make_llm(tiny_model, kv)
    try:
        first = [generate(llm, p) for p in ps]
        settle(llm)  # the demotions are reported durable, as between requests
        again = [generate(llm, p) for p in ps]
        counters = kvtier_counters(llm)
    finally:
        close_llm(llm)
    assert [r.tokens for r in again] == [r.tokens for r in first]
    assert counters["blocks_stored|shelf"] > 0 and counters["evictions|cpu"] > 0
    # The first prompt left DRAM long ago: every loadable block of it comes from the shelf.
    assert counters["blocks_loaded|shelf"] >= (330 - 1) // BLOCK_SIZE
    assert list((tmp_path / "shelf").rglob("*.shelf")), "no chunk file on the shelf"
