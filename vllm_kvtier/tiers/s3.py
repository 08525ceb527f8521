"""The object-store tier's data path: chunk objects in an S3 bucket (or any S3-compatible
endpoint: MinIO, Ceph RGW, GCS interoperability), written and read by I/O threads.

Who calls it: the worker half (one store per TP rank), from the worker's main thread;
``submit_*`` return at once, completions come back through :meth:`S3Store.poll`, exactly
like :class:`~vllm_kvtier.tiers.nvme.NVMeStore`. :meth:`S3Store.scan` (start-up) and
:meth:`S3Store.close` (shutdown) block their caller.

Objects: the chunk format of :mod:`~vllm_kvtier.tiers.chunkfile` (a header with every
block's key and CRC32, then the blocks at a fixed stride), so one object holds many blocks
and a load fetches exactly the byte ranges it needs: one ranged GET per contiguous run of
needed blocks (a plain GET when that is every block), the runs of a load fetched in
parallel straight into a pooled buffer, every block's CRC32 checked as its bytes arrive
(a mismatch is a failed read, reason ``checksum``). Fewer, bigger objects is the point: S3
bills and rate-limits per request (about 3,500 writes and 5,500 reads per second per key
prefix), so a 16-block chunk costs 1/16 of the requests of one object per block. Objects
above ``multipart_threshold_bytes`` go up as a multipart upload; bodies are sent from the
caller's buffer without a copy.

Engines: chunk PUTs and GETs go through ``s3.io_engine``
(:class:`~vllm_kvtier.tiers.s3_io.ObjectIO`): boto3 (default) or NIXL's OBJ backend
(:mod:`~vllm_kvtier.tiers.nixl_io`), which also does ranged GETs, so a load fetches the
same ranges either way. Listing, header probes, manifests, deletes and multipart uploads
always use boto3. Keys, headers, CRC32 checks, retries, breaker and deadlines are this
module's for both, so an object written through one engine reads through the other.

Modules: configuration, key layout and failure labels in :mod:`~vllm_kvtier.tiers.s3_config`;
body and thread plumbing in :mod:`~vllm_kvtier.tiers.s3_io`; retries and the breaker in
:mod:`~vllm_kvtier.tiers.resilience`; manifests in :mod:`~vllm_kvtier.tiers.manifest`.

Keys: ``<prefix><namespace>/r<rank>/<hh>/<object_id>.kvt``; ``hh`` is two hex characters of
a hash of the object id, so writes spread over 256 prefixes that S3 can partition
independently instead of all landing on one. ``namespace`` digests everything that changes
the bytes (as for NVMe), so instances sharing a bucket never read incompatible KV. A PUT
(and a multipart completion) is atomic: an object with its final key is always complete.

Index: :meth:`S3Store.scan` lists the rank's prefix (one LIST request per 1,000 keys) and
needs each object's header. Each writer keeps a manifest object
(``.../r<rank>/manifest/<writer_id>.kvm``, :mod:`~vllm_kvtier.tiers.manifest`) holding the
headers of the objects it wrote, rewritten every ``manifest_every_writes`` writes and at
close, so a scan costs ``ceil(keys / 1000)`` LISTs + one GET per writer's manifest + one
ranged GET (first 4 KiB) per object that no manifest covers (written since that writer's
last manifest, or by a writer that crashed). The listing is the truth; a manifest entry is
used only for an object the listing shows, so a stale or lost manifest costs requests,
never correctness. Writing manifests costs one PUT per ``manifest_every_writes`` chunk
writes (1.6% more PUTs at the default 64).

Failures: retries with jittered exponential backoff on 5xx, SlowDown/throttling, timeouts
and connection errors, within a deadline; a per-store circuit breaker
(:mod:`~vllm_kvtier.tiers.resilience`). A read's deadline counts from its submission and
:meth:`S3Store.poll` reports a read past it as failed (``deadline``) even while a request is
still on the wire, so a slow endpoint is a miss, never a stall. Every failure is an
``IOResult(ok=False, reason=...)``; no exception leaves an I/O thread.

Credentials: only the standard AWS chain (environment, shared profile, web identity/IRSA,
container and instance metadata), resolved by boto3. They are never in :class:`S3Config`,
a repr or a log line.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.base import IOResult, drain
from vllm_kvtier.tiers.buffers import AlignedBuffer, BufferPool, WriteBuffer, shared_pool
from vllm_kvtier.tiers.chunkfile import (
    ChunkFormatError,
    ChunkHeader,
    block_crc,
    decode_header,
    encode_header,
    header_bytes_for,
    keys_match,
    make_header,
)
from vllm_kvtier.tiers.manifest import decode_manifest, encode_manifest
from vllm_kvtier.tiers.resilience import CircuitBreaker, RemoteStats, RetryPolicy, call_with_retries
from vllm_kvtier.tiers.s3_config import (
    HEAD_PROBE_BYTES,
    INSTALL_HINT,
    MANIFEST_SUFFIX,
    SAFE_ID,
    SUFFIX,
    S3Config,
    error_reason,
    is_transient,
    object_key,
    rank_prefix,
)
from vllm_kvtier.tiers.s3_io import (
    Boto3ObjectIO,
    ObjectIO,
    Span,
    SpanVerifier,
    ViewReader,
    Workers,
    contiguous_runs,
    read_body_into,
)

__all__ = [
    "S3Config",
    "S3Stats",
    "S3Store",
    "ScanReport",
    "contiguous_runs",
    "error_reason",
    "is_transient",
    "object_key",
    "rank_prefix",
    "read_body_into",
]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _ReadJob:
    job_id: int
    object_id: str
    key: str
    #: None until fetched, for an object this process has not seen (another writer's).
    header: ChunkHeader | None
    positions: list[int]
    deadline: float
    t0: float
    keys: list[bytes] | None = None
    buffer: AlignedBuffer | None = None
    #: position -> offset of its block in ``buffer``
    offsets: dict[int, int] = field(default_factory=dict)
    remaining: int = 0
    reason: str = ""
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


#: The S3 store's figures (the shape every remote store reports).
S3Stats = RemoteStats


@dataclass
class _Listing:
    #: object_id -> (size, LastModified as a timestamp, key)
    objects: dict[str, tuple[int, float, str]] = field(default_factory=dict)
    manifests: list[str] = field(default_factory=list)
    requests: int = 0


@dataclass(frozen=True)
class ScanReport:
    """What the last :meth:`S3Store.scan` found and what it cost in requests."""

    objects: int = 0
    list_requests: int = 0
    manifest_gets: int = 0
    header_gets: int = 0
    #: objects whose header came from a manifest (no GET needed)
    from_manifests: int = 0
    #: problem -> count (unverifiable objects or manifests, a failed listing...)
    problems: dict[str, int] = field(default_factory=dict)


# ---- the store ----------------------------------------------------------------------------


class S3Store:
    """Chunk objects in one bucket prefix for one (namespace, rank). See the module doc."""

    def __init__(self, config: S3Config, namespace: str, rank: int, block_bytes: int, *,
                 buffers: BufferPool | None = None) -> None:
        """``buffers``: the worker's read-buffer pool (None: the process default)."""
        try:
            import boto3
            from botocore.config import Config as BotoConfig
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e
        self.config = config
        self._buffers = buffers or shared_pool()
        self.namespace = namespace
        self.rank = rank
        self.block_bytes = block_bytes
        self.writer_id = config.writer_id or uuid.uuid4().hex[:16]
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self.last_scan = ScanReport()
        self._policy = RetryPolicy(config.max_attempts, config.backoff_base_s, config.backoff_max_s)
        self._rng = random.Random()
        session = boto3.session.Session(region_name=config.region, profile_name=config.profile)
        self._client = session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            verify=config.ca_bundle,  # None: the default CA store
            config=BotoConfig(
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                retries={"total_max_attempts": 1},  # ours: backoff, deadline, breaker
                max_pool_connections=2 * config.io_threads + 2,
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
        self._client.meta.events.register("before-send.s3", self._count_request)
        #: listing, header probes, manifests, deletes, multipart: always boto3
        self._boto = Boto3ObjectIO(self._client, config.bucket)
        #: chunk PUTs and GETs: the configured engine (ConfigError naming s3.io_engine if
        #: it cannot run here)
        self._data: ObjectIO = self._boto
        if config.io_engine == "nixl":
            from vllm_kvtier.tiers.nixl_io import NixlObjectIO

            self._data = NixlObjectIO(config, self._size_of, on_request=self._count_op)
        self.max_queued_writes = config.max_queued_writes
        self._lock = threading.Lock()
        self._done: queue.SimpleQueue[IOResult] = queue.SimpleQueue()
        self._has_done = threading.Event()
        self._pending: set[_ReadJob] = set()
        self._queued_writes = 0
        self._closed = False
        self._requests: dict[str, int] = {}
        self._retries = 0
        self._failures: dict[str, int] = {}
        self._manifest: dict[str, ChunkHeader] = {}  # this writer's live objects
        self._manifest_changes = 0
        self._flush_lock = threading.Lock()
        self._readers = Workers("kvtier-s3-read", config.io_threads)
        self._writers = Workers("kvtier-s3-write", config.io_threads)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"S3Store(bucket={c.bucket!r}, prefix={c.prefix!r}, endpoint_url={c.endpoint_url!r}, "
            f"namespace={self.namespace!r}, rank={self.rank}, writer_id={self.writer_id!r}, "
            f"io_engine={c.io_engine!r})"
        )

    # ---- keys ---------------------------------------------------------------------------

    def key(self, object_id: str) -> str:
        return object_key(self.config, self.namespace, self.rank, object_id)

    def manifest_key(self, writer_id: str | None = None) -> str:
        wid = writer_id or self.writer_id
        return f"{rank_prefix(self.config, self.namespace, self.rank)}manifest/{wid}{MANIFEST_SUFFIX}"

    # ---- submission (caller's thread; never blocks) -----------------------------------------

    def submit_write(self, job_id: int, object_id: str, wb: WriteBuffer) -> bool:
        """Queue a chunk upload. False (and nothing queued) if too many writes wait or the
        store is closed; the caller still owns ``wb`` then. Otherwise the store closes
        ``wb``'s buffer when the upload ends."""
        if not SAFE_ID.match(object_id):
            raise ValueError(f"object id {object_id!r}: 1-128 of A-Z a-z 0-9 _ . -")
        with self._lock:
            if self._closed or self._queued_writes >= self.max_queued_writes:
                return False
            self._queued_writes += 1
        self._writers.submit(functools.partial(self._run_write, job_id, object_id, wb))
        return True

    def submit_read(
        self, job_id: int, object_id: str, header: ChunkHeader | None, positions: Sequence[int],
        keys: Sequence[bytes] | None = None,
    ) -> None:
        """Queue a load of the blocks at ``positions`` (any order; the result's ``blocks``
        follow it). The result arrives by poll within ``deadline_s`` of this call.

        ``header`` None: an object this process has not indexed (another instance wrote
        it; the scheduler found it by listing). Its header is fetched and verified first,
        one more ranged GET within the same deadline, and comes back in the result's
        ``header`` for the caller to keep. ``keys``: the keys expected at ``positions``
        (a chunk holding others fails with ``key_mismatch``)."""
        t0 = time.perf_counter()
        bad = not positions or (header is not None and not all(0 <= p < header.nblocks for p in positions))
        if self._closed or bad:
            self._emit(IOResult(job_id, "read", object_id, False, reason=FailureReason.CLOSED if self._closed else FailureReason.BAD_REQUEST))
            return
        if header is not None and not keys_match(header, positions, keys):
            self._emit(IOResult(job_id, "read", object_id, False, reason=FailureReason.KEY_MISMATCH))
            return
        job = _ReadJob(
            job_id, object_id, self.key(object_id), header, list(positions),
            time.monotonic() + self.config.deadline_s, t0, keys=None if keys is None else list(keys),
        )
        with self._lock:
            self._pending.add(job)
        if header is None:
            self._readers.submit(functools.partial(self._fetch_header, job))
        else:
            self._start_runs(job, header)

    def _start_runs(self, job: _ReadJob, header: ChunkHeader) -> None:
        """Queue one ranged GET per contiguous run of wanted blocks (any thread)."""
        spans: list[Span] = []
        total = 0
        for lo, hi in contiguous_runs(job.positions):
            # Every block wanted: a plain GET of the whole object. Same request count; it
            # brings the 4 KiB header along (compared with the index's copy) and spares
            # servers that serve a range by copying it out of the object (moto does).
            whole = lo == 0 and hi == header.nblocks - 1
            start = 0 if whole else header.block_offset(lo)
            length = header.total_bytes if whole else header.block_offset(hi) + header.block_bytes - start
            spans.append(Span(lo, hi, start, total, length, whole))
            for p in range(lo, hi + 1):
                job.offsets[p] = total + header.block_offset(p) - start
            total += length
        job.buffer = self._buffers.take(total)
        job.remaining = len(spans)
        for span in spans:
            self._readers.submit(functools.partial(self._fetch_run, job, span))

    def _fetch_header(self, job: _ReadJob) -> None:
        got = self._read_header((job.object_id, None, job.key), job.deadline)
        if isinstance(got, ChunkHeader) and not all(0 <= p < got.nblocks for p in job.positions):
            got = "bad_request"
        elif isinstance(got, ChunkHeader) and not keys_match(got, job.positions, job.keys):
            got = FailureReason.KEY_MISMATCH
        with job.lock:
            if job.done:  # expired meanwhile: already reported
                return
            if isinstance(got, str):
                job.done = True
                job.reason = got
            else:
                job.header = got
        if isinstance(got, str):
            self._finish_read(job, None)
        else:
            self._start_runs(job, got)

    def submit_delete(self, object_id: str) -> None:
        self._writers.submit(functools.partial(self._run_delete, object_id))

    def poll(self) -> list[IOResult]:
        """Completed jobs since the last poll, and reads past their deadline (failed,
        reason ``deadline``; a late answer to them is dropped)."""
        now = time.monotonic()
        with self._lock:
            expired = [j for j in self._pending if j.deadline <= now]
        for job in expired:
            with job.lock:
                if job.done:
                    continue
                job.done = True
                job.reason = "deadline"
            self._finish_read(job, None)
        return drain(self._done)

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until some job has completed (True) or not; for idle
        engine steps only (hands the GIL to the I/O threads, as NVMeStore.wait)."""
        done = self._has_done.wait(timeout_s)
        self._has_done.clear()
        return done

    def stats(self) -> S3Stats:
        with self._lock:
            return S3Stats(dict(self._requests), self._retries, dict(self._failures), self.breaker.snapshot())

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued uploads and loads (up to ``timeout_s``), write this writer's
        manifest, stop the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout_s
        self._writers.close(deadline)
        if self._manifest_changes:
            self.flush_manifest()
        self._readers.close(deadline)
        self._data.close()

    # ---- I/O threads: requests ------------------------------------------------------------

    def _count_request(self, event_name: str = "", **_: Any) -> None:
        self._count_op(event_name.rsplit(".", 1)[-1])

    def _count_op(self, op: str) -> None:
        with self._lock:
            self._requests[op] = self._requests.get(op, 0) + 1

    def _on_retry(self, e: BaseException) -> None:
        with self._lock:
            self._retries += 1

    def _call(self, fn: Callable[[], Any], deadline: float) -> Any:
        return call_with_retries(
            fn,
            transient=is_transient,
            policy=self._policy,
            breaker=self.breaker,
            deadline=deadline,
            rng=self._rng,
            on_retry=self._on_retry,
        )

    def _size_of(self, key: str) -> int:
        """One HEAD (botocore's error if the object is gone or the endpoint unreachable)."""
        return int(self._client.head_object(Bucket=self.config.bucket, Key=key)["ContentLength"])

    def _put(self, key: str, body: memoryview | bytes, deadline: float, engine: ObjectIO | None = None) -> None:
        """PUT ``body`` (through ``engine``, default boto3), or a multipart upload through
        boto3 above ``multipart_threshold_bytes`` (the NIXL engine only does single PUTs)."""
        view = memoryview(body)
        io_ = engine or self._boto
        if view.nbytes > self.config.multipart_threshold_bytes:
            self._put_multipart(key, view)
        else:
            self._call(lambda: io_.put(key, view, deadline), deadline)

    def _put_multipart(self, key: str, view: memoryview) -> None:
        """Create, upload parts in order (each its own deadline and retries), complete.
        On failure the upload is aborted (best effort; a lifecycle rule with
        AbortIncompleteMultipartUpload removes what an abort could not)."""
        c, bucket, part = self._client, self.config.bucket, self.config.multipart_part_bytes
        soon = lambda: time.monotonic() + self.config.deadline_s  # noqa: E731
        upload_id = self._call(lambda: c.create_multipart_upload(Bucket=bucket, Key=key), soon())["UploadId"]

        def upload(number: int, chunk: memoryview) -> str:
            reader = ViewReader(chunk)
            try:
                return c.upload_part(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=reader,
                    ContentLength=chunk.nbytes,
                )["ETag"]
            finally:
                reader.close()

        try:
            parts = []
            for i, off in enumerate(range(0, view.nbytes, part)):
                etag = self._call(functools.partial(upload, i + 1, view[off : off + part]), soon())
                parts.append({"ETag": etag, "PartNumber": i + 1})
            self._call(
                lambda: c.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
                soon(),
            )
        except Exception:
            with contextlib.suppress(Exception):
                self._call(
                    lambda: c.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id), soon()
                )
            raise

    # ---- I/O threads: jobs ------------------------------------------------------------------

    def _emit(self, res: IOResult) -> None:
        if not res.ok:
            with self._lock:
                self._failures[str(res.reason)] = self._failures.get(str(res.reason), 0) + 1
        self._done.put(res)
        self._has_done.set()

    def _run_write(self, job_id: int, object_id: str, wb: WriteBuffer) -> None:
        t0 = time.perf_counter()
        try:
            crcs = [block_crc(wb.block(i)) for i in range(len(wb.keys))]
            h = make_header(self.namespace, wb.keys, crcs, self.block_bytes)
            encode_header(h, wb.buf.view)
            self._put(
                self.key(object_id), wb.buf.view[: h.total_bytes], time.monotonic() + self.config.deadline_s,
                self._data,
            )
            res = IOResult(job_id, "write", object_id, True, nbytes=h.total_bytes, header=h)
        except Exception as e:  # every failure becomes a result, never a dead thread
            res = IOResult(job_id, "write", object_id, False, reason=error_reason(e))
            self._log_failure("write", object_id, str(res.reason), e)
        finally:
            wb.buf.close()
            with self._lock:
                self._queued_writes -= 1
        res.seconds = time.perf_counter() - t0
        flush = False
        if res.ok and res.header is not None:
            with self._lock:
                self._manifest[object_id] = res.header
                self._manifest_changes += 1
                every = self.config.manifest_every_writes
                flush = every > 0 and self._manifest_changes >= every and not self._closed
        self._emit(res)
        if flush:
            self.flush_manifest(blocking=False)

    def _run_delete(self, object_id: str) -> None:
        t0 = time.perf_counter()
        with self._lock:
            if self._manifest.pop(object_id, None) is not None:
                self._manifest_changes += 1
        try:
            key = self.key(object_id)
            self._call(
                lambda: self._client.delete_object(Bucket=self.config.bucket, Key=key),
                time.monotonic() + self.config.deadline_s,
            )
            res = IOResult(-1, "delete", object_id, True)
        except Exception as e:
            res = IOResult(-1, "delete", object_id, False, reason=error_reason(e))
            self._log_failure("delete", object_id, str(res.reason), e)
        res.seconds = time.perf_counter() - t0
        self._emit(res)

    def _fetch_run(self, job: _ReadJob, span: Span) -> None:
        reason = ""
        if not job.done:  # a failed or expired job's other runs are not fetched
            try:
                self._fetch_and_verify(job, span)
            except Exception as e:
                reason = error_reason(e)
                if reason == "timeout" and time.monotonic() >= job.deadline:
                    # An engine that waits no longer than the deadline (NIXL's) gave up at
                    # it: the same outcome as poll's expiry, under the same name.
                    reason = "deadline"
                self._log_failure("read", job.object_id, reason, e)
        with job.lock:
            job.remaining -= 1
            if reason and not job.reason:
                job.reason = reason
            finish = not job.done and (bool(reason) or job.remaining == 0)
            if finish:
                job.done = True
            last = job.remaining == 0
        if finish:
            self._finish_read(job, None if job.reason else job.buffer)
        if last and job.reason and job.buffer is not None:
            # No result holds the buffer: return it once no run writes to it.
            job.buffer.close()

    def _fetch_and_verify(self, job: _ReadJob, span: Span) -> None:
        """One GET of a run of blocks into the job's buffer, every block's CRC32 (and, for a
        whole object, its header against the index's) checked as the bytes arrive. Its own
        function so that no slice of the buffer outlives it: a buffer with live slices
        cannot go back to the pool."""
        assert job.buffer is not None and job.header is not None
        header = job.header
        with job.buffer.view[span.buf_off : span.buf_off + span.length] as view:
            start = None if span.whole else span.obj_start

            def attempt() -> None:  # a retry starts over, with a fresh verifier
                verify = SpanVerifier(header, span, view)
                self._data.get_into(job.key, start, view, job.deadline, verify)
                verify.finish()

            self._call(attempt, job.deadline)

    def _finish_read(self, job: _ReadJob, buffer: AlignedBuffer | None) -> None:
        with self._lock:
            self._pending.discard(job)
        seconds = time.perf_counter() - job.t0
        if buffer is None:
            self._emit(IOResult(job.job_id, "read", job.object_id, False, reason=FailureReason(job.reason or "error"),
                                seconds=seconds))
            return
        assert job.header is not None
        bb = job.header.block_bytes
        blocks = [buffer.view[job.offsets[p] : job.offsets[p] + bb] for p in job.positions]
        self._emit(
            IOResult(
                job.job_id,
                "read",
                job.object_id,
                True,
                nbytes=sum(len(b) for b in blocks),
                seconds=seconds,
                blocks=blocks,
                buffer=buffer,
                header=job.header,
            )
        )

    def _log_failure(self, kind: str, object_id: str, reason: str, e: BaseException) -> None:
        if reason == "breaker_open":  # one line per refused request would flood the log
            logger.debug("kvtier s3: %s of %s refused: circuit breaker open", kind, object_id)
        elif reason in ("error", "client_error"):
            logger.warning("kvtier s3: %s of %s failed (%s): %r", kind, object_id, reason, e)
        else:
            logger.warning("kvtier s3: %s of %s failed (%s): %s", kind, object_id, reason, e)

    # ---- manifest -----------------------------------------------------------------------------

    def flush_manifest(self, *, blocking: bool = True) -> bool:
        """Write this writer's manifest now (blocks for one PUT). False if it failed, or if
        another flush is running and ``blocking`` is False."""
        if not self._flush_lock.acquire(blocking=blocking):
            return False
        try:
            with self._lock:
                entries = list(self._manifest.items())
                changes = self._manifest_changes
            data = encode_manifest(self.namespace, entries)
            self._put(self.manifest_key(), data, time.monotonic() + self.config.deadline_s)
            with self._lock:
                self._manifest_changes -= changes
            return True
        except Exception as e:
            logger.warning("kvtier s3: manifest write failed (%s): %s", error_reason(e), e)
            return False
        finally:
            self._flush_lock.release()

    # ---- index rebuild (caller's thread; blocks) --------------------------------------------

    def scan(self, *, cleanup: bool = False) -> dict[str, ChunkHeader]:
        """Every verified chunk of this (namespace, rank) in the bucket: {object_id: header},
        oldest first (by LastModified). Costs ``ceil(keys/1000)`` LISTs, one GET per
        manifest and one ranged GET per object no manifest covers (see
        :attr:`last_scan`). Never raises for a failed request: what could not be read is
        left out and counted in ``last_scan.problems`` (a failed listing gives {}).

        With ``cleanup`` (the worker that owns the prefix), objects that fail to verify
        and manifests that cover no existing object are deleted.
        """
        problems: dict[str, int] = {}

        def problem(what: str) -> None:
            problems[what] = problems.get(what, 0) + 1

        listing = _Listing()
        try:
            self._list_rank(listing, problem)
        except Exception as e:
            problem(f"list_{error_reason(e)}")
            logger.warning(
                "kvtier s3: listing %s failed: %s", rank_prefix(self.config, self.namespace, self.rank), e
            )
            self.last_scan = ScanReport(0, listing.requests, 0, 0, 0, problems)
            return {}
        objects = listing.objects
        found: dict[str, ChunkHeader] = {}
        with ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="kvtier-s3-scan") as pool:
            covered = self._manifest_headers(pool, listing, cleanup, problem)
            todo = []
            for oid, (size, _, key) in objects.items():
                h = covered.get(oid)
                if h is not None and h.block_bytes == self.block_bytes and size >= h.total_bytes:
                    found[oid] = h
                else:
                    todo.append((oid, size, key))
            for (oid, _, key), hdr in zip(todo, pool.map(self._read_header, todo), strict=True):
                if isinstance(hdr, ChunkHeader):
                    found[oid] = hdr
                    continue
                problem(hdr)
                if cleanup and hdr in ("checksum", "truncated", "namespace", "format"):
                    self.submit_delete_key(key)
        from_manifests = len(found) - sum(1 for oid, _, _ in todo if oid in found)
        self.last_scan = ScanReport(
            len(found), listing.requests, len(listing.manifests), len(todo), from_manifests, problems
        )
        return {oid: found[oid] for oid in sorted(found, key=lambda oid: objects[oid][1])}

    def _list_rank(self, out: _Listing, problem: Callable[[str], None]) -> None:
        """LIST the rank's prefix, page by page, sorting keys into chunks and manifests."""
        root = rank_prefix(self.config, self.namespace, self.rank)
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": root}
            if token:
                kw["ContinuationToken"] = token
            out.requests += 1
            page = self._call(
                functools.partial(self._client.list_objects_v2, **kw),
                time.monotonic() + self.config.deadline_s,
            )
            for o in page.get("Contents", []):
                key, rel = o["Key"], o["Key"][len(root) :]
                oid = rel.rsplit("/", 1)[-1][: -len(SUFFIX)]
                if rel.startswith("manifest/") and rel.endswith(MANIFEST_SUFFIX):
                    out.manifests.append(key)
                elif rel.endswith(SUFFIX) and key == self.key(oid):
                    out.objects[oid] = (o["Size"], o["LastModified"].timestamp(), key)
                else:
                    problem("unknown_key")
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return

    def _manifest_headers(
        self, pool: ThreadPoolExecutor, listing: _Listing, cleanup: bool, problem: Callable[[str], None]
    ) -> dict[str, ChunkHeader]:
        """Headers from every manifest, for the objects the listing shows. Our own manifest
        (same writer id, before a restart) is adopted, so our next one still covers them."""
        covered: dict[str, ChunkHeader] = {}
        for mkey, got in zip(
            listing.manifests, pool.map(self._read_manifest, listing.manifests), strict=True
        ):
            if isinstance(got, str):
                problem(f"manifest_{got}")
                continue
            live = {oid: h for oid, h in got.items() if oid in listing.objects}
            if mkey == self.manifest_key():
                with self._lock:
                    self._manifest.update(live)
            elif not live and cleanup:
                self.submit_delete_key(mkey)
            covered.update(live)
        return covered

    def submit_delete_key(self, key: str) -> None:
        """Delete any key of this store's prefix (a stale manifest, a damaged object)."""
        if not key.startswith(rank_prefix(self.config, self.namespace, self.rank)):
            raise ValueError(f"{key!r} is outside this store's prefix")

        def run() -> None:
            try:
                self._call(
                    lambda: self._client.delete_object(Bucket=self.config.bucket, Key=key),
                    time.monotonic() + self.config.deadline_s,
                )
            except Exception as e:
                logger.warning("kvtier s3: delete of %s failed (%s): %s", key, error_reason(e), e)

        self._writers.submit(run)

    def _read_manifest(self, key: str) -> dict[str, ChunkHeader] | str:
        try:
            r = self._call(
                lambda: self._client.get_object(Bucket=self.config.bucket, Key=key),
                time.monotonic() + self.config.deadline_s,
            )
            with contextlib.closing(r["Body"]) as body:
                data = body.read()
            return decode_manifest(data, self.namespace)
        except Exception as e:
            logger.warning("kvtier s3: ignoring manifest %s: %s", key, e)
            return error_reason(e)

    def _read_header(self, item: tuple[str, int | None, str], deadline: float | None = None) -> ChunkHeader | str:
        """The verified header of one object (one ranged GET, two for > 58 blocks).
        ``size`` None (not listed): unknown; a short object then fails its GET."""
        _, size_or_none, key = item
        size = HEAD_PROBE_BYTES if size_or_none is None else size_or_none
        if deadline is None:
            deadline = time.monotonic() + self.config.deadline_s
        try:
            if size < 64:
                raise ChunkFormatError("truncated header", FailureReason.TRUNCATED)
            head = bytearray(min(size, HEAD_PROBE_BYTES))
            self._call(functools.partial(self._boto.get_into, key, 0, memoryview(head), deadline), deadline)
            # Not verified yet: bound the header length by the object's size.
            need = header_bytes_for(int.from_bytes(head[28:32], "little"))
            if size_or_none is None:
                size = max(size, need)
            if need > size:
                raise ChunkFormatError(f"truncated header: {size} of {need} bytes", FailureReason.TRUNCATED)
            if need > len(head):
                rest = bytearray(need - len(head))
                self._call(functools.partial(self._boto.get_into, key, len(head), memoryview(rest), deadline),
                           deadline)
                head += rest
            h = decode_header(bytes(head), self.namespace)
            if h.block_bytes != self.block_bytes:
                raise ChunkFormatError(f"format: blocks of {h.block_bytes} B, expected {self.block_bytes}", FailureReason.FORMAT)
            if size_or_none is not None and size < h.total_bytes:
                raise ChunkFormatError(f"truncated: {size} of {h.total_bytes} bytes", FailureReason.TRUNCATED)
            return h
        except Exception as e:
            logger.warning("kvtier s3: ignoring %s: %s", key, e)
            return error_reason(e)
