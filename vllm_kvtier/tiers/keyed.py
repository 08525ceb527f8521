"""Keyed adapters that make the real media meet :class:`~vllm_kvtier.tiers.base.BlockTier`.

:class:`CPUTier` is a :class:`~vllm_kvtier.index.slot_index.SlotIndex` over a one-plane
:class:`~vllm_kvtier.tiers.cpu.CPUPool`. :class:`NVMeTier`, :class:`S3Tier` and
:class:`MooncakeTier` are a submit/poll chunk store (:class:`~vllm_kvtier.tiers.nvme.NVMeStore`,
:class:`~vllm_kvtier.tiers.s3.S3Store`, :class:`~vllm_kvtier.tiers.mooncake.MooncakeStore`)
plus an in-memory index of key -> (chunk, block) (:class:`ChunkStoreTier`); the NVMe and S3
ones rebuild it from the chunk headers at construction, so a tier opened on a directory or
bucket prefix finds what an earlier one stored there. All verify a CRC32 on every ``get``.
``S3Tier`` needs boto3 and ``MooncakeTier`` the mooncake package only when constructed.

They serve tools, tests and the tier contract; the connector drives the same media
asynchronously. Same threading and failure rules as BlockTier: one caller thread; a
failure is False/None plus a counter and a log line.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

import numpy as np

from vllm_kvtier.index.keys import BlockKey
from vllm_kvtier.index.slot_index import SlotIndex
from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.base import count_failure, refusal
from vllm_kvtier.tiers.chunkfile import DAMAGED_CHUNK_READS, ChunkHeader, align_up, header_bytes_for
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.tiers.mooncake import MooncakeConfig, MooncakeStore
from vllm_kvtier.tiers.nvme import IOResult, NVMeStore, WriteBuffer, file_id_for, scan_dir
from vllm_kvtier.tiers.s3 import S3Config, S3Store

logger = logging.getLogger(__name__)


class CPUTier:
    """Blocks in slots of a preallocated host-memory pool. See BlockTier for the contract."""

    name = "cpu"

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        if block_bytes <= 0 or capacity_bytes < 0:
            raise ValueError(
                f"need block_bytes > 0 and capacity_bytes >= 0, got {block_bytes}, {capacity_bytes}"
            )
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self.counters = Counters()
        num_slots = capacity_bytes // block_bytes
        self.index = SlotIndex(num_slots)
        #: The medium: for fault drills, ``pool.planes[0][slot_of(key)]`` is the block.
        self.pool = CPUPool(num_slots, (block_bytes,), pin=False, prefault=False)
        self._crc = [0] * num_slots
        self._closed = False

    def slot_of(self, key: bytes) -> int | None:
        """The pool slot holding ``key`` (for fault drills and tools), or None."""
        return self.index.slot(BlockKey(key))

    def put(self, key: bytes, data: bytes | memoryview) -> bool:
        why = "tier is closed" if self._closed else refusal(key, data, self.block_bytes)
        if why is None and key in self.index:
            self.index.touch(BlockKey(key))
            return True
        alloc = None if why is not None else self.index.allocate(BlockKey(key))
        if alloc is None:
            count_failure(self, "store_failures", key, why or "no slot free or evictable", logger)
            return False
        if alloc.evicted is not None:
            self.counters.add("evictions", self.name)
        self.pool.planes[0][alloc.slot].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        self._crc[alloc.slot] = zlib.crc32(data)
        return True

    def get(self, key: bytes) -> bytes | None:
        slot = None if self._closed else self.slot_of(key)
        if slot is None:
            return None
        if self.pool.checksum(slot) != self._crc[slot]:
            self.index.remove(BlockKey(key))
            count_failure(self, "load_failures", key, f"checksum mismatch in slot {slot}", logger)
            return None
        self.index.touch(BlockKey(key))
        return self.pool.planes[0][slot].numpy().tobytes()

    def contains(self, key: bytes) -> bool:
        return key in self.index

    def delete(self, key: bytes) -> bool:
        return self.index.remove(BlockKey(key))

    def usage_bytes(self) -> int:
        return len(self.index) * self.block_bytes

    def close(self) -> None:
        self._closed = True
        for key, _ in self.index.items():
            self.index.remove(key)


class ChunkStoreTier:
    """Blocks in one-block chunk objects of a submit/poll store, least recently used
    chunks evicted. The store is an :class:`~vllm_kvtier.tiers.nvme.NVMeStore` or an
    :class:`~vllm_kvtier.tiers.s3.S3Store` (same submit/poll shape); subclasses build it
    and rebuild the index from what it holds.

    Writes and reads go through the store's I/O threads; each call submits one job and
    polls until it completes or ``timeout_s`` passes (then it is a failure, and a late
    result is cleaned up on a later call). See BlockTier for the contract.
    """

    name = "chunks"
    store: Any

    def __init__(self, store: Any, capacity_bytes: int, block_bytes: int, timeout_s: float) -> None:
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self.timeout_s = timeout_s
        self.counters = Counters()
        self.store = store
        self._files: OrderedDict[str, ChunkHeader] = OrderedDict()  # least recently used first
        self._where: dict[bytes, tuple[str, int]] = {}  # key -> (file_id, position in file)
        self._usage = 0
        self._jobs = itertools.count()
        self._abandoned: set[int] = set()
        self._closed = False

    @staticmethod
    def file_bytes(block_bytes: int) -> int:
        """Bytes one block takes on the medium: a one-entry header plus the block padded to
        its stride."""
        return header_bytes_for(1) + align_up(block_bytes)

    def _drops_on(self, reason: str) -> bool:
        """Whether a failed read with this reason drops (and deletes) the chunk."""
        return True

    def put(self, key: bytes, data: bytes | memoryview) -> bool:
        why = "tier is closed" if self._closed else refusal(key, data, self.block_bytes)
        if why is None and key in self._where:
            self._files.move_to_end(self._where[key][0])
            return True
        need = self.file_bytes(self.block_bytes)
        if why is None and need > self.capacity_bytes:
            why = f"capacity {self.capacity_bytes} B holds no file of {need} B"
        if why is None:
            while self._usage + need > self.capacity_bytes:
                self._evict_oldest()
            why = self._write(key, data)
        if why is not None:
            count_failure(self, "store_failures", key, why, logger)
            return False
        return True

    def _write(self, key: bytes, data: bytes | memoryview) -> str | None:
        """Write one chunk file; None on success, else why not."""
        wb = WriteBuffer([key], self.block_bytes)
        with wb.block(0) as dst:
            dst[:] = memoryview(data).cast("B")
        file_id, job = file_id_for([key]), next(self._jobs)
        if not self.store.submit_write(job, file_id, wb):
            wb.buf.close()
            return "write queue full"
        res = self._wait(job)
        if res is None:
            return f"write timed out after {self.timeout_s} s"
        if not res.ok or res.header is None:
            return f"write failed ({res.reason})"
        self._add_file(file_id, res.header)
        return None

    def get(self, key: bytes) -> bytes | None:
        loc = None if self._closed else self._where.get(key)
        if loc is None:
            return None
        file_id, pos = loc
        job = next(self._jobs)
        self.store.submit_read(job, file_id, self._files[file_id], [pos])
        res = self._wait(job)
        if res is None:  # the file may be fine; keep it, but this get is a miss
            count_failure(self, "load_failures", key, f"read timed out after {self.timeout_s} s", logger)
            return None
        if not res.ok or not res.blocks:
            if self._drops_on(res.reason):
                self._drop_file(file_id)
            count_failure(self, "load_failures", key, f"read of {file_id} failed ({res.reason})", logger)
            return None
        data = res.blocks[0].tobytes()
        res.release()
        self._files.move_to_end(file_id)
        return data

    def contains(self, key: bytes) -> bool:
        return key in self._where

    def delete(self, key: bytes) -> bool:
        loc = self._where.get(key)
        if loc is None or self._closed:
            return False
        self._drop_file(loc[0])
        return True

    def usage_bytes(self) -> int:
        return self._usage

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.store.close(self.timeout_s)
            self._collect(self.store.poll())

    # ---- index and job plumbing ---------------------------------------------------------

    def _add_file(self, file_id: str, h: ChunkHeader) -> None:
        for k in h.keys:
            old = self._where.get(k)
            if old is not None:  # a newer copy of the key (rebuild): the older file goes
                self._drop_file(old[0])
        self._files[file_id] = h
        self._usage += h.total_bytes
        for pos, k in enumerate(h.keys):
            self._where[k] = (file_id, pos)

    def _drop_file(self, file_id: str) -> None:
        h = self._files.pop(file_id, None)
        if h is None:
            return
        self._usage -= h.total_bytes
        for k in h.keys:
            if self._where.get(k, (None,))[0] == file_id:
                del self._where[k]
        self.store.submit_delete(file_id)

    def _evict_oldest(self) -> None:
        self._drop_file(next(iter(self._files)))
        self.counters.add("evictions", self.name)

    def _wait(self, job: int) -> IOResult | None:
        """Poll the store until ``job`` completes; None (and the job abandoned) on timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            mine = self._collect(self.store.poll(), job)
            if mine is not None:
                return mine
            if time.monotonic() > deadline:
                self._abandoned.add(job)
                return None
            time.sleep(0.0005)  # a chunk I/O takes ~ms; spinning would steal a core from it

    def _collect(self, results: list[IOResult], job: int = -1) -> IOResult | None:
        """Return ``job``'s result; clean up late results of abandoned jobs (a late write's
        file is not indexed, so delete it; a late read's buffers are freed)."""
        mine = None
        for r in results:
            if r.job_id == job:
                mine = r
            elif r.job_id in self._abandoned:
                self._abandoned.discard(r.job_id)
                r.release()
                if r.kind == "write" and r.ok and not self._closed:
                    self.store.submit_delete(r.file_id)
        return mine


class NVMeTier(ChunkStoreTier):
    """Blocks in chunk files, one block per file, moved by the ``io_engine`` of
    :mod:`~vllm_kvtier.tiers.file_io` (``posix``, ``nixl``, ``nixl-gds``). See ChunkStoreTier
    and BlockTier."""

    name = "nvme"
    store: NVMeStore

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        block_bytes: int,
        namespace: str = "contract0000000",
        rank: int = 0,
        *,
        timeout_s: float = 10.0,
        direct_io: Literal["auto", "on", "off"] = "auto",
        io_engine: str = "posix",
    ) -> None:
        store = NVMeStore(path, namespace, rank, block_bytes, direct_io=direct_io, io_engine=io_engine)
        super().__init__(store, capacity_bytes, block_bytes, timeout_s)
        self._rebuild()

    def _rebuild(self) -> None:
        found, problems = scan_dir(self.store.dir, self.store.namespace, cleanup=True)
        if problems:
            logger.warning("kvtier nvme tier: %s: dropped at start: %s", self.store.dir, problems)
        # Oldest written first: recency across a restart is approximate (reads do not
        # update mtime, and the filesystem clock is coarse).
        for file_id in sorted(found, key=self._mtime_ns):
            h = found[file_id]
            if h.block_bytes != self.block_bytes:
                logger.warning("kvtier nvme tier: ignoring %s: blocks of %d B", file_id, h.block_bytes)
                continue
            self._add_file(file_id, h)
        while self._usage > self.capacity_bytes:
            self._evict_oldest()

    def _mtime_ns(self, file_id: str) -> int:
        try:
            return os.stat(self.store.path(file_id)).st_mtime_ns
        except OSError:  # gone since the scan: sorts first, and a read of it will miss
            return 0

    def location(self, key: bytes) -> tuple[Path, int] | None:
        """The file holding ``key`` and the byte offset of its block (for fault drills and
        tools), or None."""
        loc = self._where.get(key)
        if loc is None:
            return None
        file_id, pos = loc
        return self.store.path(file_id), self._files[file_id].block_offset(pos)


class S3Tier(ChunkStoreTier):
    """Blocks in chunk objects of an S3 bucket, one block per object (the connector packs
    many; this adapter serves the contract suite and tools), moved by ``config.io_engine``
    (boto3 or NIXL's OBJ backend). The index is rebuilt with
    :meth:`S3Store.scan` at construction, oldest object first, and the tier owns its
    (namespace, rank) prefix: evicting deletes objects.

    A read that fails because the endpoint is unhealthy (timeout, throttling, breaker
    open, deadline) is a miss that keeps the entry; one whose object is damaged or gone
    (checksum, truncated, missing) drops it.
    """

    name = "s3"
    store: S3Store

    def __init__(
        self,
        config: S3Config,
        capacity_bytes: int,
        block_bytes: int,
        namespace: str = "contract0000000",
        rank: int = 0,
        *,
        timeout_s: float | None = None,
    ) -> None:
        if timeout_s is None:  # a write may overrun its deadline by one attempt's timeouts
            timeout_s = config.deadline_s + config.connect_timeout_s + config.read_timeout_s + 1.0
        super().__init__(
            S3Store(config, namespace, rank, block_bytes), capacity_bytes, block_bytes, timeout_s
        )
        found = self.store.scan(cleanup=True)
        if self.store.last_scan.problems:
            logger.warning("kvtier s3 tier: dropped at start: %s", self.store.last_scan.problems)
        for file_id, h in found.items():
            self._add_file(file_id, h)
        while self._usage > self.capacity_bytes:
            self._evict_oldest()

    def _drops_on(self, reason: str) -> bool:
        return reason in DAMAGED_CHUNK_READS

    def location(self, key: bytes) -> tuple[str, int] | None:
        """The object key holding ``key`` and the byte offset of its block (for fault
        drills and tools), or None."""
        loc = self._where.get(key)
        if loc is None:
            return None
        file_id, pos = loc
        return self.store.key(file_id), self._files[file_id].block_offset(pos)


class MooncakeTier(ChunkStoreTier):
    """Blocks in chunk objects of a Mooncake Store pool, one block per object (the connector
    packs many; this adapter serves the contract suite and tools). The tier keeps its own
    least-recently-used bound of ``capacity_bytes`` on what it wrote; Mooncake may evict
    sooner when the pool fills (leases and eviction are Mooncake's), and such a block then
    reads as a counted miss. The index starts empty: Mooncake cannot list keys, so objects
    an earlier process wrote are not found (they stay until Mooncake evicts them).

    A read that fails because the pool is unhealthy (master gone, transfer failure,
    breaker open, deadline) is a miss that keeps the entry; one whose object is damaged or
    gone (checksum, format, missing...) drops it.
    """

    name = "mooncake"
    store: MooncakeStore

    def __init__(
        self,
        config: MooncakeConfig,
        capacity_bytes: int,
        block_bytes: int,
        namespace: str = "contract0000000",
        rank: int = 0,
        *,
        timeout_s: float | None = None,
    ) -> None:
        if timeout_s is None:  # a read fails by its deadline; a write is bounded by the client's RPC timeouts
            timeout_s = config.deadline_s + 1.0
        super().__init__(MooncakeStore(config, namespace, rank, block_bytes), capacity_bytes, block_bytes, timeout_s)

    def _drops_on(self, reason: str) -> bool:
        return reason in DAMAGED_CHUNK_READS or reason == "bad_request"

    def location(self, key: bytes) -> tuple[str, int] | None:
        """The Mooncake key holding ``key`` and the byte offset of its block in the value
        (for fault drills and tools), or None."""
        loc = self._where.get(key)
        if loc is None:
            return None
        file_id, pos = loc
        return self.store.key(file_id), self._files[file_id].block_offset(pos)
