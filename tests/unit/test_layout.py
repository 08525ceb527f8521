"""build_layout over every physical KV layout vLLM 0.32 can resolve: each is handed to
the connector as a standardized ``[B, H, N, C]`` view, and a block's bytes must be found
as they sit in memory (views, never copies), each byte of a block in exactly one row."""

from __future__ import annotations

import pytest
import torch

from vllm_kvtier.transfer.layout import build_layout

B, H, N, C = 6, 2, 4, 8  # blocks, kv heads, tokens per block, head size x2 (K and V)
LAYERS = 3

#: physical dimension order per layout name, over (L, B, H, N, C)
PHYSICAL = {
    "LBNHC": "LBNHC",  # NHD: FlashAttention's default, not contiguous in view order
    "LBHNC": "LBHNC",  # HND: the CPU backend's
    "BLHNC": "BLHNC",
    "BLNHC": "BLNHC",
    "LHBNC": "LHBNC",  # head groups outside the block: one slab per head
    "BHLNC": "BHLNC",  # a block's tile covers every layer, head by head
}


def _views(order: str) -> dict[str, torch.Tensor]:
    """One ``[B, H, N, C]`` view per layer over one allocation laid out as ``order``."""
    sizes = {"L": LAYERS, "B": B, "H": H, "N": N, "C": C}
    raw = torch.arange(LAYERS * B * H * N * C, dtype=torch.float32).reshape([sizes[d] for d in order])
    full = raw.permute(*[order.index(d) for d in "LBHNC"])  # [L, B, H, N, C], a view
    return {f"model.layers.{i}.attn": full[i] for i in range(LAYERS)}


@pytest.mark.parametrize("name", sorted(PHYSICAL))
def test_every_resolved_layout_gives_dense_views_that_cover_each_block_once(name: str):
    kv = _views(PHYSICAL[name])
    lay = build_layout(kv, B)
    assert lay.block_bytes == LAYERS * H * N * C * 4
    for p in lay.planes:
        assert p.shape[0] == B and p.stride(1) == 1  # each row one dense run
    # Views, not copies: writing a block through the planes changes the layer tensors.
    for b in range(B):
        want = torch.cat([kv[k][b].reshape(-1) for k in sorted(kv)]).sort().values
        got = torch.cat([p[b].view(torch.float32) for p in lay.planes]).sort().values
        assert torch.equal(got, want)  # every element of the block, once
    before = {k: v.clone() for k, v in kv.items()}
    for p in lay.planes:
        p[4].copy_(p[1])  # move block 1's bytes into block 4, row by row
    for k, v in kv.items():
        assert torch.equal(v[4], before[k][1])  # block 4 now holds block 1, in every layer
        assert torch.equal(v[:4], before[k][:4]) and torch.equal(v[5:], before[k][5:])


def test_a_layout_with_no_dense_run_is_refused():
    t = torch.zeros(B, H, N, C * 2)[..., ::2]  # every other element: no byte run at all
    with pytest.raises(ValueError, match="layout not supported"):
        build_layout({"model.layers.0.attn": t}, B)
