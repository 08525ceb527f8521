"""How a block is stored below the CPU tier: as it is, or as FP8 (e4m3) with scales.

A block here is one CPU pool slot: the rows of every byte plane of
:class:`~vllm_kvtier.transfer.layout.KVLayout`, in plane order. Each row holds elements of
the KV cache's dtype. A :class:`BlockCodec` turns those rows into the bytes a chunk
stores (``encode``) and back (``decode``).

* Format "native": no codec, the slot's bytes as they are. ``storage_dtype: fp8`` gets it
  too when the engine's KV cache already is 8-bit. That is vLLM's FP8 KV cache; its
  tensors are ``float8_*`` or ``uint8``. There is nothing to shrink, so storage is a plain
  copy, under the native namespace (the bytes are the same).
* :class:`FP8Codec`: for float32, bfloat16 and float16 caches. The block's elements, as one
  flat sequence, are cut into groups of :data:`GROUP` consecutive elements. Each group
  gets a float32 scale ``amax / 448``. Its elements are stored as e4m3 of ``x / scale``.

Encoded block::

    scales   ceil(n / GROUP) x float32 (little endian)   first, so they are 4-byte aligned
    payload  n x float8_e4m3fn

The block carries its scales, so it decodes alone. The chunk's namespace guarantees it is
never read as anything else. That namespace is derived from the engine's and the storage
format (see :func:`vllm_kvtier.engine.lower.tier_namespace`).

**Why groups of 1024 elements.** e4m3 is a floating-point format. Every value within 2^15
of its group's maximum keeps 3 mantissa bits (relative error <= 2^-4), whatever the scale.
The scale only places the group's maximum at 448. So finer scales help only elements more
than four decades below their neighbours. Those fall into e4m3's subnormals (absolute
error <= scale * 2^-10), and matter little in attention's dot products. Per block and
plane would therefore do. Per token and head (64-128 elements) would cost 3-6% more bytes
for almost nothing. A fixed group of 1024 elements costs 0.4% more bytes. It keeps an
outlier's reach to 1024 elements. On the CPU attention layout that is a few tokens of one
head, K and V. On FlashAttention-style layouts it is one K or V row of a token, all its
heads, for 8 heads of 128. Above all, it makes the encoded size a function of the block
bytes and the element size alone (:func:`stored_block_bytes`). So the scheduler, which
never sees the attention backend's planes, computes the same size as the worker. Groups
follow plane boundaries whenever a plane holds a multiple of 1024 elements (block_size x
heads x head_size: every usual geometry). Otherwise a group may span two planes, which is
only a shared scale. Measured on the tiny random model in transformers, 48 prompts: the
first token's |logprob difference| after quantizing its KV. Groups of 64 (token x head)
gave 0.116, of 1024 0.130, of 8192 0.125, one scale per tensor 0.164. bf16 rounding, for
scale, gave 0.008. The 3-bit mantissa dominates. Finer scales would buy ~10% of the drift
for 6% more bytes.

Who calls it: :class:`~vllm_kvtier.transfer.tier_io.ChunkWorker`, from the worker's
main thread, once per block written or read. Pure torch on CPU tensors; no I/O, no state.
Cost (one core, bench/fp8_drift.py prints it): roughly 1 G elements/s each way, against
~10 for a plain copy. A 2 MiB bf16 block takes ~1 ms to encode and to decode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, Protocol

import torch

#: Elements per scale group (see the module docstring for the choice).
GROUP = 1024
#: Largest finite e4m3fn value: a group's maximum is scaled to it.
FP8_MAX = 448.0
#: Smallest group maximum we scale by: the smallest power of two that keeps
#: ``FP8_MAX / amax`` finite in float32. An all-zero group stays exactly zero; a group of
#: tinier values (fp32 subnormals; KV never is) keeps an absolute error <= 2^-128 / 448.
MIN_AMAX = 2.0**-118
#: The dtypes FP8Codec encodes.
FP8_SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

StorageDtype = Literal["native", "fp8"]
#: What is really stored: the block's bytes, or FP8Codec's encoding. The name goes into
#: the tier's namespace digest; change it when the encoding changes.
StorageFormat = Literal["native", "fp8e4m3-g1024-v1"]
FP8_FORMAT: StorageFormat = "fp8e4m3-g1024-v1"


def storage_format(storage_dtype: StorageDtype, kv_dtype: torch.dtype | None) -> StorageFormat:
    """What a tier configured with ``storage_dtype`` stores for a KV cache of ``kv_dtype``.

    "fp8" on an 8-bit cache (already FP8) or on a dtype we do not encode is "native": a
    plain copy. ``kv_dtype`` None (unknown) only allows "native". Scheduler and workers
    call this with the same arguments, so they agree on sizes and namespaces."""
    if storage_dtype == "fp8" and kv_dtype is not None and kv_dtype in FP8_SOURCE_DTYPES:
        return FP8_FORMAT
    return "native"


def stored_block_bytes(block_bytes: int, elem_bytes: int, fmt: StorageFormat) -> int:
    """Bytes of one stored block: a pure function, computed alike by scheduler and worker."""
    if fmt == "native":
        return block_bytes
    if block_bytes % elem_bytes:
        raise ValueError(f"block of {block_bytes} B is not made of {elem_bytes}-byte elements")
    n = block_bytes // elem_bytes
    return 4 * math.ceil(n / GROUP) + n


class BlockCodec(Protocol):
    """Slot rows <-> stored block bytes. ``rows``: the slot's row of each plane (uint8,
    contiguous), in plane order; ``out``/``data``: exactly ``stored_bytes`` long. Neither
    method blocks on anything but memory; both raise ValueError on a wrong length."""

    @property
    def stored_bytes(self) -> int: ...
    def encode(self, rows: Sequence[torch.Tensor], out: memoryview) -> None: ...
    def decode(self, data: memoryview, rows: Sequence[torch.Tensor]) -> None: ...


class FP8Codec:
    """e4m3 with a float32 scale per :data:`GROUP` elements (layout in the module docstring)."""

    def __init__(self, block_bytes: int, dtype: torch.dtype) -> None:
        if dtype not in FP8_SOURCE_DTYPES:
            raise ValueError(f"FP8 storage encodes {FP8_SOURCE_DTYPES}, not {dtype}")
        self.dtype = dtype
        self.block_bytes = block_bytes
        esize = dtype.itemsize
        self.stored_bytes = stored_block_bytes(block_bytes, esize, FP8_FORMAT)
        self.elements = block_bytes // esize
        self.groups = math.ceil(self.elements / GROUP)

    def _split(self, buf: memoryview) -> tuple[torch.Tensor, torch.Tensor]:
        b = _bytes_of(buf, self.stored_bytes)
        return b[: 4 * self.groups].view(torch.float32), b[4 * self.groups :].view(torch.float8_e4m3fn)

    def _flat_rows(self, rows: Sequence[torch.Tensor]) -> bool:
        """True when every row but the last holds whole groups: then each row is coded in
        place (no copy), since the flat sequence's groups never cross a row boundary."""
        if sum(r.numel() for r in rows) != self.block_bytes:
            raise ValueError(f"rows hold {sum(r.numel() for r in rows)} B, expected {self.block_bytes}")
        return all((r.numel() // self.dtype.itemsize) % GROUP == 0 for r in rows[:-1])

    def encode(self, rows: Sequence[torch.Tensor], out: memoryview) -> None:
        scales, payload = self._split(out)
        if not self._flat_rows(rows):  # an unusual geometry: one copy into a flat block
            rows = [torch.cat([r.reshape(-1) for r in rows])]
        e = g = 0
        for r in rows:
            x = r.view(self.dtype)
            n = x.numel()
            _encode(x, payload[e : e + n], scales[g : g + math.ceil(n / GROUP)])
            e += n
            g += n // GROUP

    def decode(self, data: memoryview, rows: Sequence[torch.Tensor]) -> None:
        scales, payload = self._split(data)
        targets = list(rows)
        flat = None
        if not self._flat_rows(rows):
            flat = torch.empty(self.block_bytes, dtype=torch.uint8)
            targets = [flat]
        e = g = 0
        for r in targets:
            x = r.view(self.dtype)
            n = x.numel()
            _decode(payload[e : e + n], scales[g : g + math.ceil(n / GROUP)], x)
            e += n
            g += n // GROUP
        if flat is not None:
            off = 0
            for r in rows:
                r.copy_(flat[off : off + r.numel()])
                off += r.numel()


def make_codec(fmt: StorageFormat, block_bytes: int, kv_dtype: torch.dtype | None) -> BlockCodec | None:
    """The codec of a tier storing ``fmt`` (see :func:`storage_format`); None for
    "native": no encoding, the slot's bytes are stored as they are."""
    if fmt == "native":
        return None
    if kv_dtype is None:
        raise ValueError("FP8 storage needs the KV cache's dtype")
    return FP8Codec(block_bytes, kv_dtype)


# ---- the math, on 1-D tensors of one row (whole groups, then at most one partial one) ----


def _groups(n: int) -> list[tuple[int, int, int]]:
    """(start, rows, cols) of the 2-D views that cover ``n`` elements group by group."""
    full = n // GROUP
    parts = [(0, full, GROUP)] if full else []
    if n % GROUP:
        parts.append((full * GROUP, 1, n % GROUP))
    return parts


def _encode(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    for start, rows, cols in _groups(x.numel()):
        xs = x[start : start + rows * cols].view(rows, cols)
        # abs().amax() is ~10x faster than aminmax on CPU; the temporary is one row.
        amax = xs.abs().amax(dim=1).float().clamp_min_(MIN_AMAX)
        g0 = start // GROUP
        torch.div(amax, FP8_MAX, out=s[g0 : g0 + rows])
        # |x| * (448 / amax) <= 448 * (1 + 2^-23): rounds to 448, never to NaN (>= 464).
        scaled = xs.float() if xs.dtype != torch.float32 else xs
        q[start : start + rows * cols].view(rows, cols).copy_(scaled * (FP8_MAX / amax)[:, None])


def _decode(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
    for start, rows, cols in _groups(out.numel()):
        qs = q[start : start + rows * cols].view(rows, cols)
        g0 = start // GROUP
        # torch's float8 -> float conversion is scalar on CPU (~0.3 G/s); this bit move
        # is ~4x faster: e4m3's exponent and mantissa bits, shifted into a float16's, give
        # the same value / 2^8 for every finite code, subnormals included (e4m3 bias 7,
        # float16 bias 15), so the 2^8 folds into the scale.
        b = qs.view(torch.uint8).to(torch.int16)
        h = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).view(torch.float16)
        torch.mul(h, (s[g0 : g0 + rows] * 256.0)[:, None], out=out[start : start + rows * cols].view(rows, cols))


def _bytes_of(buf: memoryview, nbytes: int) -> torch.Tensor:
    if buf.nbytes != nbytes:
        raise ValueError(f"block buffer of {buf.nbytes} B, expected {nbytes}")
    return torch.frombuffer(buf, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
