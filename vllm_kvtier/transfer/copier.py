"""Copy engines: whole blocks between vLLM's KV tensors and the CPU pool.

Who calls them: the worker half, from the worker's main thread. Every method returns at
once with a :class:`Transfer` (submit), whose completion is polled (``done``); only
shutdown and sync loads on CPU wait.

Ordering contract (what the scheduler relies on): transfers run in submission order with
respect to the pool. On CPU, saves and sync loads run inline in the caller's thread and
async loads on one background thread that only reads pinned slots. On CUDA, every copy
goes on one dedicated stream, so a load issued after a save of the same slot sees its
bytes; the stream waits for the compute stream before a save (the model must have written
the block) and the compute stream waits for a sync load before attention reads it.
"""

from __future__ import annotations

import ctypes
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, Protocol

import torch

from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.transfer.layout import KVLayout, runs

logger = logging.getLogger(__name__)

Direction = Literal["save", "load"]


class Transfer(Protocol):
    nbytes: int
    started_s: float

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class _Done:
    def __init__(self, nbytes: int, started_s: float) -> None:
        self.nbytes = nbytes
        self.started_s = started_s

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _FutureTransfer:
    def __init__(self, fut: Future[None], nbytes: int, started_s: float) -> None:
        self._fut = fut
        self.nbytes = nbytes
        self.started_s = started_s

    def done(self) -> bool:
        if self._fut.done():
            self._fut.result()  # re-raise a copy error in the caller's thread
            return True
        return False

    def wait(self) -> None:
        self._fut.result()


class _CudaTransfer:
    def __init__(self, event: torch.cuda.Event, nbytes: int, started_s: float) -> None:
        self.event = event
        self.nbytes = nbytes
        self.started_s = started_s

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


def _copy_rows(
    layout: KVLayout, pool: CPUPool, direction: Direction, blocks: list[int], slots: list[int],
    non_blocking: bool,
) -> int:
    """Copy block rows for every plane; one copy per run of consecutive blocks and slots."""
    # Bounds are checked here, once, because the host path copies by raw pointer.
    if blocks and not (0 <= min(blocks) and max(blocks) < layout.num_blocks):
        raise IndexError(f"block id out of range [0, {layout.num_blocks})")
    if slots and not (0 <= min(slots) and max(slots) < pool.num_slots):
        raise IndexError(f"slot out of range [0, {pool.num_slots})")
    if direction == "save":
        pairs = [(kv, host) for kv, host in zip(layout.planes, pool.planes, strict=True)]
        triples = runs(blocks, slots)
    else:
        pairs = [(host, kv) for kv, host in zip(layout.planes, pool.planes, strict=True)]
        triples = runs(slots, blocks)
    host_only = layout.device.type == "cpu"
    for src, dst in pairs:
        if host_only:
            _host_copy_runs(src, dst, triples)
        else:
            for a, b, n in triples:
                dst[b : b + n].copy_(src[a : a + n], non_blocking=non_blocking)
    return layout.block_bytes * len(blocks)


def _host_copy_runs(src: torch.Tensor, dst: torch.Tensor, triples: list[tuple[int, int, int]]) -> None:
    """Host-to-host row copies between two uint8 [rows, row_bytes] views whose rows are
    contiguous (checked by build_layout and CPUPool), by libc memmove.

    Why not ``dst[b:b+n].copy_(src[a:a+n])``: a torch op costs ~5 us of dispatch, ten
    times a memmove call, and with scattered block ids a step has many small runs; and
    for large runs, back-to-back torch copies on this backend measured 3-4x slower than
    memmove (OpenMP fork/join per op). bench/cpu_tier_throughput.py compares both paths
    against one plain torch copy of the same bytes. ctypes releases the GIL during the
    call, so an async load on the copy thread does not stall the engine thread.
    """
    row = src.shape[1]
    s_ptr, s_stride = src.data_ptr(), src.stride(0)
    d_ptr, d_stride = dst.data_ptr(), dst.stride(0)
    memmove = ctypes.memmove
    if s_stride == row and d_stride == row:
        for a, b, n in triples:
            memmove(d_ptr + b * row, s_ptr + a * row, n * row)
        return
    for a, b, n in triples:
        for i in range(n):
            memmove(d_ptr + (b + i) * d_stride, s_ptr + (a + i) * s_stride, row)


class HostCopyEngine:
    """KV cache in host memory (vLLM's CPU backend): plain memory copies."""

    def __init__(self, layout: KVLayout, pool: CPUPool) -> None:
        self.layout = layout
        self.pool = pool
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-copy")

    def submit(
        self, direction: Direction, blocks: list[int], slots: list[int], *, background: bool
    ) -> Transfer:
        t0 = time.perf_counter()
        nbytes = self.layout.block_bytes * len(blocks)
        if background:
            fut = self._bg.submit(_copy_rows, self.layout, self.pool, direction, blocks, slots, False)
            return _FutureTransfer(fut, nbytes, t0)
        _copy_rows(self.layout, self.pool, direction, blocks, slots, False)
        return _Done(nbytes, t0)

    def order_before_compute(self, transfer: Transfer) -> None:
        """Make the model's next reads of the KV cache see ``transfer`` (sync loads)."""
        transfer.wait()

    def shutdown(self) -> None:
        self._bg.shutdown(wait=True)


class CudaCopyEngine:
    """KV cache on a CUDA device: non-blocking copies on a dedicated stream, to and from
    pinned host memory, tracked with events."""

    def __init__(self, layout: KVLayout, pool: CPUPool) -> None:
        if not pool.pinned:
            logger.warning("kvtier: CPU pool is not pinned; CUDA copies will be synchronous")
        self.layout = layout
        self.pool = pool
        self.stream = torch.cuda.Stream(device=layout.device)

    def submit(
        self, direction: Direction, blocks: list[int], slots: list[int], *, background: bool
    ) -> Transfer:
        t0 = time.perf_counter()
        nbytes = self.layout.block_bytes * len(blocks)
        # Saves: the block was written by kernels already queued on the compute stream.
        # Loads: vLLM may have queued zeroing of newly allocated blocks there; our copy
        # must land after it.
        self.stream.wait_stream(torch.cuda.current_stream(self.layout.device))
        with torch.cuda.stream(self.stream):
            _copy_rows(self.layout, self.pool, direction, blocks, slots, True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _CudaTransfer(event, nbytes, t0)

    def order_before_compute(self, transfer: Transfer) -> None:
        assert isinstance(transfer, _CudaTransfer)
        torch.cuda.current_stream(self.layout.device).wait_event(transfer.event)

    def shutdown(self) -> None:
        self.stream.synchronize()


CopyEngine = HostCopyEngine | CudaCopyEngine


def make_copy_engine(layout: KVLayout, pool: CPUPool) -> CopyEngine:
    if layout.device.type == "cuda":
        return CudaCopyEngine(layout, pool)
    if layout.device.type == "cpu":
        return HostCopyEngine(layout, pool)
    raise ValueError(f"kvtier: KV cache on device type {layout.device.type!r} is not supported")
