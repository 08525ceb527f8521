"""Plumbing of the S3 store's I/O threads: the object I/O engine contract
(:class:`ObjectIO`) and its boto3 engine, request bodies over memoryviews, reading a GET
body into a buffer while checking its blocks, and a tiny thread pool that can be joined
with a deadline. No boto3 import (the engine is handed a client); used only by
:mod:`vllm_kvtier.tiers.s3` (and NIXL's engine in :mod:`vllm_kvtier.tiers.nixl_io`).
"""

from __future__ import annotations

import io
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.chunkfile import ChunkFormatError, ChunkHeader, block_crc, encode_header

logger = logging.getLogger("vllm_kvtier.tiers.s3")

#: Bytes per socket read of a GET body: blocks are checksummed as each read lands, while
#: they are still in the CPU cache (checking after the whole GET read them back from RAM,
#: measurably slower at GB/s), and few enough reads that Python's per-call cost is noise.
READ_STEP_BYTES = 1 << 20


class ObjectIO(Protocol):
    """Moves one chunk object's bytes between host memory and the bucket: the
    ``s3.io_engine`` plug point.

    Who calls it: the S3 store's I/O threads, several at once, each call on its own key and
    buffer; one call is one request attempt (the store wraps it in its retries, breaker
    and deadline) and blocks its thread until the request ended, failed, or (engines that
    can tell) ``deadline`` (a ``time.monotonic()`` time) passed. The store keeps
    everything else (keys, headers, CRC32s, multipart uploads, listing, manifests), so the
    objects are the same whichever engine wrote them.

    Failure: raises; :func:`~vllm_kvtier.tiers.s3_config.error_reason` labels it (botocore's
    errors, ChunkFormatError from the check or a short body, TimeoutError, ConnectionError).
    After a failed GET the bytes in ``view`` are undefined."""

    #: the ``s3.io_engine`` value
    name: str

    def put(self, key: str, view: memoryview, deadline: float) -> None:
        """One PUT of all of ``view`` as the object ``key`` (atomic: S3 never shows part of it)."""
        ...

    def get_into(self, key: str, start: int | None, view: memoryview, deadline: float,
                 check: Callable[[int], None] | None = None) -> None:
        """One GET of ``len(view)`` bytes at ``start`` into ``view``: a ranged GET, or with
        ``start`` None a GET of the whole object. ``check(bytes so far)`` runs as the bytes
        arrive (it raises to reject them); at the latest once they all did."""
        ...

    def close(self) -> None:
        """Free the engine's resources; called once, after the store's threads stopped."""
        ...


class Boto3ObjectIO:
    """``s3.io_engine: boto3``: plain boto3 requests. An attempt is bounded by the client's
    connect and read timeouts (``deadline`` is the store's business)."""

    name = "boto3"

    def __init__(self, client: Any, bucket: str) -> None:
        self._client = client
        self._bucket = bucket

    def put(self, key: str, view: memoryview, deadline: float) -> None:
        reader = ViewReader(view)
        try:
            self._client.put_object(Bucket=self._bucket, Key=key, Body=reader, ContentLength=view.nbytes)
        finally:
            reader.close()

    def get_into(self, key: str, start: int | None, view: memoryview, deadline: float,
                 check: Callable[[int], None] | None = None) -> None:
        """The whole object must be exactly ``len(view)`` bytes; a ranged GET that comes back
        short is ``truncated``."""
        kw = {} if start is None else {"Range": f"bytes={start}-{start + view.nbytes - 1}"}
        r = self._client.get_object(Bucket=self._bucket, Key=key, **kw)
        body = r["Body"]
        try:
            if r.get("ContentLength") != view.nbytes:
                raise ChunkFormatError(f"truncated: got {r.get('ContentLength')} of {view.nbytes} bytes", FailureReason.TRUNCATED)
            read_body_into(body, view, on_progress=check)
        finally:
            body.close()

    def close(self) -> None:
        pass


class ViewReader(io.RawIOBase):
    """A request body over a memoryview, without copying it: ``read`` returns slices, which
    urllib3 sends as they are (botocore refuses a bare memoryview as a Body). Seekable, so
    botocore can compute the length and rewind."""

    def __init__(self, view: memoryview) -> None:
        self._v: memoryview | None = view
        self._pos = 0
        self._n = view.nbytes

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._n}[whence]
        self._pos = max(0, min(self._n, base + offset))
        return self._pos

    def read(self, size: int | None = -1) -> memoryview:  # type: ignore[override]
        assert self._v is not None, "read after close"
        end = self._n if size is None or size < 0 else min(self._n, self._pos + size)
        out = self._v[self._pos : end]
        self._pos = end
        return out

    def readinto(self, b: Any) -> int:
        chunk = self.read(len(b))
        b[: len(chunk)] = chunk
        return len(chunk)

    def __len__(self) -> int:
        return self._n

    def close(self) -> None:
        self._v = None
        super().close()


def read_body_into(
    body: Any,
    view: memoryview,
    *,
    step: int = READ_STEP_BYTES,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    """Fill ``view`` from a botocore StreamingBody of exactly ``len(view)`` bytes, at most
    ``step`` bytes per read, calling ``on_progress(bytes so far)`` after each.

    Why not ``body.readinto``: urllib3's ``readinto`` reads into a new bytes object and
    copies it (and http.client's ``read(n)`` copies once more), which on a 2-core host cost
    ~10% of load throughput. When the layers are the usual ones (botocore's ``_raw_stream``,
    a urllib3 response over an http.client response, no content decoding), read straight
    from the http.client response into ``view`` and hand the connection back to urllib3's
    pool; otherwise go through botocore. Socket errors map to the reasons botocore's own
    wrappers would give (timeout, unavailable)."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    headers = getattr(raw, "headers", None) or {}
    direct = (
        callable(getattr(fp, "readinto", None))
        and callable(getattr(raw, "release_conn", None))
        and not headers.get("content-encoding")
    )
    src = fp.readinto if direct else body.readinto  # type: ignore[union-attr]
    got = 0
    while got < view.nbytes:
        with view[got : got + step] as rest:
            n = src(rest)
        if not n:
            raise ChunkFormatError(f"truncated: got {got} of {view.nbytes} bytes", FailureReason.TRUNCATED)
        got += n
        if on_progress is not None:
            on_progress(got)
    if direct:
        raw.release_conn()  # type: ignore[union-attr]


class Workers:
    """``n`` daemon threads running queued callables in order (callables never raise)."""

    def __init__(self, name: str, n: int) -> None:
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def close(self, deadline: float) -> None:
        """Let queued work finish, then stop; waits until ``deadline`` (a monotonic time)."""
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # a bug in our own plumbing: log it, keep the thread
                logger.exception("kvtier s3: unexpected error in an I/O thread")


@dataclass(frozen=True)
class Span:
    """One GET of a read: blocks ``lo..hi`` from object offset ``obj_start``, ``length``
    bytes, landing at ``buf_off`` in the job's buffer."""

    lo: int
    hi: int
    obj_start: int
    buf_off: int
    length: int
    whole: bool


class SpanVerifier:
    """Checks a span's blocks, and a whole object's header, as the bytes arrive."""

    def __init__(self, h: ChunkHeader, span: Span, view: memoryview) -> None:
        self.h, self.span, self.view = h, span, view
        self.next = span.lo
        self.header_ok = not span.whole

    def __call__(self, got: int) -> None:
        h, span = self.h, self.span
        if not self.header_ok and got >= h.header_bytes:
            expected = bytearray(h.header_bytes)
            encode_header(h, memoryview(expected))
            with self.view[: h.header_bytes] as head:
                same = head == expected
            if not same:
                raise ChunkFormatError("header checksum mismatch: the object is not the indexed chunk", FailureReason.CHECKSUM)
            self.header_ok = True
        while self.next <= span.hi:
            off = h.block_offset(self.next) - span.obj_start
            if off + h.block_bytes > got:
                return
            with self.view[off : off + h.block_bytes] as b:
                ok = block_crc(b) == h.crcs[self.next]
            if not ok:
                raise ChunkFormatError(f"block {self.next} checksum mismatch", FailureReason.CHECKSUM)
            self.next += 1

    def finish(self) -> None:
        if not self.header_ok or self.next <= self.span.hi:
            raise ChunkFormatError("truncated: not every block was checked", FailureReason.TRUNCATED)
        self.view = None  # type: ignore[assignment]


def contiguous_runs(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct positions as inclusive (first, last) runs: [1,2,3,7] -> [(1,3),(7,7)]."""
    runs: list[tuple[int, int]] = []
    for p in sorted(set(positions)):
        if runs and p == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], p)
        else:
            runs.append((p, p))
    return runs
