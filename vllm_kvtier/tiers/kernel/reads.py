"""The ONE verified read path of the store kernel (:class:`VerifiedReads`).

A read's request is checked against its header: trust (MAC, key, rank), then block size,
positions and the key at each. Its ranges are planned by the medium's ``read_shape``. A
read with no header is probed; the header's announced size is bounded before anything is
sized from it. The ranges are read and verified: the stored header against the caller's,
every wanted block's CRC32 and, with a key, its tag. A checksum failure is explained by an
:class:`~vllm_kvtier.tiers.medium.ExplainingMedium`. There is exactly one result per
read."""

from __future__ import annotations

import logging

from vllm_kvtier.chunkformat import (
    ALIGN,
    ChunkFormatError,
    ChunkHeader,
    align_up,
    block_crc,
    bounded_header_bytes,
    decode_header,
    encode_header,
    header_bytes_for,
)
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.auth import refusal
from vllm_kvtier.tiers.buffers import Releasable
from vllm_kvtier.tiers.kernel.core import KernelCore
from vllm_kvtier.tiers.kernel.jobs import Failed, Op, Part, ReadJob, per_item, runs_of
from vllm_kvtier.tiers.medium import BatchingMedium, ExplainingMedium, SizedMedium, WholeObjectMedium

__all__ = ["VerifiedReads"]

logger = logging.getLogger("vllm_kvtier.tiers.kernel")


class VerifiedReads(KernelCore):
    """The read half of :class:`~vllm_kvtier.tiers.kernel.StoreKernel`."""

    def _check_request(self, job: ReadJob, h: ChunkHeader) -> Failed | None:
        """Why the wanted positions cannot be served from a chunk with header ``h``."""
        why = self._check_trust(job.chunk_id, h)
        if why is not None:
            return why
        if h.block_bytes != self.block_bytes:
            return Failed(FailureReason.FORMAT, f"blocks of {h.block_bytes} B, expected {self.block_bytes}")
        if not all(0 <= p < h.nblocks for p in job.positions):
            return Failed(FailureReason.BAD_REQUEST, f"positions {job.positions} of a {h.nblocks}-block chunk")
        for p, k in zip(job.positions, job.keys, strict=True):
            if h.keys[p] != k:
                return Failed(FailureReason.KEY_MISMATCH, f"position {p} holds key {h.keys[p].hex()[:16]}, "
                                                           f"not {k.hex()[:16]}")
        return None

    def _check_trust(self, chunk_id: str, h: ChunkHeader) -> Failed | None:
        """Why header ``h`` of ``chunk_id`` is not to be trusted by this store (None: it is):
        its MAC and key (:func:`~vllm_kvtier.tiers.auth.refusal`), then its rank (after the
        MAC: a signed header's rank is the signer's)."""
        why = refusal(self.auth, chunk_id, h)
        if why is not None:
            return Failed(*why)
        if h.rank != self.rank:
            return Failed(FailureReason.KEY_MISMATCH, f"a chunk of rank {h.rank}, this store is rank {self.rank}")
        return None

    def refuses(self, chunk_id: str, h: ChunkHeader) -> FailureReason | None:
        """Why a scan must not index header ``h`` of ``chunk_id`` (None: it may): what a read
        would refuse before any byte moves (MAC and accepted key, rank). Any thread."""
        why = self._check_trust(chunk_id, h)
        return None if why is None else why.reason

    def _plan(self, h: ChunkHeader, positions: list[int]) -> list[Part]:
        shape = self.medium.read_shape
        if shape == "whole":
            return [Part(0, h.total_bytes, 0, tuple(sorted(set(positions))))]
        if shape == "runs" and isinstance(self.medium, WholeObjectMedium) and len(set(positions)) == h.nblocks:
            return [Part(0, h.total_bytes, 0, tuple(range(h.nblocks)), whole=True)]
        runs = [(min(positions), max(positions))] if shape == "span" else runs_of(positions)
        parts, buf_off = [], 0
        for lo, hi in runs:
            # A range from block 0 takes the header along (it is compared with the caller's).
            start = 0 if lo == 0 else h.block_offset(lo)
            end = h.block_offset(hi) + (h.stride if shape == "span" else h.block_bytes)
            parts.append(Part(start, end - start, buf_off, tuple(p for p in sorted(set(positions)) if lo <= p <= hi)))
            buf_off += align_up(end - start)  # each range page-aligned in the buffer (O_DIRECT)
        return parts

    def _start_parts(self, job: ReadJob, h: ChunkHeader, buffer: Releasable | None = None) -> None:
        """Allocate the read's buffer and queue its ranges (any thread)."""
        parts = self._plan(h, job.positions)
        for part in parts:
            for p in part.positions:
                job.offsets[p] = part.buf_off + h.block_offset(p) - part.offset
        if buffer is None:
            total = parts[-1].buf_off + parts[-1].length
            buffer = self._take(total)
            if buffer is None:
                self._fail(job, Failed(FailureReason.NO_BUFFER, f"no transfer memory for {total} B"))
                return
        with job.lock:
            job.header, job.buffer, job.remaining = h, buffer, len(parts)
        for part in parts:
            self._enqueue(self._reads_q, Op.PART, read=job, part=part)

    def _probe(self, job: ReadJob) -> None:
        """A read with no header: fetch and verify the header first, every size in it
        bounded before it sizes anything."""
        if job.done:
            return
        buffer: Releasable | None = None
        try:
            if isinstance(self.medium, SizedMedium):
                self._count("size_of")
                size = self.medium.size_of(job.chunk_id, job.deadline)
                if size > self._max_bytes:
                    raise Failed(FailureReason.TOO_LARGE, f"an object of {size} B; this store writes at most "
                                                           f"{self._max_bytes} B")
                if size < header_bytes_for(1):
                    raise Failed(FailureReason.TRUNCATED, f"an object of {size} B")
                buffer = self._take(size)
                if buffer is None:
                    raise Failed(FailureReason.NO_BUFFER, f"no transfer memory for {size} B")
                # The whole object is the read's one range, batched with other reads; its
                # header is decoded and checked first when it lands (_verify).
                with job.lock:
                    job.buffer, job.remaining = buffer, 1
                whole = Part(0, size, 0, tuple(sorted(set(job.positions))))
                self._enqueue(self._reads_q, Op.PART, read=job, part=whole)
                return
            h = self._read_header(job)
            why = self._check_request(job, h)
            if why is not None:
                raise why
        except Exception as e:
            if buffer is not None:
                buffer.close()
            self._fail(job, e)
            return
        self._start_parts(job, h, buffer)

    def _read_header(self, job: ReadJob) -> ChunkHeader:
        """The first page, then (for a header longer than a page, its length bounded first)
        the whole header; in aligned buffers, as O_DIRECT needs."""
        need = ALIGN
        while True:
            buf = self._take(need)
            if buf is None:
                raise Failed(FailureReason.NO_BUFFER, f"no transfer memory for {need} B")
            try:
                self._count("read")
                with buf.view[:need] as head:
                    self.medium.read_into(job.chunk_id, 0, head, job.deadline)
                    try:
                        with head[:64] as fixed:
                            full = bounded_header_bytes(fixed, max_blocks=self.max_chunk_blocks,
                                                        block_bytes=self.block_bytes)
                        if full <= need:
                            with head[:full] as exact:
                                return decode_header(exact, self.namespace)
                    except ChunkFormatError as e:  # a short read the medium did not notice?
                        why = self._explain(job, Part(0, need, 0, ()), Failed(FailureReason.CHECKSUM, str(e)))
                        if why is None or isinstance(why, Failed):
                            raise
                        raise why from e
                need = full
            finally:
                buf.close()

    def _decode(self, data: memoryview) -> ChunkHeader:
        with data[:64] as fixed:
            need = bounded_header_bytes(fixed, max_blocks=self.max_chunk_blocks, block_bytes=self.block_bytes)
        if need > len(data):
            raise Failed(FailureReason.TRUNCATED, f"{len(data)} bytes, the header alone needs {need}")
        with data[:need] as head:
            return decode_header(head, self.namespace)

    def _read_parts(self, items: list[tuple[ReadJob, Part]]) -> None:
        live = [(j, p) for j, p in items if not j.done]
        for j, p in items:
            if j.done:
                self._part_done(j, p, None)
        if not live:
            return
        deadline = min(j.deadline for j, _ in live)
        views = []
        for j, p in live:
            assert j.buffer is not None
            views.append(j.buffer.view[p.buf_off : p.buf_off + p.length])
        errors: list[BaseException | None]
        try:
            try:
                self._count("read")
                if isinstance(self.medium, BatchingMedium):
                    errors = per_item(self.medium.read_batch(
                        [(j.chunk_id, p.offset, v) for (j, p), v in zip(live, views, strict=True)], deadline),
                        len(live))
                else:
                    (j, p), v = live[0], views[0]
                    if p.whole and isinstance(self.medium, WholeObjectMedium):
                        self.medium.read_whole_into(j.chunk_id, v, j.deadline)
                    else:
                        self.medium.read_into(j.chunk_id, p.offset, v, j.deadline)
                    errors = [None]
            except Exception as e:  # the medium raised instead of answering per item: all failed
                errors = [e] * len(live)
            errors = [self._verify(j, p, v) if err is None else err
                      for (j, p), v, err in zip(live, views, errors, strict=True)]
        finally:
            for v in views:  # released before a failed job's buffer can go back to the pool
                v.release()
        errors = [self._explain(j, p, err) for (j, p), err in zip(live, errors, strict=True)]
        for (j, p), err in zip(live, errors, strict=True):
            self._part_done(j, p, err)

    def _verify(self, job: ReadJob, part: Part, view: memoryview) -> BaseException | None:
        """The CRC32 of every wanted block in the range, and the stored header against the
        caller's when the range holds it."""
        h = job.header
        if h is None:  # a whole object probed by size (SizedMedium): its header first
            try:
                h = self._decode(view)
                if len(view) < h.total_bytes:
                    raise Failed(FailureReason.TRUNCATED, f"{len(view)} of {h.total_bytes} bytes")
                why = self._check_request(job, h)
                if why is not None:
                    raise why
            except (ChunkFormatError, Failed) as e:
                return e
            job.header, job.offsets = h, {p: h.block_offset(p) for p in job.positions}
        elif part.offset == 0:
            expected = bytearray(h.header_bytes)
            encode_header(h, memoryview(expected))
            with view[: h.header_bytes] as head:
                if head != expected:  # with a key, what was verified is not what is stored: forged
                    return Failed(FailureReason.CHECKSUM if self.auth is None else FailureReason.AUTH_FAILED,
                                   "the stored header is not the indexed chunk's")
        for p in part.positions:
            off = h.block_offset(p) - part.offset
            with view[off : off + h.block_bytes] as b:
                if block_crc(b) != h.crcs[p]:
                    return Failed(FailureReason.CHECKSUM, f"block {p} checksum mismatch")
                # The header (and so the tag) was verified by _check_request before this.
                if self.auth is not None and not self.auth.verify_block(h.namespace, self.rank, h.keys[p], b,
                                                                        h.tags[p], h.key_id):
                    return Failed(FailureReason.AUTH_FAILED, f"block {p}: its tag does not verify")
        return None

    def _explain(self, job: ReadJob, part: Part, err: BaseException | None) -> BaseException | None:
        """What an :class:`ExplainingMedium` says about a checksum failure of ``part``."""
        if (not isinstance(self.medium, ExplainingMedium) or not isinstance(err, Failed)
                or err.reason is not FailureReason.CHECKSUM or job.done):
            return err
        try:
            why = self.medium.explain_damage(job.chunk_id, part.offset + part.length, job.deadline)
        except Exception as e:  # the explanation failed: the checksum failure stands
            logger.debug("kvtier %s: no explanation for %s: %s", self.medium.name, job.chunk_id, e)
            return err
        return err if why is None else why

    def _part_done(self, job: ReadJob, part: Part, err: BaseException | None) -> None:
        reason = None if err is None else self._reason(err)
        with job.lock:
            job.remaining -= 1
            if err is None:
                job.nbytes += part.length
            elif job.reason is None:
                job.reason = reason
            last = job.remaining == 0
        if err is not None and self._claim(job):
            self._log_read(job, err)
            self._emit_read(job, reason)
        if not last:
            return
        if job.reason is None and self._claim(job):
            self._emit_ok(job)
        elif job.buffer is not None:  # failed or expired: no result holds the buffer
            job.buffer.close()
            job.buffer = None

    def _fail(self, job: ReadJob, err: BaseException) -> None:
        """Report a read failed before any range of it was queued."""
        if self._claim(job):
            self._log_read(job, err)
            self._emit_read(job, self._reason(err))
