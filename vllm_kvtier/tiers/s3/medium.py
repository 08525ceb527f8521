"""The S3 tier's byte primitives (:class:`S3Medium`) for one (bucket prefix, namespace, rank).

Who calls it: the store kernel's I/O threads (:mod:`vllm_kvtier.tiers.kernel`), the store's
manifest writes (:mod:`~vllm_kvtier.tiers.s3.store`) and its scan
(:mod:`~vllm_kvtier.tiers.s3.scan`), several threads at once.

Objects: each object is one chunk in the format of :mod:`~vllm_kvtier.chunkformat`. A
chunk is a header with every block's key and CRC32, then the blocks at a fixed stride. So
one object holds many blocks, and a load fetches exactly the byte ranges it needs. A load
makes one ranged GET per contiguous run of needed blocks (the kernel's ``read_shape``
"runs"). It makes a plain GET of the whole object when every block is wanted
(:class:`~vllm_kvtier.tiers.kernel.WholeObjectMedium`). The runs of a load are fetched in
parallel on the read threads, straight into a pooled buffer. The kernel checks every
block's CRC32 once its bytes landed; a mismatch is a miss (``checksum``).

Why chunks: S3 bills and rate-limits per request. The limits are about 3,500 writes and
5,500 reads per second per key prefix. So a 16-block chunk costs 1/16 of the requests of
one object per block.

Writes: an object above ``multipart_threshold_bytes`` goes up as a multipart upload. Bodies
are sent from the caller's buffer without a copy. A PUT (and a multipart completion) is
atomic: an object with its final key is always complete.

Engines: chunk PUTs and GETs go through ``s3.io_engine``
(:class:`~vllm_kvtier.tiers.s3.object_io.ObjectIO`). It is boto3 (the default) or NIXL's OBJ
backend (:mod:`~vllm_kvtier.tiers.nixl.io_engine`). NIXL's also does ranged GETs, so a load
fetches the same ranges either way. Listing, header probes at scan, manifests, deletes and
multipart uploads always use boto3. Keys, headers, CRC32 checks, retries, breaker and
deadlines are the same for both engines. So an object written through one engine reads
through the other.

Failures: a request is retried with jittered exponential backoff on 5xx,
SlowDown/throttling, timeouts and connection errors, within its deadline. Each store's
medium has one circuit breaker (:attr:`S3Medium.breaker`). Retries and breaker come from
:mod:`~vllm_kvtier.tiers.resilience`. A single PUT gets ``s3.deadline_s``. Each request of
a multipart upload gets its own. Every failure is labelled by
:func:`~vllm_kvtier.tiers.s3.config.error_reason`.

Credentials: boto3 resolves them from the standard AWS chain only (environment, shared
profile, web identity/IRSA, container and instance metadata). They are never in
:class:`~vllm_kvtier.tiers.s3.config.S3Config`, a repr or a log line.

Modules: request bodies and the engine contract are in
:mod:`~vllm_kvtier.tiers.s3.object_io`. Key layout and the failure classifier are in
:mod:`~vllm_kvtier.tiers.s3.config`.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm_kvtier.chunkformat import ChunkFormatError
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.kernel import ReadShape
from vllm_kvtier.tiers.resilience import CircuitBreaker, DeadlineExceeded, RetryPolicy, call_with_retries
from vllm_kvtier.tiers.s3.config import (
    S3Config,
    error_reason,
    is_transient,
    object_key,
    rank_prefix,
)
from vllm_kvtier.tiers.s3.object_io import Boto3ObjectIO, ObjectIO, ViewReader, read_body_into
from vllm_kvtier.tiers.s3.spec import INSTALL_HINT

__all__ = ["MANIFEST_STEP_BYTES", "BoundedBody", "RequestTally", "S3Medium"]

#: Bytes of a manifest's body read (and decoded) at a time: what a manifest read holds.
MANIFEST_STEP_BYTES = 256 << 10


class BoundedBody:
    """A GET body of ``nbytes`` (at most the caller's bound), handed out ``step`` bytes at
    a time into one reused buffer.

    A piece is valid until the next is asked for. ``etag`` names the version read. A second
    GET of that version sends it as ``IfMatch``."""

    def __init__(self, body: Any, nbytes: int, step: int, etag: str) -> None:
        self._body = body
        self.nbytes = nbytes
        self.etag = etag
        self._step = step

    def __iter__(self) -> Iterator[memoryview]:
        buf = memoryview(bytearray(min(self.nbytes, self._step)))
        got = 0
        while got < self.nbytes:
            k = min(self._step, self.nbytes - got)
            read_body_into(self._body, buf[:k])
            got += k
            yield buf[:k]


class RequestTally:
    """Requests sent by operation, and attempts retried, counted from many threads.

    botocore's ``before-send`` hook, the NIXL engine and the retry loop bump it on the
    I/O threads; the store reads it (:meth:`S3Medium.request_counts`) for its metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, int] = {}
        self._retries = 0

    def count(self, op: str) -> None:
        with self._lock:
            self._requests[op] = self._requests.get(op, 0) + 1

    def count_retry(self, e: BaseException | None = None) -> None:
        with self._lock:
            self._retries += 1

    def snapshot(self) -> tuple[dict[str, int], int]:
        """(requests sent by operation, attempts retried) so far."""
        with self._lock:
            return dict(self._requests), self._retries


class S3Medium:
    """The byte primitives of one (bucket prefix, namespace, rank), for the store kernel:
    ``put`` (a PUT, or a multipart upload above ``multipart_threshold_bytes``),
    ``read_into`` (one ranged GET through ``s3.io_engine``), ``read_whole_into`` (one plain
    GET), ``delete``, ``classify`` (:func:`~vllm_kvtier.tiers.s3.config.error_reason`).

    Every request goes through :meth:`call`: retries with backoff on transient failures,
    the circuit breaker, and the deadline it is given. Who calls it: the kernel's I/O
    threads and the store's scan, several threads at once."""

    name = "s3"
    #: one ranged GET per contiguous run of wanted blocks, the runs in parallel
    read_shape: ReadShape = "runs"

    def __init__(self, config: S3Config, namespace: str, rank: int) -> None:
        try:
            import boto3
            from botocore.config import Config as BotoConfig
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e
        self.config = config
        self.namespace = namespace
        self.rank = rank
        #: every key of this medium starts with it
        self.prefix = rank_prefix(config, namespace, rank)
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self._policy = RetryPolicy(config.max_attempts, config.backoff_base_s, config.backoff_max_s)
        self._rng = random.Random()
        self._tally = RequestTally()
        session = boto3.session.Session(region_name=config.region, profile_name=config.profile)
        self.client: Any = session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            verify=config.ca_bundle,  # None: the default CA store
            config=BotoConfig(
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                retries={"total_max_attempts": 1},  # ours: backoff, deadline, breaker
                # reads and writes have io_threads threads each; the scan a pool of its own
                max_pool_connections=3 * config.io_threads + 2,
                s3={"addressing_style": "path" if config.path_style else "auto"},
                # Every block carries its own CRC32, verified on read. botocore's default
                # (>= 1.36) adds an aws-chunked CRC trailer to each PUT, which several
                # S3-compatible servers (GCS interop, older MinIO/Ceph) reject or store
                # mangled; "when_required" sends plain Content-Length bodies.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                user_agent_extra="vllm-kvtier",
            ),
        )
        self.client.meta.events.register("before-send.s3", self._count_request)
        #: listing, header probes, manifests, deletes, multipart: always boto3
        self.boto = Boto3ObjectIO(self.client, config.bucket)
        #: chunk PUTs and GETs: the configured engine (ConfigError naming s3.io_engine if
        #: it cannot run here)
        self.data: ObjectIO = self.boto
        if config.io_engine == "nixl":
            from vllm_kvtier.tiers.nixl.io_engine import NixlObjectIO

            self.data = NixlObjectIO(config, self._size_of, on_request=self._tally.count)

    def key(self, chunk_id: str) -> str:
        return object_key(self.config, self.namespace, self.rank, chunk_id)

    def soon(self) -> float:
        """The deadline of a request started now."""
        return time.monotonic() + self.config.deadline_s

    # the Medium protocol

    def put(self, chunk_id: str, view: memoryview, deadline: float) -> None:
        self.put_key(self.key(chunk_id), view, deadline, self.data)

    def read_into(self, chunk_id: str, offset: int, dst: memoryview, deadline: float) -> None:
        self._get(self.key(chunk_id), offset, dst, deadline)

    def read_whole_into(self, chunk_id: str, dst: memoryview, deadline: float) -> None:
        """A GET without a Range: same request count, and spares servers that serve a range
        by copying it out of the object (moto does)."""
        self._get(self.key(chunk_id), None, dst, deadline)

    def delete(self, chunk_id: str) -> None:
        self.delete_key(self.key(chunk_id))

    def explain_damage(self, chunk_id: str, end: int, deadline: float) -> BaseException | None:
        """NIXL's OBJ engine does not tell a short GET (an object shorter than the range)
        from a full one: a HEAD tells (``truncated``). boto3 checks every body's length."""
        if self.data is self.boto:
            return None
        size = self.call(lambda: self._size_of(self.key(chunk_id)), deadline)
        if size < end:
            return ChunkFormatError(f"truncated: the object has {size} of {end} bytes", FailureReason.TRUNCATED)
        return None

    def classify(self, exc: BaseException) -> FailureReason:
        return error_reason(exc)

    def close(self) -> None:
        self.data.close()

    # requests

    def call(self, fn: Callable[[], Any], deadline: float) -> Any:
        """``fn()`` with retries, backoff and the breaker, no attempt started past ``deadline``."""
        return call_with_retries(fn, transient=is_transient, policy=self._policy, breaker=self.breaker,
                                 deadline=deadline, rng=self._rng, on_retry=self._tally.count_retry)

    def _get(self, key: str, start: int | None, dst: memoryview, deadline: float) -> None:
        try:
            self.call(lambda: self.data.get_into(key, start, dst, deadline), deadline)
        except Exception as e:
            if time.monotonic() >= deadline and error_reason(e) is FailureReason.TIMEOUT:
                # An engine that waits no longer than the deadline (NIXL's) gave up at it:
                # the same outcome as the kernel's expiry, under the same name.
                raise DeadlineExceeded(f"GET of {key}: {e}") from e
            raise

    def get_range(self, key: str, start: int, dst: memoryview, deadline: float) -> None:
        """One ranged GET through boto3 (header probes at scan)."""
        self.call(functools.partial(self.boto.get_into, key, start, dst, deadline), deadline)

    @contextlib.contextmanager
    def open_bounded(self, key: str, max_bytes: int, step: int = MANIFEST_STEP_BYTES, *,
                     if_match: str | None = None) -> Iterator[BoundedBody]:
        """A GET of a whole object of at most ``max_bytes``, its body handed out in pieces of
        at most ``step`` bytes as it arrives (:class:`BoundedBody`). ``ContentLength`` above
        ``max_bytes`` is ``too_large`` before a byte of the body is read; never more than
        ``ContentLength`` bytes are read (a body that ends sooner is ``truncated``), so a
        length that lies cannot make the reader hold more. ``if_match``: only that version
        (an ETag); another one fails the request. The body is closed on leaving the block."""
        kw: dict[str, Any] = {"Bucket": self.config.bucket, "Key": key}
        if if_match is not None:
            kw["IfMatch"] = if_match
        r = self.call(lambda: self.client.get_object(**kw), self.soon())
        with contextlib.closing(r["Body"]) as body:
            n = int(r.get("ContentLength") or 0)
            if n > max_bytes:
                raise ChunkFormatError(f"too large: an object of {n} B, at most {max_bytes}", FailureReason.TOO_LARGE)
            yield BoundedBody(body, n, step, str(r.get("ETag", "")))

    def get_bounded(self, key: str, max_bytes: int) -> bytes:
        """A whole object of at most ``max_bytes`` (larger: ``too_large``, nothing read)."""
        with self.open_bounded(key, max_bytes) as pieces:
            return b"".join(bytes(p) for p in pieces)

    def put_key(self, key: str, body: memoryview | bytes, deadline: float, engine: ObjectIO | None = None) -> None:
        """PUT ``body`` (through ``engine``, default boto3) within ``deadline``, or a
        multipart upload through boto3 above ``multipart_threshold_bytes`` (the NIXL engine
        only does single PUTs)."""
        view = memoryview(body)
        io_ = engine or self.boto
        if view.nbytes > self.config.multipart_threshold_bytes:
            self._put_multipart(key, view)
        else:
            self.call(lambda: io_.put(key, view, deadline), deadline)

    def _put_multipart(self, key: str, view: memoryview) -> None:
        """Create, upload parts in order (each its own deadline and retries), complete.
        On failure the upload is aborted (best effort; a lifecycle rule with
        AbortIncompleteMultipartUpload removes what an abort could not)."""
        c, bucket, part = self.client, self.config.bucket, self.config.multipart_part_bytes
        upload_id = self.call(lambda: c.create_multipart_upload(Bucket=bucket, Key=key), self.soon())["UploadId"]

        def upload(number: int, chunk: memoryview) -> str:
            reader = ViewReader(chunk)
            try:
                return str(c.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=reader,
                                         ContentLength=chunk.nbytes)["ETag"])
            finally:
                reader.close()

        try:
            parts = []
            for i, off in enumerate(range(0, view.nbytes, part)):
                etag = self.call(functools.partial(upload, i + 1, view[off : off + part]), self.soon())
                parts.append({"ETag": etag, "PartNumber": i + 1})
            self.call(lambda: c.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                                          MultipartUpload={"Parts": parts}), self.soon())
        except Exception:
            with contextlib.suppress(Exception):
                self.call(lambda: c.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id), self.soon())
            raise

    def delete_key(self, key: str) -> None:
        """Delete any key of this medium's prefix (absent is fine)."""
        if not key.startswith(self.prefix):
            raise ValueError(f"{key!r} is outside this store's prefix")
        self.call(lambda: self.client.delete_object(Bucket=self.config.bucket, Key=key), self.soon())

    def list_pages(self) -> Iterator[dict[str, Any]]:
        """LIST the prefix, page by page (each page one request)."""
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": self.prefix}
            if token:
                kw["ContinuationToken"] = token
            page = self.call(functools.partial(self.client.list_objects_v2, **kw), self.soon())
            yield page
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return

    def _size_of(self, key: str) -> int:
        """One HEAD (botocore's error if the object is gone or the endpoint unreachable)."""
        return int(self.client.head_object(Bucket=self.config.bucket, Key=key)["ContentLength"])

    # figures

    def _count_request(self, event_name: str = "", **_: Any) -> None:
        self._tally.count(event_name.rsplit(".", 1)[-1])

    def request_counts(self) -> tuple[dict[str, int], int]:
        """(requests sent by operation, attempts retried) so far."""
        return self._tally.snapshot()
