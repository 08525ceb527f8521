"""Copy engines: whole blocks between vLLM's KV tensors and the CPU pool.

Who calls them: the worker half, from the worker's main thread. Every method returns at
once with a :class:`Transfer` (submit), whose completion is polled (``done``). Only
shutdown and sync loads on CPU wait.

Ordering contract (what the scheduler relies on): transfers run in submission order with
respect to the pool. On CPU, saves submitted with ``background=True`` (the saves after a
forward) run on one copy thread, in order. Sync loads run inline in the caller's thread
once that thread has no save left (``drain``). Layer-by-layer loads run on the same thread,
after the saves. On CUDA, every copy goes on one dedicated stream. So a load issued after
a save of the same slot sees its bytes. The stream waits for the compute stream before a
save: the model must have written the block. The compute stream waits for a sync load
before attention reads it. ``fence`` orders every copy submitted so far before any later
write to the KV cache. The worker calls it when a step's saves are issued. vLLM may reuse
a block as soon as its request finishes or is preempted, see
:mod:`vllm_kvtier.transfer.worker`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, Protocol

import torch

from vllm_kvtier import cpus
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
    def __init__(self, fut: Future[int], nbytes: int, started_s: float) -> None:
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


class _HostSave:
    """A save run on the copy thread.

    ``done`` and ``wait`` never raise. A failed copy is ``error``. The worker then
    invalidates the slots: a failed save is a future miss."""

    def __init__(self, fut: Future[int], nbytes: int, started_s: float) -> None:
        self._fut = fut
        self.nbytes = nbytes
        self.started_s = started_s

    def done(self) -> bool:
        return self._fut.done()

    def wait(self) -> None:
        with contextlib.suppress(BaseException):
            self._fut.result()

    @property
    def error(self) -> BaseException | None:
        return self._fut.exception() if self._fut.done() else None


class _EventTransfer:
    """One layer of a layer-by-layer host load.

    The copy thread sets it when the layer's rows are in place. It sets it too when its
    copy failed; ``wait`` then re-raises."""

    def __init__(self, nbytes: int, started_s: float) -> None:
        self.nbytes = nbytes
        self.started_s = started_s
        self.finished_s = 0.0
        self.error: BaseException | None = None
        self._event = threading.Event()

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self.finished_s = time.perf_counter()
        self._event.set()

    def done(self) -> bool:
        if self._event.is_set() and self.error is not None:
            raise self.error
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()
        if self.error is not None:
            raise self.error


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
    non_blocking: bool, host_threads: ThreadPoolExecutor | None = None, only_planes: list[int] | None = None,
) -> int:
    """Copy block rows for every plane (or ``only_planes``); one copy per run of
    consecutive blocks and slots."""
    # Bounds are checked here, once, because the host path copies by raw pointer.
    if blocks and not (min(blocks) >= 0 and max(blocks) < layout.num_blocks):
        raise IndexError(f"block id out of range [0, {layout.num_blocks})")
    if slots and not (min(slots) >= 0 and max(slots) < pool.num_slots):
        raise IndexError(f"slot out of range [0, {pool.num_slots})")
    if direction == "save":
        pairs = [(kv, host) for kv, host in zip(layout.planes, pool.planes, strict=True)]
        triples = runs(blocks, slots)
    else:
        pairs = [(host, kv) for kv, host in zip(layout.planes, pool.planes, strict=True)]
        triples = runs(slots, blocks)
    if only_planes is not None:
        pairs = [pairs[i] for i in only_planes]
    if layout.device.type == "cpu":
        small = [t for t in triples if t[2] * layout.plane_bytes[0] < _TORCH_COPY_MIN_BYTES]
        large = [t for t in triples if t[2] * layout.plane_bytes[0] >= _TORCH_COPY_MIN_BYTES]
        copies: list[tuple[int, int, int]] = []
        for src, dst in pairs:
            for a, b, n in large:  # torch's own multi-threaded copy is fastest here
                dst[b : b + n].copy_(src[a : a + n])
            copies.extend(_host_copies(src, dst, small))
        _memmove_all(copies, host_threads)
    else:
        for src, dst in pairs:
            for a, b, n in triples:
                dst[b : b + n].copy_(src[a : a + n], non_blocking=non_blocking)
    return layout.block_bytes * len(blocks)


def _host_copies(src: torch.Tensor, dst: torch.Tensor, triples: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(dst_ptr, src_ptr, nbytes) for host-to-host row copies between two uint8
    [rows, row_bytes] views whose rows are contiguous (checked by build_layout/CPUPool)."""
    row = src.shape[1]
    s_ptr, s_stride = src.data_ptr(), src.stride(0)
    d_ptr, d_stride = dst.data_ptr(), dst.stride(0)
    if s_stride == row and d_stride == row:
        return [(d_ptr + b * row, s_ptr + a * row, n * row) for a, b, n in triples]
    return [
        (d_ptr + (b + i) * d_stride, s_ptr + (a + i) * s_stride, row)
        for a, b, n in triples
        for i in range(n)
    ]


#: Runs of at least this many bytes (per plane) are copied by torch, whose multi-threaded
#: copy reaches a plain copy's bandwidth; smaller runs go to memmove (see _memmove_all).
_TORCH_COPY_MIN_BYTES = 1 << 20

#: Below this many bytes a batch of memmoves is run by the calling thread alone.
_PARALLEL_MIN_BYTES = 4 << 20


def _memmove_all(copies: list[tuple[int, int, int]], pool: ThreadPoolExecutor | None) -> None:
    """Run the copies with libc memmove, split by bytes over ``pool``'s threads.

    Why not ``dst[b:b+n].copy_(src[a:a+n])`` for small runs? A torch op costs ~5 us of
    dispatch (and an OpenMP fork/join), ten times a memmove call. Scattered block ids make
    many small runs. ctypes releases the GIL during each call, so the threads copy in
    parallel. One memmove thread does not saturate DRAM bandwidth. And an async load on the
    copy thread does not stall the engine thread. bench/cpu_tier_throughput.py compares
    this with one plain torch copy of the same bytes.
    """
    total = sum(c[2] for c in copies)
    nthreads = pool._max_workers + 1 if pool is not None else 1
    if nthreads == 1 or total < _PARALLEL_MIN_BYTES:
        _memmove_seq(copies)
        return
    share = -(-total // nthreads)
    parts: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for d, s, n in copies:
        while n > 0:
            take = min(n, room)
            parts[-1].append((d, s, take))
            d, s, n, room = d + take, s + take, n - take, room - take
            if room == 0 and len(parts) < nthreads:
                parts.append([])
                room = share
    assert pool is not None
    futures = [pool.submit(_memmove_seq, p) for p in parts[1:] if p]
    _memmove_seq(parts[0])
    for f in futures:
        f.result()


def _copy_rows_on_thread(*args: object) -> int:
    """:func:`_copy_rows` on the copy thread.

    vLLM's KV tensors are inference tensors. Torch updates them in place only under
    inference mode, which is a thread-local switch."""
    with torch.inference_mode():
        return _copy_rows(*args)  # type: ignore[arg-type]


def _memmove_seq(copies: list[tuple[int, int, int]]) -> None:
    memmove = ctypes.memmove
    for d, s, n in copies:
        memmove(d, s, n)


class HostCopyEngine:
    """KV cache in host memory (vLLM's CPU backend): plain memory copies."""

    def __init__(self, layout: KVLayout, pool: CPUPool, copy_threads: int | None = None) -> None:
        self.layout = layout
        self.pool = pool
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-copy",
                                      initializer=cpus.enter_background)
        # Helpers for large copies: as many threads as torch uses for compute (vLLM's CPU
        # worker sets it to its cores), minus the calling thread.
        n = copy_threads if copy_threads is not None else torch.get_num_threads()
        # Async loads are copied inline by default: with no DMA engine on the host, a copy
        # thread only competes with the engine loop, which spins through empty steps while
        # a request waits and holds the GIL between our many small memmove calls (bench:
        # async warm TTFT 0.60 s threaded vs 0.10 s sync for the same 63 blocks). The
        # request still waits for `finished_recving` as vLLM's async protocol requires.
        self.threaded_async = False
        #: The last job given to the copy thread (saves, layer loads): ``drain`` waits for it.
        self._last: Future[Any] | None = None
        self._helpers = (
            ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="kvtier-memmove") if n > 1 else None
        )

    def submit(
        self, direction: Direction, blocks: list[int], slots: list[int], *, background: bool
    ) -> Transfer:
        """Where a transfer runs.

        A ``background`` save runs on the copy thread. The caller's step goes on: its token
        is sampled and sent while the rows are copied. A ``background`` load runs on the
        copy thread only if ``threaded_async``. Anything else runs here, after the copy
        thread's queue."""
        t0 = time.perf_counter()
        nbytes = self.layout.block_bytes * len(blocks)
        if background and (direction == "save" or self.threaded_async):
            fut = self._bg.submit(
                _copy_rows_on_thread, self.layout, self.pool, direction, blocks, slots, False, self._helpers
            )
            self._last = fut
            return _HostSave(fut, nbytes, t0) if direction == "save" else _FutureTransfer(fut, nbytes, t0)
        self.drain()
        _copy_rows(self.layout, self.pool, direction, blocks, slots, False, self._helpers)
        return _Done(nbytes, t0)

    def drain(self) -> None:
        """Wait until the copy thread has run everything submitted to it (errors are the
        transfers' own)."""
        last, self._last = self._last, None
        if last is not None:
            with contextlib.suppress(BaseException):
                last.result()

    def submit_layers(self, blocks: list[int], slots: list[int]) -> dict[str, Transfer]:
        """Load slots into blocks layer by layer on the copy thread, in forward order.

        There is one transfer per layer. So the forward waits only for the layer it is about
        to run, while the next layers are still being copied (memmove releases the GIL)."""
        t0 = time.perf_counter()
        per_layer = self.layout.layer_planes()
        out = {
            name: _EventTransfer(sum(self.layout.plane_bytes[i] for i in idx) * len(blocks), t0)
            for name, idx in per_layer.items()
        }

        def run() -> None:
            for name, idx in per_layer.items():
                try:
                    # One thread: the compute threads are busy with the forward.
                    _copy_rows_on_thread(self.layout, self.pool, "load", blocks, slots, False, None, idx)
                    out[name].set()
                except BaseException as e:  # reported to the waiter, who recomputes
                    out[name].set(e)

        self._last = self._bg.submit(run)
        return dict(out)

    def order_before_compute(self, transfer: Transfer) -> None:
        """Make the model's next reads of the KV cache see ``transfer`` (sync loads)."""
        transfer.wait()

    def fence(self) -> None:
        """Order every copy submitted so far before any later write to the KV cache.

        On a host cache, wait here until the copy thread has run them all."""
        self.drain()

    def shutdown(self) -> None:
        self._bg.shutdown(wait=True)
        self._last = None
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)


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

    def submit_layers(self, blocks: list[int], slots: list[int]) -> dict[str, Transfer]:
        """Load layer by layer on the copy stream, one event per layer.

        The forward's stream waits for a layer's event just before that layer's attention.
        So the copies of later layers overlap the compute of earlier ones."""
        t0 = time.perf_counter()
        out: dict[str, Transfer] = {}
        self.stream.wait_stream(torch.cuda.current_stream(self.layout.device))
        with torch.cuda.stream(self.stream):
            for name, idx in self.layout.layer_planes().items():
                _copy_rows(self.layout, self.pool, "load", blocks, slots, True, None, idx)
                event = torch.cuda.Event()
                event.record(self.stream)
                out[name] = _CudaTransfer(event, sum(self.layout.plane_bytes[i] for i in idx) * len(blocks), t0)
        return out

    def order_before_compute(self, transfer: Transfer) -> None:
        assert isinstance(transfer, _CudaTransfer)
        torch.cuda.current_stream(self.layout.device).wait_event(transfer.event)

    def fence(self) -> None:
        """Order every copy submitted so far before any later write to the KV cache.

        The compute stream waits for the copy stream's work queued up to now. The host does
        not wait. Kernels queued later on the compute stream (the next step's) start after
        it."""
        event = torch.cuda.Event()
        event.record(self.stream)
        torch.cuda.current_stream(self.layout.device).wait_event(event)

    def drain(self) -> None:
        """Nothing to wait for on the host.

        The stream orders the copies. The compute stream waits on events where it must
        (``order_before_compute``)."""

    def shutdown(self) -> None:
        self.stream.synchronize()


CopyEngine = HostCopyEngine | CudaCopyEngine


def make_copy_engine(layout: KVLayout, pool: CPUPool) -> CopyEngine:
    if layout.device.type == "cuda":
        return CudaCopyEngine(layout, pool)
    if layout.device.type == "cpu":
        return HostCopyEngine(layout, pool)
    raise ValueError(f"kvtier: KV cache on device type {layout.device.type!r} is not supported")
