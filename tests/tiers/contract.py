"""THE store contract suite (vllm_kvtier.tiers.base.ChunkStore), written once.

A medium is bound to it in a few lines: a class named ``Test...`` that derives from
:class:`StoreContract` and says how to build its store and how to reach its stored bytes
through the medium itself (a dict entry, a file, an object written with a raw client),
never through the store's private state::

    class TestMemoryStore(StoreContract):
        def make_store(self, tmp_path, **kw):
            return MemoryStore(NS, BLOCK, **kw)
        def get_raw(self, store, chunk_id):
            return bytes(store.raw(chunk_id))
        def put_raw(self, store, chunk_id, data):
            store.forge(chunk_id, data)

``make_store`` gets the kernel's knobs as keywords (``buffers``, ``read_deadline_s``,
``max_queued_writes``, ``max_chunk_blocks``, ``auth``) and must pass them on, and
``rank`` (default 0): the store's rank, which names its place in the medium (``r<rank>``).
A binding whose stores share one key space across tests may give each store a rank of its
own instead, as long as stores asked for different ranks get different ones. File media also derive
:class:`FileMediumContract` (sparse files, FIFOs, the start-up scan).

Every adversarial case ends as a miss with a named FailureReason, and its memory is
ASSERTED: the store's injected BufferPool's ``allocated_bytes`` and ``tracemalloc``'s peak
stay under :data:`SMALL` however large the sizes the stored bytes claim.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_kvtier.chunkformat import ChunkHeader, block_crc, decode_header, encode_header, make_header
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.auth import ChunkAuth
from vllm_kvtier.tiers.base import ChunkStore, IOResult
from vllm_kvtier.tiers.buffers import BufferPool, WriteBuffer
from vllm_kvtier.tiers.kernel import KernelSettings, KernelStore, Medium, StoreKernel

BLOCK = 3000  # deliberately not a multiple of 4096: the format pads it
NS = "contract00000000"
MAX_BLOCKS = 8  # the stores' max_chunk_blocks (the config's chunk_blocks)
#: What any failed read may allocate at most: a header probe and a few pages.
SMALL = 256 << 10


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8  # 32 bytes, like a hash


def block(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(BLOCK))


_backlog: dict[int, list[IOResult]] = {}


def wait_for(store: ChunkStore, job: int, timeout_s: float = 10.0) -> IOResult:
    """The result of ``job``; results of other jobs polled meanwhile are kept for their
    own ``wait_for``."""
    end = time.monotonic() + timeout_s
    seen = _backlog.setdefault(id(store), [])
    while True:
        seen += store.poll()
        for r in seen:
            if r.job_id == job:
                seen.remove(r)
                return r
        if time.monotonic() > end:
            raise AssertionError(f"job {job} gave no result within {timeout_s} s")
        store.wait(0.01)


#: Two keys (32 bytes each): the one the stores share, and another fleet's.
KEY = hashlib.sha256(b"contract key").digest()
OTHER_KEY = hashlib.sha256(b"another fleet's key").digest()


def crc_forged(data: bytes, target: int) -> bytes:
    """``data`` with its last 4 bytes changed so that its CRC32 is ``target``: what anyone
    can do to a CRC (it is affine over GF(2) in the input bits), and why it is no MAC."""
    base = bytearray(data)
    base[-4:] = bytes(4)
    c0 = block_crc(bytes(base))
    cols = []  # the CRC change each of the 32 free bits makes
    for bit in range(32):
        probe = bytearray(base)
        probe[-4 + bit // 8] ^= 1 << (bit % 8)
        cols.append(block_crc(bytes(probe)) ^ c0)
    # Solve sum(x_i * cols[i]) = target ^ c0 over GF(2) by elimination on (column, bit mask).
    rows = [(c, 1 << i) for i, c in enumerate(cols)]
    basis: dict[int, tuple[int, int]] = {}
    for c, m in rows:
        for hb in sorted(basis, reverse=True):
            if c >> hb & 1:
                c, m = c ^ basis[hb][0], m ^ basis[hb][1]
        if c:
            basis[c.bit_length() - 1] = (c, m)
    want, mask = target ^ c0, 0
    for hb in sorted(basis, reverse=True):
        if want >> hb & 1:
            want, mask = want ^ basis[hb][0], mask ^ basis[hb][1]
    assert want == 0, "CRC32's 32 bits are always reachable"
    for bit in range(32):
        if mask >> bit & 1:
            base[-4 + bit // 8] ^= 1 << (bit % 8)
    assert block_crc(bytes(base)) == target
    return bytes(base)


def fill(pool: BufferPool, first: int, n: int, authenticated: bool = False) -> WriteBuffer:
    wb = WriteBuffer([key(first + i) for i in range(n)], BLOCK, pool, authenticated=authenticated)
    for i in range(n):
        with wb.block(i) as b:
            b[:] = block(first + i)
    return wb


class _Wrapper:
    """A medium wrapper: deletes and failure classes are the wrapped medium's, and its
    close is the wrapped store's business."""

    def __init__(self, inner: Medium, name: str) -> None:
        self.inner = inner
        self.name = f"{name}-{inner.name}"
        self.read_shape = inner.read_shape

    def delete(self, chunk_id: str) -> None:
        self.inner.delete(chunk_id)

    def classify(self, exc: BaseException) -> FailureReason:
        return self.inner.classify(exc)

    def close(self) -> None:
        pass


class Stalled(_Wrapper):
    """A medium wrapper whose reads (and, with ``writes``, puts) block until ``go`` is set:
    a hung disk or endpoint."""

    def __init__(self, inner: Medium, *, writes: bool = False) -> None:
        super().__init__(inner, "stalled")
        self.go = threading.Event()
        self.entered = threading.Event()
        self._writes = writes

    def put(self, chunk_id: str, view: memoryview, deadline: float) -> None:
        if self._writes:
            self.entered.set()
            self.go.wait(30)
        self.inner.put(chunk_id, view, deadline)

    def read_into(self, chunk_id: str, offset: int, dst: memoryview, deadline: float) -> None:
        self.entered.set()
        self.go.wait(30)
        self.inner.read_into(chunk_id, offset, dst, deadline)


class Raising(_Wrapper):
    """A batching medium wrapper whose first ``fail`` batch puts and reads raise instead of
    answering per item (a client library that throws), then pass through item by item."""

    max_batch = 4

    def __init__(self, inner: Medium, fail: int) -> None:
        super().__init__(inner, "raising")
        self.puts_left = self.reads_left = fail

    def put_batch(self, items: list[tuple[str, memoryview]], deadline: float) -> list[BaseException | None]:
        if self.puts_left > 0:
            self.puts_left -= 1
            raise RuntimeError("put_batch blew up")
        for chunk_id, view in items:
            self.inner.put(chunk_id, view, deadline)
        return [None] * len(items)

    def read_batch(self, items: list[tuple[str, int, memoryview]], deadline: float) -> list[BaseException | None]:
        if self.reads_left > 0:
            self.reads_left -= 1
            raise RuntimeError("read_batch blew up")
        for chunk_id, offset, dst in items:
            self.inner.read_into(chunk_id, offset, dst, deadline)
        return [None] * len(items)

    def put(self, chunk_id: str, view: memoryview, deadline: float) -> None:
        raise AssertionError("a batching medium is called by batch")

    def read_into(self, chunk_id: str, offset: int, dst: memoryview, deadline: float) -> None:
        raise AssertionError("a batching medium is called by batch")


class StoreContract:
    """The cases every medium must pass (see the module doc for binding one)."""

    # ---- the binding --------------------------------------------------------------------

    def make_store(self, tmp_path: Path, **kw: Any) -> KernelStore[Any]:
        raise NotImplementedError

    def get_raw(self, store: KernelStore[Any], chunk_id: str) -> bytes:
        """The stored bytes of a chunk, read through the medium."""
        raise NotImplementedError

    def put_raw(self, store: KernelStore[Any], chunk_id: str, data: bytes) -> None:
        """Store ``data`` as the chunk, through the medium (a foreign or damaged writer)."""
        raise NotImplementedError

    # ---- fixtures and helpers ------------------------------------------------------------

    @pytest.fixture
    def pool(self) -> BufferPool:
        return BufferPool(64 << 20)

    @pytest.fixture
    def store(self, tmp_path: Path, pool: BufferPool) -> Iterator[KernelStore[Any]]:
        s = self.make_store(tmp_path, buffers=pool, read_deadline_s=5.0, max_chunk_blocks=MAX_BLOCKS)
        yield s
        s.close(timeout_s=10.0)

    def write(self, store: KernelStore[Any], pool: BufferPool, chunk_id: str, first: int = 0, n: int = 5,
              job: int = 1) -> ChunkHeader:
        assert store.submit_write(job, chunk_id, fill(pool, first, n))
        r = wait_for(store, job)
        assert r.ok and r.reason is None and r.header is not None, r.reason
        assert r.header.keys == tuple(key(first + i) for i in range(n))
        return r.header

    def read(self, store: KernelStore[Any], chunk_id: str, header: ChunkHeader | None, positions: list[int],
             keys: list[bytes] | None = None, job: int = 100) -> IOResult:
        store.submit_read(job, chunk_id, header, positions, keys if keys is not None else [key(p) for p in positions])
        return wait_for(store, job)

    def assert_miss(self, store: KernelStore[Any], pool: BufferPool, chunk_id: str, header: ChunkHeader | None,
                    positions: list[int], reason: FailureReason, keys: list[bytes] | None = None) -> None:
        """The read fails with ``reason``, and cost no more than SMALL bytes of memory."""
        before = pool.allocated_bytes
        tracemalloc.start()
        try:
            r = self.read(store, chunk_id, header, positions, keys)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert not r.ok and r.reason is reason and r.blocks is None, r.reason
        assert pool.allocated_bytes - before <= SMALL, pool.allocated_bytes - before
        assert peak <= SMALL, peak

    # ---- the plain contract ---------------------------------------------------------------

    def test_is_a_chunk_store(self, store: KernelStore[Any]) -> None:
        assert isinstance(store, ChunkStore)
        assert store.block_bytes == BLOCK
        assert store.poll() == []

    def test_round_trip(self, store: KernelStore[Any], pool: BufferPool) -> None:
        h = self.write(store, pool, "c1", 0, 5)
        assert h.nblocks == 5 and h.block_bytes == BLOCK and h.namespace == NS
        r = self.read(store, "c1", h, [0, 1, 2, 3, 4])
        assert r.ok and r.blocks is not None, r.reason
        assert [b.tobytes() for b in r.blocks] == [block(i) for i in range(5)]
        r.release()

    @pytest.mark.parametrize("positions", [[3, 1, 4], [0], [4], [0, 4], [2, 3], [1, 3, 2, 0]])
    @pytest.mark.parametrize("known", [True, False], ids=["header", "no-header"])
    def test_ranged_reads_of_any_positions(self, store: KernelStore[Any], pool: BufferPool, positions: list[int],
                                           known: bool) -> None:
        h = self.write(store, pool, "c1", 10, 5)
        r = self.read(store, "c1", h if known else None, positions, [key(10 + p) for p in positions])
        assert r.ok and r.blocks is not None, r.reason
        assert [b.tobytes() for b in r.blocks] == [block(10 + p) for p in positions]
        assert r.header == h  # a read without a header returns the verified one
        r.release()

    def test_duplicate_ids_and_chunks(self, store: KernelStore[Any], pool: BufferPool) -> None:
        h1 = self.write(store, pool, "dup", 0, 3, job=1)
        h2 = self.write(store, pool, "dup", 0, 3, job=2)  # the same chunk again: fine
        assert h1 == h2
        self.write(store, pool, "other", 0, 3, job=3)  # the same blocks under another id
        for cid in ("dup", "other"):
            r = self.read(store, cid, h1, [2])
            assert r.ok and r.blocks is not None and r.blocks[0].tobytes() == block(2), r.reason
            r.release()

    def test_exactly_one_result_per_job(self, store: KernelStore[Any], pool: BufferPool) -> None:
        h = self.write(store, pool, "c1", 0, 4)
        for j in range(10, 20):
            store.submit_read(j, "c1", h, [j % 4], [key(j % 4)])
        seen: list[int] = []
        end = time.monotonic() + 10
        while len(seen) < 10 and time.monotonic() < end:
            for r in store.poll():
                seen.append(r.job_id)
                assert r.ok, r.reason
                r.release()
            store.wait(0.01)
        time.sleep(0.05)
        assert sorted(seen + [r.job_id for r in store.poll()]) == list(range(10, 20))

    def test_delete(self, store: KernelStore[Any], pool: BufferPool) -> None:
        h = self.write(store, pool, "c1", 0, 2)
        self.write(store, pool, "c2", 5, 2, job=2)
        store.submit_delete("c1")
        store.submit_delete("never-stored")  # absent is fine
        end = time.monotonic() + 5
        deletes = 0
        while deletes < 2 and time.monotonic() < end:
            deletes += sum(r.kind == "delete" for r in store.poll())
            store.wait(0.01)
        r = self.read(store, "c1", h, [0])
        assert not r.ok and r.reason is FailureReason.MISSING and r.reason.damaged
        r = self.read(store, "c2", None, [1], [key(6)], job=101)
        assert r.ok, r.reason
        r.release()

    def test_bad_requests(self, store: KernelStore[Any], pool: BufferPool) -> None:
        h = self.write(store, pool, "c1", 0, 2)
        for positions, keys in (([2], [key(2)]), ([], []), ([0, 1], [key(0)])):
            r = self.read(store, "c1", h, positions, keys)
            assert not r.ok and r.reason is FailureReason.BAD_REQUEST, (positions, r.reason)
        assert not store.submit_write(9, "c9", fill(pool, 0, 1)) or wait_for(store, 9).ok
        with pytest.raises(ValueError):
            store.submit_read(3, "../escape", h, [0], [key(0)])
        big = fill(pool, 0, MAX_BLOCKS + 1)  # more blocks than this store may write
        assert store.submit_write(4, "big", big)
        r = wait_for(store, 4)
        assert not r.ok and r.reason is FailureReason.BAD_REQUEST

    def test_a_deferred_fill_runs_on_the_store_and_a_changed_source_writes_nothing(
            self, store: KernelStore[Any], pool: BufferPool) -> None:
        threads: list[int] = []

        def copy_in(first: int, ok: bool) -> Any:
            def run(wb: WriteBuffer) -> bool:
                threads.append(threading.get_ident())
                for i in range(len(wb.keys)):
                    with wb.block(i) as b:
                        b[:] = block(first + i)
                return ok
            return run

        def deferred(first: int, n: int, fill_fn: Any) -> WriteBuffer:
            return WriteBuffer([key(first + i) for i in range(n)], BLOCK, pool,
                               authenticated=store.authenticated, fill=fill_fn)

        # a fill that finds its source intact: written as if the caller had filled the buffer
        assert store.submit_write(1, "c1", deferred(0, 2, copy_in(0, True)))
        r = wait_for(store, 1)
        assert r.ok and r.header is not None and r.header.keys == (key(0), key(1))
        got = self.read(store, "c1", r.header, [0, 1])
        assert got.ok and [bytes(b) for b in got.blocks or ()] == [block(0), block(1)]
        got.release()
        assert threads and threading.get_ident() not in threads  # the store's thread copied
        # a fill whose source changed (False), or that raises: nothing written, the
        # chunk already stored under that id untouched; superseded is not damage
        old = self.write(store, pool, "c2", 5, 2, job=2)

        def boom(wb: WriteBuffer) -> bool:
            raise RuntimeError("the copy failed")

        for job, fn, reason in ((3, copy_in(0, False), FailureReason.SUPERSEDED), (4, boom, FailureReason.ERROR)):
            assert store.submit_write(job, "c2", deferred(0, 2, fn))
            r = wait_for(store, job)
            assert not r.ok and r.reason is reason and r.header is None and not r.reason.damaged
            got = self.read(store, "c2", old, [0, 1], [key(5), key(6)], job=100 + job)
            assert got.ok and [bytes(b) for b in got.blocks or ()] == [block(5), block(6)], got.reason
            got.release()

    def test_full_write_queue_refuses_and_the_caller_keeps_the_buffer(self, store: KernelStore[Any],
                                                                      pool: BufferPool) -> None:
        slow = Stalled(store.medium, writes=True)
        k = StoreKernel(slow, KernelSettings(NS, store.rank, BLOCK, MAX_BLOCKS, read_deadline_s=5.0, io_threads=1,
                                             max_queued_writes=2), buffers=pool)
        try:
            assert k.submit_write(1, "w1", fill(pool, 0, 1))
            assert slow.entered.wait(5)
            assert k.submit_write(2, "w2", fill(pool, 1, 1))  # queued behind the stalled one
            refused = fill(pool, 2, 1)
            assert not k.submit_write(3, "w3", refused)  # full: back-pressure, nothing queued
            with refused.block(0) as b:  # still the caller's: usable, then closed by it
                assert b.tobytes() == block(2)
            refused.close()
            slow.go.set()
            assert wait_for(k, 1).ok and wait_for(k, 2).ok
            assert k.submit_write(4, "w4", fill(pool, 3, 1))  # room again
            assert wait_for(k, 4).ok
        finally:
            slow.go.set()
            k.close(timeout_s=5)

    def test_a_medium_that_raises_ends_its_jobs_and_returns_their_buffers(self, store: KernelStore[Any],
                                                                          pool: BufferPool) -> None:
        """A batch put or read that raises (instead of answering per item) fails its jobs,
        with a result each: the write queue's room and the buffers come back, so writes
        are accepted again afterwards (more failures than ``max_queued_writes``) and the
        next write reuses a failed one's buffer."""
        h = self.write(store, pool, "c1", 0, 2)
        bad = Raising(store.medium, fail=3)
        k = StoreKernel(bad, KernelSettings(NS, store.rank, BLOCK, MAX_BLOCKS, read_deadline_s=5.0, io_threads=1,
                                            max_queued_writes=2), buffers=pool)
        try:
            for job in (1, 2, 3):
                assert k.submit_write(job, f"w{job}", fill(pool, job, 1))
                r = wait_for(k, job, timeout_s=5.0)
                assert not r.ok and r.reason is not None and r.header is None
            allocated = pool.allocated_bytes
            assert k.submit_write(4, "w4", fill(pool, 4, 1))  # accepted: the queue's room came back
            assert wait_for(k, 4, timeout_s=5.0).ok
            assert pool.allocated_bytes == allocated  # a failed write's buffer was reused
            for job in (5, 6, 7):
                k.submit_read(job, "c1", h, [1], [key(1)])
                r = wait_for(k, job, timeout_s=5.0)
                assert not r.ok and r.blocks is None
            allocated = pool.allocated_bytes
            k.submit_read(8, "c1", h, [1], [key(1)])
            r = wait_for(k, 8, timeout_s=5.0)
            assert r.ok and r.blocks is not None and r.blocks[0].tobytes() == block(1), r.reason
            r.release()
            assert pool.allocated_bytes == allocated  # a failed read's buffer was reused
        finally:
            k.close(timeout_s=5)

    def test_closed_store(self, tmp_path: Path, pool: BufferPool) -> None:
        s = self.make_store(tmp_path, buffers=pool, read_deadline_s=5.0, max_chunk_blocks=MAX_BLOCKS)
        h = self.write(s, pool, "c1", 0, 1)
        s.close(timeout_s=10)
        wb = fill(pool, 0, 1)
        assert not s.submit_write(2, "c2", wb)
        wb.close()
        s.submit_delete("c1")  # ignored
        r = self.read(s, "c1", h, [0])
        assert not r.ok and r.reason is FailureReason.CLOSED and not r.reason.damaged
        s.close()  # idempotent

    # ---- adversarial: a read must verify everything it uses ---------------------------------

    def test_damaged_block_is_a_checksum_miss_and_the_rest_serves(self, store: KernelStore[Any],
                                                                  pool: BufferPool) -> None:
        h = self.write(store, pool, "c1", 0, 4)
        data = bytearray(self.get_raw(store, "c1"))
        data[h.block_offset(2) + BLOCK // 2] ^= 0xFF
        self.put_raw(store, "c1", bytes(data))
        self.assert_miss(store, pool, "c1", h, [2], FailureReason.CHECKSUM)
        self.assert_miss(store, pool, "c1", None, [1, 2], FailureReason.CHECKSUM, [key(1), key(2)])
        r = self.read(store, "c1", h, [3, 1])
        assert r.ok and r.blocks is not None and [b.tobytes() for b in r.blocks] == [block(3), block(1)]
        r.release()
        assert FailureReason.CHECKSUM.damaged

    def test_key_mismatch_at_a_read_position(self, store: KernelStore[Any], pool: BufferPool) -> None:
        h = self.write(store, pool, "c1", 0, 3)
        self.write(store, pool, "c2", 20, 3, job=2)
        # Asking for keys the chunk does not hold there: never served.
        self.assert_miss(store, pool, "c1", h, [1], FailureReason.KEY_MISMATCH, [key(2)])
        self.assert_miss(store, pool, "c1", None, [0, 1], FailureReason.KEY_MISMATCH, [key(0), key(99)])
        # A well-formed chunk under a wrong index entry (another chunk's bytes under c1's id):
        self.put_raw(store, "c1", self.get_raw(store, "c2"))
        self.assert_miss(store, pool, "c1", None, [0], FailureReason.KEY_MISMATCH, [key(0)])
        r = self.read(store, "c1", h, [1])
        assert not r.ok and r.reason is not None and r.reason.damaged  # the stored CRCs are not c1's
        assert FailureReason.KEY_MISMATCH.damaged

    def test_stale_header_read_along_is_a_checksum_miss(self, store: KernelStore[Any], pool: BufferPool) -> None:
        h = self.write(store, pool, "c1", 0, 2)
        h2 = self.write(store, pool, "c2", 0, 2, job=2)
        assert h == h2
        # c1 rewritten with the same keys but other bytes: the caller's header is stale.
        wb = WriteBuffer([key(0), key(1)], BLOCK, pool)
        for i in range(2):
            with wb.block(i) as b:
                b[:] = bytes(BLOCK)
        assert store.submit_write(3, "c1", wb) and wait_for(store, 3).ok
        self.assert_miss(store, pool, "c1", h, [0], FailureReason.CHECKSUM)

    def test_truncated_chunk(self, store: KernelStore[Any], pool: BufferPool) -> None:
        h = self.write(store, pool, "c1", 0, 4)
        data = self.get_raw(store, "c1")
        self.put_raw(store, "c1", data[: h.block_offset(3) + BLOCK // 2])
        self.assert_miss(store, pool, "c1", h, [3], FailureReason.TRUNCATED)
        self.put_raw(store, "c1", data[:100])
        self.assert_miss(store, pool, "c1", None, [0], FailureReason.TRUNCATED)

    @pytest.mark.parametrize("forge", ["nblocks", "block_bytes", "header_bytes", "many_keys"])
    def test_forged_sizes_in_a_header_allocate_nothing(self, store: KernelStore[Any], pool: BufferPool,
                                                       forge: str) -> None:
        h = self.write(store, pool, "c1", 0, 2)
        data = bytearray(self.get_raw(store, "c1"))
        huge = (1 << 32) - 1
        expected = FailureReason.FORMAT
        if forge == "nblocks":
            data[28:32] = huge.to_bytes(4, "little")
            expected = FailureReason.TOO_LARGE
        elif forge == "block_bytes":
            data[32:40] = (1 << 44).to_bytes(8, "little")
        elif forge == "header_bytes":
            data[48:56] = (1 << 40).to_bytes(8, "little")
        else:  # a header that verifies (its own CRC is right) but claims more blocks than we write
            n = MAX_BLOCKS * 40
            fake = make_header(NS, [key(i) for i in range(n)], [0] * n, BLOCK)
            data = bytearray(fake.header_bytes + BLOCK)
            encode_header(fake, memoryview(data))
            expected = FailureReason.TOO_LARGE
        self.put_raw(store, "c1", bytes(data))
        self.assert_miss(store, pool, "c1", None, [0], expected, [key(0)])
        assert expected.damaged
        # The caller's own header is the truth for sizes: a forged one in the medium only
        # fails verification (the header read along does not match).
        r = self.read(store, "c1", h, [0])
        assert not r.ok and r.reason is not None and r.reason.damaged

    @pytest.mark.parametrize("version", [1, 2])
    def test_a_chunk_of_an_earlier_format_version_is_a_format_miss(self, store: KernelStore[Any], pool: BufferPool,
                                                                    version: int) -> None:
        """Versions 1 and 2 (earlier builds: no rank in the header) are never read: a miss
        (``format``, damaged), bounded like any other, never an exception."""
        h = self.write(store, pool, "c1", 0, 2)
        data = bytearray(self.get_raw(store, "c1"))
        data[8:12] = version.to_bytes(4, "little")
        self.put_raw(store, "c1", bytes(data))
        self.assert_miss(store, pool, "c1", None, [0], FailureReason.FORMAT)
        r = self.read(store, "c1", h, [0])  # the header read along is not the indexed one
        assert not r.ok and r.reason is not None and r.reason.damaged and r.blocks is None, r.reason

    def test_read_stalled_past_its_deadline(self, store: KernelStore[Any], pool: BufferPool) -> None:
        h = self.write(store, pool, "c1", 0, 2)
        slow = Stalled(store.medium)
        k = StoreKernel(slow, KernelSettings(NS, store.rank, BLOCK, MAX_BLOCKS, read_deadline_s=0.3, io_threads=1),
                        buffers=pool)
        try:
            t0 = time.monotonic()
            k.submit_read(7, "c1", h, [1], [key(1)])
            assert slow.entered.wait(5)
            r = wait_for(k, 7)
            assert 0.25 <= time.monotonic() - t0 < 3.0
            assert not r.ok and r.reason is FailureReason.DEADLINE and not r.reason.damaged
            allocated = pool.allocated_bytes
            slow.go.set()  # the late answer: dropped, its buffer back in the pool
            time.sleep(0.3)
            assert [x.job_id for x in k.poll()] == []
            k.submit_read(8, "c1", h, [1], [key(1)])
            r = wait_for(k, 8)
            assert r.ok, r.reason
            r.release()
            assert pool.allocated_bytes == allocated  # the late read's buffer was reused
        finally:
            slow.go.set()
            k.close(timeout_s=5)

    # ---- authenticated chunks: a MAC only key holders can make, verified before use ----------

    @pytest.fixture
    def signed(self, tmp_path: Path, pool: BufferPool) -> Iterator[KernelStore[Any]]:
        """A store that signs and verifies with :data:`KEY`."""
        s = self.make_store(tmp_path, buffers=pool, read_deadline_s=5.0, max_chunk_blocks=MAX_BLOCKS,
                            auth=ChunkAuth(KEY))
        yield s
        s.close(timeout_s=10.0)

    def write_signed(self, store: KernelStore[Any], pool: BufferPool, chunk_id: str, first: int = 0, n: int = 4,
                     job: int = 1) -> ChunkHeader:
        assert store.authenticated
        assert store.submit_write(job, chunk_id, fill(pool, first, n, authenticated=True))
        r = wait_for(store, job)
        assert r.ok and r.header is not None, r.reason
        return r.header

    def refused(self, store: KernelStore[Any], pool: BufferPool, chunk_id: str, header: ChunkHeader | None,
                positions: list[int], reason: FailureReason, first: int = 0) -> None:
        """The read is a miss with ``reason``, counted in the store's failures."""
        before = store.op_stats().failures.get(reason, 0)
        self.assert_miss(store, pool, chunk_id, header, positions, reason, [key(first + p) for p in positions])
        assert store.op_stats().failures.get(reason, 0) == before + 1

    def test_auth_round_trip(self, signed: KernelStore[Any], pool: BufferPool) -> None:
        h = self.write_signed(signed, pool, "c1", 0, 5)
        assert h.authenticated and h.key_id == ChunkAuth(KEY).key_id and len(h.mac) == 32
        for positions, known in (([0, 1, 2, 3, 4], True), ([3, 1], True), ([4], False), ([0, 2], False)):
            r = self.read(signed, "c1", h if known else None, positions)
            assert r.ok and r.blocks is not None, (positions, r.reason)
            assert [b.tobytes() for b in r.blocks] == [block(p) for p in positions]
            assert r.header == h
            r.release()
        raw = self.get_raw(signed, "c1")
        assert decode_header(raw, NS) == h  # the stored header is the signed one, MAC included
        assert KEY not in raw and KEY.hex().encode() not in raw and KEY.hex() not in repr(signed.auth)

    @pytest.mark.parametrize("known", [True, False], ids=["header", "no-header"])
    def test_forged_block_with_a_valid_crc_is_refused(self, signed: KernelStore[Any], pool: BufferPool,
                                                      known: bool) -> None:
        """Right keys, a valid header (MAC and all), a block of other bytes whose CRC32 is
        the original's: only the block's tag tells."""
        h = self.write_signed(signed, pool, "c1", 0, 4)
        data = bytearray(self.get_raw(signed, "c1"))
        off = h.block_offset(2)
        forged = crc_forged(bytes(BLOCK), h.crcs[2])
        data[off : off + BLOCK] = forged
        self.put_raw(signed, "c1", bytes(data))
        self.refused(signed, pool, "c1", h if known else None, [2], FailureReason.AUTH_FAILED)
        self.refused(signed, pool, "c1", h if known else None, [1, 2, 3], FailureReason.AUTH_FAILED)
        r = self.read(signed, "c1", h, [3, 1])  # the untouched blocks still serve
        assert r.ok and r.blocks is not None and [b.tobytes() for b in r.blocks] == [block(3), block(1)]
        r.release()
        assert FailureReason.AUTH_FAILED.damaged

    @pytest.mark.parametrize("forge", ["crcs", "keys", "own_key"])
    def test_forged_header_is_refused(self, tmp_path: Path, signed: KernelStore[Any], pool: BufferPool,
                                      forge: str) -> None:
        """A writer without the key rewrites a signed chunk: new bytes and their CRCs, or
        other keys, or everything signed with its own key under our key id; every CRC is
        valid, the header MAC is not."""
        h = self.write_signed(signed, pool, "c1", 0, 3)
        data = bytearray(self.get_raw(signed, "c1"))
        if forge == "crcs":
            for p in range(3):
                data[h.block_offset(p) : h.block_offset(p) + BLOCK] = bytes([p]) * BLOCK
            fake = dataclasses.replace(h, crcs=tuple(block_crc(bytes([p]) * BLOCK) for p in range(3)))
        elif forge == "keys":
            fake = dataclasses.replace(h, keys=(key(0), key(7), key(2)))
        else:
            other = self.make_store(tmp_path, buffers=pool, read_deadline_s=5.0, max_chunk_blocks=MAX_BLOCKS,
                                    auth=ChunkAuth(OTHER_KEY))
            try:
                oh = self.write_signed(other, pool, "c1x", 0, 3, job=5)
                data = bytearray(self.get_raw(other, "c1x"))
            finally:
                other.close(timeout_s=10.0)
            fake = dataclasses.replace(oh, key_id=h.key_id)
        encode_header(fake, memoryview(data))  # its CRC recomputed: only the MAC can tell
        self.put_raw(signed, "c1", bytes(data))
        positions = [1] if forge == "keys" else [0, 1]
        first = 0 if forge != "keys" else 6
        self.refused(signed, pool, "c1", None, positions, FailureReason.AUTH_FAILED, first=first)
        self.refused(signed, pool, "c1", fake, positions, FailureReason.AUTH_FAILED, first=first)

    def test_signed_chunk_replayed_under_another_id_is_refused(self, signed: KernelStore[Any], pool: BufferPool) -> None:
        """The same blocks, validly signed, but for chunk id c2: the MAC binds the id."""
        self.write_signed(signed, pool, "c1", 0, 3)
        self.write_signed(signed, pool, "c2", 0, 3, job=2)
        self.put_raw(signed, "c1", self.get_raw(signed, "c2"))
        self.refused(signed, pool, "c1", None, [0, 2], FailureReason.AUTH_FAILED)

    def test_unsigned_chunk_is_refused_by_a_store_with_a_key(self, store: KernelStore[Any], signed: KernelStore[Any],
                                                             pool: BufferPool) -> None:
        h = self.write(store, pool, "plain", 0, 3)
        self.put_raw(signed, "plain", self.get_raw(store, "plain"))
        self.refused(signed, pool, "plain", None, [1], FailureReason.UNAUTHENTICATED)
        self.refused(signed, pool, "plain", h, [0, 1], FailureReason.UNAUTHENTICATED)
        assert not FailureReason.UNAUTHENTICATED.damaged  # kept: it may be another fleet's

    def test_signed_chunk_is_refused_by_a_store_without_the_key(self, store: KernelStore[Any], signed: KernelStore[Any],
                                                                pool: BufferPool) -> None:
        h = self.write_signed(signed, pool, "c1", 0, 3)
        self.put_raw(store, "c1", self.get_raw(signed, "c1"))
        self.refused(store, pool, "c1", None, [1], FailureReason.UNAUTHENTICATED)
        self.refused(store, pool, "c1", h, [0], FailureReason.UNAUTHENTICATED)

    def test_signed_chunk_is_refused_under_another_key(self, tmp_path: Path, signed: KernelStore[Any],
                                                       pool: BufferPool) -> None:
        h = self.write_signed(signed, pool, "c1", 0, 3)
        other = self.make_store(tmp_path, buffers=pool, read_deadline_s=5.0, max_chunk_blocks=MAX_BLOCKS,
                                auth=ChunkAuth(OTHER_KEY))
        try:
            self.put_raw(other, "c1", self.get_raw(signed, "c1"))
            self.refused(other, pool, "c1", None, [2], FailureReason.UNAUTHENTICATED)
            self.refused(other, pool, "c1", h, [0, 2], FailureReason.UNAUTHENTICATED)
        finally:
            other.close(timeout_s=10.0)


    # ---- the store rank: every TP/PP rank stores its shard under the same chunk id -----------
    # (keys and namespace too); only the medium's path (``r<rank>``) tells them apart, and
    # it is not signed. A rank's chunk copied over another rank's is never served there.

    def shard(self, pool: BufferPool, rank: int, n: int, authenticated: bool) -> WriteBuffer:
        """Rank ``rank``'s shard of a chunk of keys 0..n-1 (other bytes on each rank)."""
        wb = WriteBuffer([key(i) for i in range(n)], BLOCK, pool, authenticated=authenticated)
        for i in range(n):
            with wb.block(i) as b:
                b[:] = block(100 * rank + i)
        return wb

    @pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
    def test_chunk_copied_over_another_ranks_is_refused(self, tmp_path: Path, pool: BufferPool,
                                                         signed: bool) -> None:
        """With a key, the header's MAC covers the rank (and the block tags too): whoever can
        write the medium cannot move a shard to another rank. Without one, the rank stored in
        the header is checked all the same: a copy made by mistake or a misconfiguration is a
        miss (a forger without a key can write anything there anyway)."""
        auth = ChunkAuth(KEY) if signed else None
        kw: dict[str, Any] = dict(buffers=pool, read_deadline_s=5.0, max_chunk_blocks=MAX_BLOCKS, auth=auth)
        r0 = self.make_store(tmp_path, rank=0, **kw)
        r1 = self.make_store(tmp_path, rank=1, **kw)
        try:
            headers = []
            for job, st in enumerate((r0, r1), start=1):
                assert st.submit_write(job, "c1", self.shard(pool, st is r1, 4, signed))
                res = wait_for(st, job)
                assert res.ok and res.header is not None, res.reason
                assert res.header.authenticated == signed
                headers.append(res.header)
            h1 = headers[1]
            r = self.read(r1, "c1", None, [2])  # before: rank 1 serves its own shard
            assert r.ok and r.blocks is not None and r.blocks[0].tobytes() == block(102), r.reason
            r.release()
            self.put_raw(r1, "c1", self.get_raw(r0, "c1"))  # rank 0's object over rank 1's
            # A read that fetches the header (S3 and Mooncake workers, a probe): the rank in it
            # is rank 0's, and with a key its MAC vouches for exactly that.
            self.refused(r1, pool, "c1", None, [0, 2], FailureReason.KEY_MISMATCH)
            self.refused(r1, pool, "c1", None, [3], FailureReason.KEY_MISMATCH)
            # With rank 1's own header (indexed before the copy): the bytes are not its blocks.
            r = self.read(r1, "c1", h1, [1, 3])
            assert not r.ok and r.reason is not None and r.reason.damaged and r.blocks is None, r.reason
            r = self.read(r1, "c1", h1, [0])  # the stored header read along is rank 0's
            assert not r.ok and r.reason is not None and r.reason.damaged, r.reason
            if hasattr(r1, "scan"):  # never indexed by a scan either
                res = r1.scan()
                assert "c1" not in res.found and res.problems.get(FailureReason.KEY_MISMATCH) == 1, res.problems
            r = self.read(r0, "c1", headers[0], [2])  # rank 0's own place still serves
            assert r.ok and r.blocks is not None and r.blocks[0].tobytes() == block(2), r.reason
            r.release()
            assert r0.rank != r1.rank and [h.rank for h in headers] == [r0.rank, r1.rank]
        finally:
            r0.close(timeout_s=10.0)
            r1.close(timeout_s=10.0)


class FileMediumContract:
    """Cases of media made of files in a directory (NVMe). The binding gives ``path_of``
    (the chunk's file) and ``scan`` (the store's start-up scan)."""

    def path_of(self, store: KernelStore[Any], chunk_id: str) -> Path:
        raise NotImplementedError

    def test_sparse_file_is_truncated_without_reading_its_holes(self, store: KernelStore[Any], pool: BufferPool) -> None:
        h = self.write(store, pool, "c1", 0, 4)  # type: ignore[attr-defined]
        p = self.path_of(store, "c1")
        head = p.read_bytes()[: h.header_bytes]
        p.unlink()
        with open(p, "wb") as f:  # the header, then a hole to the full size
            f.write(head)
            f.truncate(h.total_bytes)
        if os.lseek(os.open(p, os.O_RDONLY), 0, os.SEEK_HOLE) >= h.total_bytes:
            pytest.skip("this file system does not report holes")
        self.assert_miss(store, pool, "c1", h, [2], FailureReason.TRUNCATED)  # type: ignore[attr-defined]
        found = store.scan().found  # type: ignore[attr-defined]
        assert "c1" not in found

    def test_fifo_in_the_directory_never_hangs(self, store: KernelStore[Any], pool: BufferPool) -> None:
        self.write(store, pool, "ok", 0, 1)  # type: ignore[attr-defined]
        fifo = self.path_of(store, "fifo")
        os.mkfifo(fifo)
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.append(store.scan(cleanup=True)), daemon=True)  # type: ignore[attr-defined]
        t.start()
        t.join(5)
        assert not t.is_alive(), "the scan hangs on a FIFO"
        assert "ok" in out[0].found and "fifo" not in out[0].found
        assert out[0].problems.get(FailureReason.NOT_REGULAR) == 1
        assert fifo.exists()  # not ours to delete
        self.assert_miss(store, pool, "fifo", None, [0], FailureReason.NOT_REGULAR)  # type: ignore[attr-defined]
        assert FailureReason.NOT_REGULAR.damaged

    def test_forged_header_in_the_directory_is_dropped_at_scan(self, store: KernelStore[Any], pool: BufferPool) -> None:
        self.write(store, pool, "ok", 0, 1)  # type: ignore[attr-defined]
        n = MAX_BLOCKS * 40
        fake = make_header(NS, [key(i) for i in range(n)], [0] * n, BLOCK)
        data = bytearray(fake.header_bytes)
        encode_header(fake, memoryview(data))
        p = self.path_of(store, "forged")
        with open(p, "wb") as f:  # a verifying header claiming 320 blocks, the rest a hole
            f.write(data)
            f.truncate(fake.total_bytes)
        tracemalloc.start()
        try:
            res = store.scan(cleanup=True)  # type: ignore[attr-defined]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert set(res.found) == {"ok"} and res.problems.get(FailureReason.TOO_LARGE) == 1
        assert peak <= SMALL
        assert not p.exists()  # the owner's scan deletes what fails to verify
