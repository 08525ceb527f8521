"""How one engine block sits in vLLM's KV tensors, as byte planes.

vLLM hands the worker one tensor per attention layer. The block dimension and what
surrounds it depend on the attention backend:

* CPU attention: ``[num_blocks, kv_heads, block_size, 2 * head_size]``: a block is one
  contiguous slab per layer (K then V inside it).
* FlashAttention-style CUDA backends: ``[2, num_blocks, block_size, kv_heads, head_size]``:
  a block is two contiguous slabs per layer (K and V).
* vLLM 0.32 hands every layer as a standardized ``[B, H, N, C]`` view. The view is over
  the physical layout it resolved (``LBNHC`` = NHD, ``LBHNC`` = HND, ``BLHNC``, ``LHBNC``,
  ...). The view's order is not the memory's. So a block's bytes are found by stride
  (:func:`_dense_planes`), not by the view's dimension order.

We do not interpret the bytes. A *plane* is a ``uint8`` view ``[num_blocks, plane_bytes]``
in which each block's row is contiguous. A layer yields one plane per index of the
dimensions outside the block dimension. A stored block is the concatenation of its rows in
every plane, in a fixed order. The copy engines move whole rows, merging runs of
consecutive blocks into one copy.

Hybrid models (vLLM's hybrid KV cache manager): the KV cache groups alias one memory
region. So several layer names map to the same tensor (one layer of each group). Such a
tensor yields its planes once: :func:`build_layout` dedupes by storage, offset, shape and
strides. A unit of any group is then the rows of every plane at that group's block id. A
block id's rows hold whichever group's KV vLLM put there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Byte planes of all layers. Built once, in the worker, in ``register_kv_caches``."""

    planes: tuple[torch.Tensor, ...]  # each uint8 [num_blocks, plane_bytes], rows contiguous
    plane_bytes: tuple[int, ...]
    num_blocks: int
    device: torch.device
    dtype: torch.dtype
    description: str  # e.g. "2 layers x 1 plane [N,H,B,2D] bfloat16", for logs
    #: the layer (vLLM's layer name) each plane belongs to, in plane order
    plane_layers: tuple[str, ...] = ()
    #: some layers share their tensor with another layer (kept once, under the first name)
    shared: bool = False

    def layer_planes(self) -> dict[str, list[int]]:
        """Layer name -> indices of its planes, in forward order (for layer-by-layer loads)."""
        out: dict[str, list[int]] = {}
        for i, name in enumerate(self.plane_layers):
            out.setdefault(name, []).append(i)
        return out

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers (of this rank's shard)."""
        return sum(self.plane_bytes)


def _block_dim(t: torch.Tensor, num_blocks: int, name: str) -> int:
    dims = [d for d in range(t.dim()) if t.shape[d] == num_blocks]
    if not dims:
        raise ValueError(
            f"KV tensor {name} of shape {tuple(t.shape)} has no dimension of size "
            f"num_blocks={num_blocks}; this attention backend's layout is not supported"
        )
    # With several candidates, the block dimension is the outermost of the inner ones:
    # the largest stride.
    return max(dims, key=lambda d: t.stride(d))


def build_layout(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> KVLayout:
    if not kv_caches:
        raise ValueError("no KV cache tensors were registered")
    planes: list[torch.Tensor] = []
    plane_layers: list[str] = []
    dtypes = set()
    devices = set()
    shapes = set()
    seen: set[tuple] = set()
    for name in sorted(kv_caches, key=_layer_order):
        t = kv_caches[name]
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if ident in seen:
            continue  # the same memory as a layer already laid out (hybrid KV cache groups)
        seen.add(ident)
        dtypes.add(t.dtype)
        devices.add(t.device)
        shapes.add(tuple(t.shape))
        d = _block_dim(t, num_blocks, name)
        outer = t.shape[:d]
        moved = t.movedim(d, len(outer))  # [*outer, N, *rest], a view
        for idx in _product(outer):
            for plane in _dense_planes(moved[idx] if idx else moved, num_blocks, name, t):
                planes.append(plane)
                plane_layers.append(name)
    if len(dtypes) != 1 or len(devices) != 1:
        raise ValueError(f"KV tensors must share one dtype and device, got {dtypes} {devices}")
    dtype = dtypes.pop()
    distinct = len(seen)
    desc = (
        f"{distinct} layers x {len(planes) // distinct} plane(s), "
        f"layer shape {sorted(shapes)[0]}, {dtype}"
        + (f" ({len(kv_caches)} layer names share them)" if distinct < len(kv_caches) else "")
    )
    return KVLayout(
        planes=tuple(planes),
        plane_bytes=tuple(int(p.shape[1]) for p in planes),
        num_blocks=num_blocks,
        device=devices.pop(),
        dtype=dtype,
        description=desc,
        plane_layers=tuple(plane_layers),
        shared=distinct < len(kv_caches),
    )


def _dense_planes(p: torch.Tensor, num_blocks: int, name: str, t: torch.Tensor) -> list[torch.Tensor]:
    """The uint8 planes ``[num_blocks, row_bytes]`` of ``p`` (``[N, *rest]``, blocks first).

    vLLM hands every layer as a ``[B, H, N, C]`` view whatever the physical layout it
    resolved. So a block's ``[H, N, C]`` is often dense in memory but not in view order
    (NHD: ``LBNHC``, FlashAttention's default). Or it is split by a dimension that lies
    outside the layer's slab (``LHBNC``, ``BHLNC``: one slab per head group). The inner
    dimensions are taken in memory order (largest stride first). The outermost are peeled
    off into planes of their own until what is left is contiguous. Each plane's row is then
    one dense run of bytes, moved as it sits. The bytes of a block therefore depend on the
    physical layout. That is why the resolved layout is part of the namespace."""
    inner = sorted(range(1, p.dim()), key=lambda d: (p.shape[d] > 1, p.stride(d)), reverse=True)
    x = p.permute(0, *inner)  # [N, *rest in memory order]
    for peel in range(len(inner)):  # at least one dimension left: a row, not single elements
        row = x[(0,) * (1 + peel)]
        if row.is_contiguous():
            break
    else:
        raise ValueError(
            f"KV tensor {name} of shape {tuple(t.shape)} strides {t.stride()}: "
            "no dense run of a block's bytes; layout not supported"
        )
    n_row = math.prod(x.shape[1 + peel:])
    out = []
    for idx in _product(tuple(x.shape[1:1 + peel])):
        at: tuple[slice | int, ...] = (slice(None), *idx)
        sub = x[at] if idx else x  # [N, *dense row]
        out.append(sub.view(num_blocks, n_row).view(torch.uint8))  # a view: never a copy
    return out


def _product(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [i + (j,) for i in out for j in range(n)]
    return out


def _layer_order(name: str) -> tuple[int, str]:
    """Sort "model.layers.10.attn" after "model.layers.9.attn"."""
    nums = [int(p) for p in name.split(".") if p.isdigit()]
    return (nums[0] if nums else -1, name)


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Split paired indices into maximal runs where both advance by one.

    Returns ``(src_start, dst_start, length)`` triples: one copy call per run instead of one
    per block. A fresh pool hands out consecutive slots, and vLLM's free list hands a
    request mostly consecutive blocks. So long prompts become a handful of large copies.
    """
    out: list[tuple[int, int, int]] = []
    if not src:
        return out
    s0, d0, n = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:], strict=True):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            out.append((s0, d0, n))
            s0, d0, n = s, d, 1
    out.append((s0, d0, n))
    return out
