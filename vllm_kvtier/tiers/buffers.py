"""Host memory for chunk transfers: page-aligned buffers, a bounded pool that reuses them,
and the write buffer a caller assembles a chunk in.

Who uses it: every chunk store (through :class:`~vllm_kvtier.tiers.kernel.StoreKernel`).
Also the worker-side chunk driver that fills write buffers
(:class:`~vllm_kvtier.transfer.tier_io.ChunkWorker`). The pool is INJECTED: the worker
creates one :class:`BufferPool` per process and hands it to every store it builds. So the
bound on idle memory is one number per process. And a test can give a store its own pool
and read what it allocated (:attr:`BufferPool.allocated_bytes`). :func:`shared_pool` is a
process-wide default for callers that truly have none (tools, benchmarks, tests).

Thread safety: a pool may be used from any thread; a buffer belongs to one owner at a time
(see the ownership rules of :class:`~vllm_kvtier.tiers.base.ChunkStore`).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from vllm_kvtier.chunkformat import align_up, header_bytes_for

__all__ = ["AlignedBuffer", "BufferPool", "Releasable", "WriteBuffer", "shared_pool"]


class Releasable(Protocol):
    """Memory behind a read result: an :class:`AlignedBuffer`, or a slice of a store's own
    registered arena (Mooncake). ``view`` is the memory; ``close`` gives it back."""

    view: memoryview

    def close(self) -> None: ...


class AlignedBuffer:
    """Page-aligned host memory for O_DIRECT (anonymous mmap), viewed as bytes.

    With a ``pool``, :meth:`close` hands the memory back to it for reuse instead of
    unmapping it (unless a slice of it is still alive somewhere).
    """

    def __init__(self, nbytes: int, pool: BufferPool | None = None) -> None:
        self.nbytes = align_up(max(nbytes, 1))
        self._map = mmap.mmap(-1, self.nbytes)
        self.view = memoryview(self._map)
        self._pool = pool
        #: False once the buffer came back from a pool: its bytes are a previous user's.
        self.fresh = True
        self._in_pool = False

    def close(self) -> None:
        if self._in_pool:  # closed twice: it is already idle in the pool
            return
        try:
            self.view.release()
        except BufferError:  # a caller exported the view itself; the GC frees the map later
            return
        pool, self._pool = self._pool, None
        if pool is not None and not self._map.closed and not self._exported():
            self.view = memoryview(self._map)
            if pool.give(self):
                return
            self.view.release()
        with contextlib.suppress(BufferError):  # a caller still holds a slice; the GC frees the map later
            self._map.close()

    def _exported(self) -> bool:
        """Whether a slice of the memory is still alive somewhere (then it must not be reused).
        A resize to the same size is a no-op mremap that mmap refuses while it has exports."""
        try:
            self._map.resize(self.nbytes)
            return False
        except BufferError:
            return True
        except (OSError, SystemError, TypeError, ValueError):  # no mremap here: never reuse
            return True


class BufferPool:
    """Idle :class:`AlignedBuffer` s kept for reuse, at most ``max_idle_bytes`` of them.

    Why: fresh anonymous memory is zeroed page by page by the kernel on first touch. On a
    2-vCPU VM that ran at ~1.7 GB/s, against ~16 GB/s to rewrite memory already mapped.
    So a new 32 MiB buffer per chunk cost more than reading the chunk from the disk. A read
    into a fresh buffer ran at half the speed of one into a reused buffer. Write buffers
    (filled by the caller) and read buffers (filled by the I/O threads) both come from
    here. A buffer is reused for any request of at least half its size.
    """

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._free: list[AlignedBuffer] = []
        self._idle = 0
        self._allocated = 0
        self._lock = threading.Lock()

    @property
    def allocated_bytes(self) -> int:
        """Bytes of new memory this pool ever mapped (reuse does not count): what a test
        reads to bound the memory an operation cost."""
        with self._lock:
            return self._allocated

    def take(self, nbytes: int) -> AlignedBuffer:
        need = align_up(max(nbytes, 1))
        with self._lock:
            fits = [b for b in self._free if need <= b.nbytes <= 2 * need]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self._free.remove(buf)
                self._idle -= buf.nbytes
                buf._pool, buf._in_pool = self, False
                return buf
            self._allocated += need
        return AlignedBuffer(need, pool=self)

    def give(self, buf: AlignedBuffer) -> bool:
        with self._lock:
            if self._idle + buf.nbytes > self.max_idle_bytes:
                return False
            buf.fresh, buf._in_pool = False, True
            self._free.append(buf)
            self._idle += buf.nbytes
            return True

    def clear(self) -> None:
        with self._lock:
            free, self._free, self._idle = self._free, [], 0
        for b in free:
            b._in_pool = False
            b.close()


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says the host has no memory to map now (``MemoryError``, or an
    ``OSError`` ENOMEM from mmap): callers in the serving path turn it into a miss."""
    return isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM)


#: Idle memory the default pool keeps: a few chunks' worth.
DEFAULT_IDLE_BYTES = 256 << 20
_shared: BufferPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> BufferPool:
    """A process-wide pool for callers that have none of their own (tools, benchmarks,
    tests). The serving path creates its own pool per worker and injects it."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BufferPool(DEFAULT_IDLE_BYTES)
        return _shared


@dataclass
class WriteBuffer:
    """A chunk being assembled by the caller: fill ``block(i)`` for every key, then submit.

    Room is left for the header, which the store stamps (CRCs and keys) when it writes.
    ``pool``: where the memory comes from (None: :func:`shared_pool`). ``authenticated``:
    room for the signed header (the store's ``authenticated``; a store refuses a buffer
    built for the other format, ``bad_request``).

    ``fill``: the blocks are copied in later, by the store on its I/O thread, just before
    it stamps the header (so the caller's thread does not copy). It returns False when
    its source changed meanwhile (the bytes it copied may be torn): the store then writes
    nothing and ends the write ``superseded``."""

    keys: list[bytes]
    block_bytes: int
    pool: BufferPool | None = None
    authenticated: bool = False
    fill: Callable[[WriteBuffer], bool] | None = None
    buf: AlignedBuffer = field(init=False)
    header_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.header_bytes = header_bytes_for(len(self.keys), self.authenticated)
        stride = align_up(self.block_bytes)
        self.buf = (self.pool or shared_pool()).take(self.header_bytes + len(self.keys) * stride)
        if not self.buf.fresh and stride != self.block_bytes:
            for i in range(len(self.keys)):  # the padding is written too: no stale bytes on disk
                off = self.header_bytes + i * stride
                self.buf.view[off + self.block_bytes : off + stride] = bytes(stride - self.block_bytes)

    def block(self, i: int) -> memoryview:
        off = self.header_bytes + i * align_up(self.block_bytes)
        return self.buf.view[off : off + self.block_bytes]

    def close(self) -> None:
        """Give the memory back (the caller's job after a refused submit)."""
        self.buf.close()
