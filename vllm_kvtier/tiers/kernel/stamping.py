"""The write path of the store kernel (:class:`StampedWrites`).

It runs a write buffer's deferred fill. It stamps the header into it: every block's
CRC32, keys, namespace, the store's rank; with a key, every block's tag and the header's
MAC. It calls the medium's ``put`` (or ``put_batch``). It gives one result per write,
whatever the medium did. Deletes go here too."""

from __future__ import annotations

import dataclasses
import logging
import time

from vllm_kvtier.chunkformat import ChunkHeader, block_crc, encode_header, header_bytes_for, make_header
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.base import IOResult
from vllm_kvtier.tiers.buffers import WriteBuffer
from vllm_kvtier.tiers.kernel.core import KernelCore
from vllm_kvtier.tiers.kernel.jobs import Failed, WriteJob, per_item
from vllm_kvtier.tiers.medium import BatchingMedium

__all__ = ["StampedWrites"]

logger = logging.getLogger("vllm_kvtier.tiers.kernel")


class StampedWrites(KernelCore):
    """The write half of :class:`~vllm_kvtier.tiers.kernel.StoreKernel`."""

    def _write(self, writes: list[WriteJob]) -> None:
        ready: list[WriteJob] = []
        for w in writes:
            fill, w.wb.fill = w.wb.fill, None
            try:
                if fill is not None and not fill(w.wb):  # its source changed: nothing to write
                    self._end_write(w, FailureReason.SUPERSEDED, None)
                    continue
            except Exception as e:
                logger.exception("kvtier %s: filling the write of %s failed", self.medium.name, w.chunk_id)
                self._end_write(w, FailureReason.ERROR, e)
                continue
            try:
                w.header = self._stamp(w.chunk_id, w.wb)
                ready.append(w)
            except (ValueError, Failed) as e:
                self._end_write(w, FailureReason.BAD_REQUEST if not isinstance(e, Failed) else e.reason, e)
        if not ready:
            return
        deadline = time.monotonic() + self.write_deadline_s
        views = [w.wb.buf.view[: w.header.total_bytes] for w in ready if w.header is not None]
        errors: list[BaseException | None]
        try:
            self._count("put")
            if isinstance(self.medium, BatchingMedium):
                errors = per_item(self.medium.put_batch(
                    [(w.chunk_id, v) for w, v in zip(ready, views, strict=True)], deadline), len(ready))
            else:
                self.medium.put(ready[0].chunk_id, views[0], deadline)
                errors = [None]
        except Exception as e:  # the medium raised instead of answering per item: all failed
            errors = [e] * len(ready)
        finally:
            for v in views:
                v.release()
        # every write ends here, whatever the medium did: its queue slot and buffer come back
        for w, err in zip(ready, errors, strict=True):
            self._end_write(w, None if err is None else self._reason(err), err)

    def _stamp(self, chunk_id: str, wb: WriteBuffer) -> ChunkHeader:
        """Every block's CRC32 (and, with a key, its tag and the header's MAC) and the
        header, written into the buffer's header room."""
        n = len(wb.keys)
        if wb.block_bytes != self.block_bytes or not 1 <= n <= self.max_chunk_blocks:
            raise Failed(FailureReason.BAD_REQUEST, f"a chunk of {n} blocks of {wb.block_bytes} B; this store "
                                                     f"writes 1..{self.max_chunk_blocks} of {self.block_bytes} B")
        if wb.header_bytes != header_bytes_for(n, self.authenticated):
            raise Failed(FailureReason.BAD_REQUEST, f"a write buffer with {wb.header_bytes} B of header room; "
                                                     f"this store (authenticated={self.authenticated}) needs "
                                                     f"{header_bytes_for(n, self.authenticated)}")
        crcs = [block_crc(wb.block(i)) for i in range(n)]
        if self.auth is None:
            h = make_header(self.namespace, wb.keys, crcs, self.block_bytes, rank=self.rank)
        else:
            tags = []
            for i, k in enumerate(wb.keys):
                with wb.block(i) as b:
                    tags.append(self.auth.block_tag(self.namespace, self.rank, k, b))
            h = make_header(self.namespace, wb.keys, crcs, self.block_bytes, tags=tags, key_id=self.auth.key_id,
                            rank=self.rank)
            h = dataclasses.replace(h, mac=self.auth.header_mac(chunk_id, h))
        encode_header(h, wb.buf.view)
        return h

    def _end_write(self, w: WriteJob, reason: FailureReason | None, err: BaseException | None) -> None:
        w.wb.close()
        with self._lock:
            self._queued_writes -= 1
        if reason is not None and reason != FailureReason.SUPERSEDED:  # superseded: nothing was wrong
            logger.warning("kvtier %s: write of %s failed (%s): %s", self.medium.name, w.chunk_id, reason, err)
        h = w.header if reason is None else None
        if h is not None and self._on_written is not None:
            self._on_written(w.chunk_id, h)
        self._emit(IOResult(w.job_id, "write", w.chunk_id, reason is None, reason, nbytes=h.total_bytes if h else 0,
                            seconds=time.perf_counter() - w.t0, header=h))

    def _delete(self, chunk_id: str) -> None:
        t0 = time.perf_counter()
        reason = None
        try:
            self._count("delete")
            self.medium.delete(chunk_id)
        except Exception as e:
            reason = self._reason(e)
            logger.warning("kvtier %s: delete of %s failed (%s): %s", self.medium.name, chunk_id, reason, e)
        self._emit(IOResult(-1, "delete", chunk_id, reason is None, reason, seconds=time.perf_counter() - t0))
