"""Layouts and the host copy engine on real tensors, for both KV layouts vLLM uses."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.transfer.copier import HostCopyEngine
from vllm_kvtier.transfer.layout import build_layout, runs

NUM_BLOCKS = 40


def _kv(layout: str, layers: int = 3, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = {
        "cpu": (NUM_BLOCKS, 2, 32, 2 * 64),  # [N, H, B, 2D]
        "flash": (2, NUM_BLOCKS, 16, 2, 64),  # [2, N, B, H, D]
    }[layout]
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(dtype) for i in range(layers)}


@pytest.mark.parametrize("kind", ["cpu", "flash"])
def test_layout_planes_cover_every_byte_of_a_block(kind):
    kv = _kv(kind)
    lay = build_layout(kv, NUM_BLOCKS)
    assert len(lay.planes) == (3 if kind == "cpu" else 6)
    per_layer = next(iter(kv.values())).numel() * 2 // NUM_BLOCKS
    assert lay.block_bytes == 3 * per_layer


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("kind", ["cpu", "flash"])
def test_save_then_load_into_other_blocks_is_exact(kind, threaded):
    kv = _kv(kind)
    lay = build_layout(kv, NUM_BLOCKS)
    pool = CPUPool(16, lay.plane_bytes, pin=False, prefault=False)
    eng = HostCopyEngine(lay, pool)
    eng.threaded_async = threaded
    rng = random.Random(1)
    src = rng.sample(range(1, 20), 10)  # scattered block ids
    slots = rng.sample(range(16), 10)
    dst = list(range(25, 35))  # consecutive
    before = {n: t.clone() for n, t in kv.items()}
    eng.submit("save", src, slots, background=False).wait()
    eng.submit("load", dst, slots, background=True).wait()
    bdim = 0 if kind == "cpu" else 1
    for n, t in kv.items():
        got = t.index_select(bdim, torch.tensor(dst))
        want = before[n].index_select(bdim, torch.tensor(src))
        assert torch.equal(got, want)
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert torch.equal(t.index_select(bdim, torch.tensor(untouched)),
                           before[n].index_select(bdim, torch.tensor(untouched)))
    eng.shutdown()


def test_out_of_range_ids_raise_instead_of_corrupting_memory():
    lay = build_layout(_kv("cpu"), NUM_BLOCKS)
    pool = CPUPool(4, lay.plane_bytes, pin=False, prefault=False)
    eng = HostCopyEngine(lay, pool)
    with pytest.raises(IndexError):
        eng.submit("save", [1], [4], background=False)
    with pytest.raises(IndexError):
        eng.submit("load", [NUM_BLOCKS], [0], background=False)
    eng.shutdown()


def test_checksum_detects_a_flipped_byte():
    lay = build_layout(_kv("cpu"), NUM_BLOCKS)
    pool = CPUPool(2, lay.plane_bytes, pin=False, prefault=True)
    HostCopyEngine(lay, pool).submit("save", [3], [1], background=False)
    crc = pool.checksum(1)
    pool.planes[-1][1][100] ^= 0xFF
    assert pool.checksum(1) != crc


def test_runs_merge_consecutive_pairs_only():
    assert runs([1, 2, 3, 7, 8], [10, 11, 12, 13, 14]) == [(1, 10, 3), (7, 13, 2)]
    assert runs([5, 6], [2, 1]) == [(5, 2, 1), (6, 1, 1)]
    assert runs([], []) == []


def test_unsupported_layout_is_a_clear_error():
    with pytest.raises(ValueError, match="num_blocks"):
        build_layout({"l0": torch.zeros(7, 3)}, NUM_BLOCKS)


def _big_kv(layers: int = 2) -> dict[str, torch.Tensor]:
    """vLLM's KV tensors are inference tensors; 128 KiB per block and plane, so a run of 8
    blocks (1 MiB) takes torch's copy path, not memmove."""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        return {f"model.layers.{i}.self_attn.attn": torch.randn((NUM_BLOCKS, 8, 64, 128), generator=g)
                .to(torch.bfloat16) for i in range(layers)}


@pytest.mark.parametrize("run", [3, 10])  # memmove, then torch's copy
def test_background_save_of_inference_tensors_is_exact_after_drain(run):
    kv = _big_kv()
    lay = build_layout(kv, NUM_BLOCKS)
    pool = CPUPool(16, lay.plane_bytes, pin=False, prefault=False)
    eng = HostCopyEngine(lay, pool)
    src, slots, dst = list(range(2, 2 + run)), list(range(run)), list(range(25, 25 + run))
    want = {n: t[src].clone() for n, t in kv.items()}
    t = eng.submit("save", src, slots, background=True)
    # A sync load after it waits for the copy thread's queue (submission order).
    eng.submit("load", dst, slots, background=False)
    assert t.done() and getattr(t, "error", "no error attribute") is None
    for n, tensor in kv.items():
        assert torch.equal(tensor[dst], want[n])
    eng.shutdown()


def test_background_save_failure_is_reported_not_raised():
    lay = build_layout(_kv("cpu"), NUM_BLOCKS)
    pool = CPUPool(4, lay.plane_bytes, pin=False, prefault=False)
    eng = HostCopyEngine(lay, pool)
    t = eng.submit("save", [1], [4], background=True)  # slot out of range: fails on the copy thread
    eng.drain()
    t.wait()  # does not raise
    assert t.done() and isinstance(getattr(t, "error", None), IndexError)
    eng.shutdown()
