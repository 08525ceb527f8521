"""Worker-side NVMe tier: moves blocks between CPU pool slots and chunk files.

Who calls it: :class:`~vllm_kvtier.connector.worker.WorkerHalf`, from the worker's main
thread. Disk I/O runs on the :class:`~vllm_kvtier.tiers.nvme.NVMeStore` threads; this
class only copies slot bytes into write buffers (fast memory copies, so the slot can be
reused by this step's saves) and read buffers back into slots, and reports outcomes to the
scheduler (``KVTierWorkerMeta``). Nothing here raises into vLLM: failures are results.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from vllm_kvtier.config import NVMeTierConfig
from vllm_kvtier.connector.metadata import KVTierWorkerMeta, NVMeRead, NVMeWriteJob
from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.chunkfile import ChunkHeader
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.tiers.nvme import IOResult, NVMeStore, WriteBuffer, file_id_for, scan_dir

logger = logging.getLogger(__name__)

TIER = "nvme"


class NVMeWorker:
    def __init__(self, cfg: NVMeTierConfig, *, namespace: str, rank: int, block_bytes: int,
                 counters: Counters) -> None:
        self.cfg = cfg
        self.counters = counters
        self.headers: dict[str, ChunkHeader] = {}
        self._ids = itertools.count(1)
        self._reads: dict[int, NVMeRead] = {}
        self._meta = KVTierWorkerMeta()
        #: slot -> admitted for a shutdown flush (write-back), set by the scheduler.
        self.dirty: set[int] = set()
        self.store: NVMeStore | None = None
        try:
            self.store = NVMeStore(cfg.path, namespace, rank, block_bytes, direct_io=cfg.direct_io,
                                   io_threads=cfg.io_threads, max_queued_writes=cfg.max_queued_writes)
        except OSError as e:
            # Serving goes on without the tier: every NVMe write and read is a miss.
            logger.error("kvtier nvme: tier disabled, cannot use %s: %s", cfg.path, e)
            self.counters.add("store_failures", TIER)
            return
        headers, problems = scan_dir(self.store.dir, namespace, cleanup=True)
        self.headers = headers
        for reason, n in problems.items():
            logger.warning("kvtier nvme: %d file(s) dropped at start-up: %s", n, reason)
            self.counters.add("load_failures", TIER, n)

    # ---- writes -------------------------------------------------------------------

    def write(self, jobs: list[NVMeWriteJob], pool: CPUPool, before_read: Callable[[int], None],
              holds: Callable[[int, bytes], bool]) -> None:
        """Copy each job's slots out now, then queue the chunk write. A job whose slots do
        not all hold their keys (a save into them failed) is not written."""
        for job in jobs:
            if not all(holds(s, k) for s, k in zip(job.slots, job.keys, strict=True)):
                self._meta.failed.add(job.file_id)
                continue
            for s in job.slots:
                before_read(s)  # a save into this slot may still be in flight (CUDA)
                self.dirty.discard(s)
            if self.store is None:
                self._meta.failed.add(job.file_id)
                continue
            wb = self._buffer(job, pool)
            if not self.store.submit_write(next(self._ids), job.file_id, wb):
                wb.buf.close()
                self.counters.add("store_skipped", TIER, len(job.keys))
                self._meta.failed.add(job.file_id)

    def delete(self, file_ids: list[str]) -> None:
        for fid in file_ids:
            self.headers.pop(fid, None)
            if self.store is not None:
                self.store.submit_delete(fid)

    # ---- reads --------------------------------------------------------------------

    def start_read(self, read: NVMeRead) -> int | None:
        """Queue a read; its id, or None if the file is unknown here (a miss)."""
        header = self.headers.get(read.file_id)
        if header is None or self.store is None:
            self._meta.bad.add(read.file_id)
            return None
        rid = next(self._ids)
        self._reads[rid] = read
        self.store.submit_read(rid, read.file_id, header, list(read.positions))
        return rid

    def poll(self, pool: CPUPool, on_read: Callable[[int, NVMeRead, bool], None],
             before_write: Callable[[int], None]) -> None:
        """Handle finished I/O: fill slots from completed reads and call ``on_read``."""
        for res in self.store.poll() if self.store is not None else ():
            if res.kind == "write":
                self._on_write(res)
            elif res.kind == "read":
                read = self._reads.pop(res.job_id, None)
                if read is None:
                    res.release()
                    continue
                ok = res.ok
                if ok:
                    assert res.blocks is not None
                    for slot, data in zip(read.slots, res.blocks, strict=True):
                        before_write(slot)  # a device copy may still use the slot (CUDA)
                        pool.copy_slot_in(slot, data)
                    self.counters.add("blocks_loaded", TIER, len(read.slots))
                    self.counters.add("bytes_loaded", TIER, res.nbytes)
                    self.counters.add("load_seconds", TIER, res.seconds)
                else:
                    logger.warning("kvtier nvme: read of %s failed (%s); recomputing %d blocks",
                                   read.file_id, res.reason, len(read.slots))
                    self.counters.add("load_failures", TIER, len(read.slots))
                    self._meta.bad.add(read.file_id)
                    self.headers.pop(read.file_id, None)
                res.release()
                on_read(res.job_id, read, ok)

    def _on_write(self, res: IOResult) -> None:
        if res.ok:
            assert res.header is not None
            self.headers[res.file_id] = res.header
            self._meta.written[res.file_id] = self._meta.written.get(res.file_id, 0) + 1
            self.counters.add("blocks_stored", TIER, res.header.nblocks)
            self.counters.add("bytes_stored", TIER, res.nbytes)
            self.counters.add("store_seconds", TIER, res.seconds)
        else:
            self.counters.add("store_failures", TIER)
            self._meta.failed.add(res.file_id)

    def take_meta(self) -> KVTierWorkerMeta | None:
        meta, self._meta = self._meta, KVTierWorkerMeta()
        return None if meta.is_empty() else meta

    def wait_for_reads(self, timeout_s: float) -> None:
        """Idle steps only: give the I/O threads the GIL until a read may have finished."""
        if self._reads and self.store is not None:
            self.store.wait(timeout_s)

    def pending_reads(self) -> int:
        return len(self._reads)

    # ---- shutdown -----------------------------------------------------------------

    def close(self, pool: CPUPool | None, slot_key: list[bytes | None]) -> None:
        """Flush admitted write-back blocks still only in DRAM (bounded by
        ``flush_on_shutdown_s``), then finish queued I/O and stop."""
        if self.store is None:
            return
        deadline = time.monotonic() + self.cfg.flush_on_shutdown_s
        if pool is not None and self.cfg.mode == "write-back" and self.dirty:
            items = [(s, slot_key[s]) for s in sorted(self.dirty) if slot_key[s] is not None]
            n = self.cfg.chunk_blocks
            written = 0
            for i in range(0, len(items), n):
                if time.monotonic() > deadline:
                    break
                part = items[i : i + n]
                keys = [k for _, k in part if k is not None]
                job = NVMeWriteJob(file_id_for(keys), tuple(s for s, _ in part), tuple(keys))
                wb = self._buffer(job, pool)
                while not self.store.submit_write(next(self._ids), job.file_id, wb):
                    if time.monotonic() > deadline:
                        wb.buf.close()
                        break
                    time.sleep(0.01)
                else:
                    written += len(keys)
            logger.info("kvtier nvme: flushed %d write-back blocks at shutdown", written)
        self.store.close(timeout_s=max(0.0, deadline - time.monotonic()) + 5.0)

    @staticmethod
    def _buffer(job: NVMeWriteJob, pool: CPUPool) -> WriteBuffer:
        wb = WriteBuffer(list(job.keys), pool.slot_bytes)
        for i, s in enumerate(job.slots):
            pool.copy_slot_out(s, wb.block(i))
        return wb
