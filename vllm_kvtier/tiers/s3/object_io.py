"""The S3 medium's request plumbing.

It holds the object I/O engine contract (:class:`ObjectIO`) and its boto3 engine. It
holds request bodies over memoryviews, and reading a GET body straight into a buffer. No
boto3 import: the engine is handed a client. Only :mod:`vllm_kvtier.tiers.s3.medium` uses
it, and NIXL's engine in :mod:`vllm_kvtier.tiers.nixl.io_engine`. Checksums are not this
module's. The store kernel verifies every block once its bytes landed
(:mod:`vllm_kvtier.tiers.kernel`).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any, Protocol

from vllm_kvtier.chunkformat import ChunkFormatError
from vllm_kvtier.errors import FailureReason

logger = logging.getLogger("vllm_kvtier.tiers.s3.store")

#: Bytes per socket read of a GET body: few enough reads that Python's per-call cost is noise.
READ_STEP_BYTES = 1 << 20


class ObjectIO(Protocol):
    """Moves one chunk object's bytes between host memory and the bucket.

    This is the ``s3.io_engine`` plug point. Who calls it: the S3 medium, on the store
    kernel's I/O threads, several at once, each call on its own key and buffer. One call
    is one request attempt; the medium wraps it in its retries, breaker and deadline. It
    blocks its thread until the request ended or failed. Engines that can tell also stop
    when ``deadline`` (a ``time.monotonic()`` time) passed. The store keeps everything else
    (keys, headers, CRC32s, multipart uploads, listing, manifests). So the objects are the
    same whichever engine wrote them.

    Failure: raises; :func:`~vllm_kvtier.tiers.s3.config.error_reason` labels it (botocore's
    errors, ChunkFormatError for a short body, TimeoutError, ConnectionError). After a
    failed GET the bytes in ``view`` are undefined."""

    #: the ``s3.io_engine`` value
    name: str

    def put(self, key: str, view: memoryview, deadline: float) -> None:
        """One PUT of all of ``view`` as the object ``key`` (atomic: S3 never shows part of it)."""
        ...

    def get_into(self, key: str, start: int | None, view: memoryview, deadline: float) -> None:
        """One GET of ``len(view)`` bytes at ``start`` into ``view``.

        It is a ranged GET. With ``start`` None it is a GET of the whole object, which must
        be exactly that long."""
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

    def get_into(self, key: str, start: int | None, view: memoryview, deadline: float) -> None:
        """The whole object must be exactly ``len(view)`` bytes; a ranged GET that comes back
        short is ``truncated``."""
        kw = {} if start is None else {"Range": f"bytes={start}-{start + view.nbytes - 1}"}
        r = self._client.get_object(Bucket=self._bucket, Key=key, **kw)
        body = r["Body"]
        try:
            if r.get("ContentLength") != view.nbytes:
                raise ChunkFormatError(f"truncated: got {r.get('ContentLength')} of {view.nbytes} bytes", FailureReason.TRUNCATED)
            read_body_into(body, view)
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
    """Fill ``view`` from a botocore StreamingBody of exactly ``len(view)`` bytes.

    It reads at most ``step`` bytes per read, calling ``on_progress(bytes so far)`` after
    each. Why not ``body.readinto``? urllib3's ``readinto`` reads into a new bytes object
    and copies it. And http.client's ``read(n)`` copies once more. On a 2-core host that
    cost ~10% of load throughput. So when the layers are the usual ones, this reads
    straight from the http.client response into ``view``. The usual layers are botocore's
    ``_raw_stream`` and a urllib3 response over an http.client response, with no content
    decoding. It then hands the connection back to urllib3's pool. Otherwise it goes
    through botocore. Socket errors map to the reasons botocore's own wrappers would give
    (timeout, unavailable)."""
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
