"""The S3 tier's configuration, key layout and failure labels (no boto3 needed to import).

Who uses it: :mod:`vllm_kvtier.tiers.s3` (the store) and whoever parses the plugin's config.
:class:`S3Config` is validated at construction (``ConfigError`` names the field); it has no
credential field by design: credentials come from the standard AWS chain only.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
from dataclasses import dataclass
from typing import Literal, get_args

from vllm_kvtier.errors import ConfigError, FailureReason
from vllm_kvtier.tiers.chunkfile import ChunkFormatError
from vllm_kvtier.tiers.resilience import BreakerOpen, DeadlineExceeded

SUFFIX = ".kvt"
MANIFEST_SUFFIX = ".kvm"
#: First ranged GET of a header at scan time; a 4 KiB header holds up to 58 blocks' entries.
HEAD_PROBE_BYTES = 4096
MiB = 1 << 20
INSTALL_HINT = "the S3 tier needs boto3: pip install 'vllm-kvtier[s3]'"

#: ``s3.io_engine`` values (see :attr:`S3Config.io_engine`).
IOEngineName = Literal["boto3", "nixl"]
IO_ENGINES: tuple[str, ...] = get_args(IOEngineName)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequests",
        "TooManyRequestsException",
        "BandwidthLimitExceeded",
    }
)
_SERVER_CODES = frozenset({"InternalError", "ServiceUnavailable", "PriorRequestNotComplete"})
_TRANSIENT_REASONS = frozenset({"throttled", "server_error", "timeout", "unavailable"})


@dataclass(frozen=True)
class S3Config:
    """Where and how to reach the bucket. No credential field, by design (see module doc)."""

    bucket: str
    #: Prepended verbatim to every key; end it with "/" to make it a folder.
    prefix: str = ""
    region: str | None = None
    #: A non-AWS endpoint (MinIO, Ceph RGW, https://storage.googleapis.com for GCS).
    endpoint_url: str | None = None
    #: Path-style addressing (``endpoint/bucket/key``), which most on-prem servers need.
    path_style: bool = False
    #: PEM file of the CA that signed the endpoint's certificate (on-prem TLS).
    ca_bundle: str | None = None
    #: A named profile of the shared AWS config (not a secret: credentials stay in the chain).
    profile: str | None = None
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 5.0
    #: Attempts per request, first one included.
    max_attempts: int = 5
    #: Per read (from submission, all its ranged GETs together) and per write request.
    deadline_s: float = 5.0
    backoff_base_s: float = 0.05
    backoff_max_s: float = 1.0
    #: Consecutive failed requests that open the circuit breaker.
    breaker_failures: int = 5
    breaker_cooldown_s: float = 5.0
    #: Threads for reads (ranged GETs) and, separately, as many for writes and deletes.
    io_threads: int = 8
    max_queued_writes: int = 32
    multipart_threshold_bytes: int = 64 * MiB
    multipart_part_bytes: int = 16 * MiB
    #: Rewrite this writer's manifest after this many chunk writes (0: only at close).
    manifest_every_writes: int = 64
    #: Names this writer's manifest; "" = random per store. Set a stable one (pod name +
    #: rank) so a restarted instance replaces its manifest instead of adding one.
    writer_id: str = ""
    #: What moves chunk objects' bytes (:class:`~vllm_kvtier.tiers.s3_io.ObjectIO`).
    #: "boto3" (default): boto3 requests from the I/O threads. "nixl": NIXL's OBJ backend
    #: (aws-sdk-cpp; needs the nixl-cu12 package) for chunk PUTs up to
    #: ``multipart_threshold_bytes`` and for every chunk GET, whole or ranged; listing,
    #: header probes, manifests, deletes and multipart uploads stay on boto3. Credentials
    #: then come from aws-sdk-cpp's own default chain (the same sources), so ``profile``
    #: cannot be combined with it (export AWS_PROFILE instead). Same objects either way.
    io_engine: IOEngineName = "boto3"

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> ConfigError:
            return ConfigError(f"s3.{name}", msg)

        if not _BUCKET.match(self.bucket):
            raise bad("bucket", f"{self.bucket!r} is not a valid bucket name (3-63 of a-z 0-9 . _ -)")
        if self.prefix.startswith("/") or any(c in self.prefix for c in "\0\r\n\\"):
            raise bad("prefix", "must not start with '/' nor contain control characters or '\\'")
        if self.endpoint_url is not None:
            m = re.match(r"^https?://([^/]+)", self.endpoint_url)
            if not m:
                raise bad("endpoint_url", "must start with http:// or https://")
            if "@" in m.group(1):
                raise bad("endpoint_url", "must not embed credentials; use the AWS credential chain")
        if self.ca_bundle is not None and not os.path.isfile(self.ca_bundle):
            raise bad("ca_bundle", f"{self.ca_bundle!r} is not a file")
        for name in ("connect_timeout_s", "read_timeout_s", "deadline_s", "backoff_max_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0")
        for name in ("backoff_base_s", "breaker_cooldown_s"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        for name in ("max_attempts", "breaker_failures", "io_threads", "max_queued_writes"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.manifest_every_writes < 0:
            raise bad("manifest_every_writes", "must be >= 0")
        if not 5 * MiB <= self.multipart_part_bytes <= 5 << 30:
            raise bad("multipart_part_bytes", "must be between 5 MiB and 5 GiB (S3's part limits)")
        if self.multipart_threshold_bytes < self.multipart_part_bytes:
            raise bad("multipart_threshold_bytes", "must be >= multipart_part_bytes")
        if self.writer_id and not SAFE_ID.match(self.writer_id):
            raise bad("writer_id", "1-128 of A-Z a-z 0-9 _ . -")
        if self.io_engine not in IO_ENGINES:
            raise bad("io_engine", f"must be one of {', '.join(map(repr, IO_ENGINES))}, got {self.io_engine!r}")
        if self.io_engine == "nixl" and self.profile is not None:
            raise bad("io_engine", "'nixl' reads credentials through aws-sdk-cpp's default chain, which takes no "
                                   "per-client profile: drop s3.profile and export AWS_PROFILE instead")


def rank_prefix(cfg: S3Config, namespace: str, rank: int) -> str:
    return f"{cfg.prefix}{namespace}/r{rank}/"


def object_key(cfg: S3Config, namespace: str, rank: int, object_id: str) -> str:
    spread = hashlib.blake2b(object_id.encode(), digest_size=1).hexdigest()
    return f"{rank_prefix(cfg, namespace, rank)}{spread}/{object_id}{SUFFIX}"


# ---- failure classification -----------------------------------------------------------


def error_reason(e: BaseException) -> FailureReason:
    """The S3 medium's classifier: the reason of a failed request (counters, logs,
    ``IOResult.reason``), from the exception's type and botocore's error code and status."""
    if isinstance(e, ChunkFormatError):
        return e.reason
    if isinstance(e, BreakerOpen):
        return FailureReason.BREAKER_OPEN
    if isinstance(e, DeadlineExceeded):
        return FailureReason.DEADLINE
    try:
        from botocore import exceptions as bx
    except ImportError:
        return FailureReason.ERROR
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _THROTTLE_CODES or status in (429, 503):
            return FailureReason.THROTTLED
        if code == "NoSuchBucket":
            return FailureReason.NO_BUCKET
        if code in ("NoSuchKey", "NotFound", "404") or status == 404:
            return FailureReason.MISSING
        if code == "InvalidRange" or status == 416:
            return FailureReason.TRUNCATED
        if status in (401, 403):
            return FailureReason.PERMISSION
        if code in _SERVER_CODES or status >= 500:
            return FailureReason.SERVER_ERROR
        if code in ("RequestTimeout", "RequestTimeoutException"):
            return FailureReason.TIMEOUT
        return FailureReason.CLIENT_ERROR
    if isinstance(e, (bx.ReadTimeoutError, bx.ConnectTimeoutError)):
        return FailureReason.TIMEOUT
    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)):
        return FailureReason.CREDENTIALS
    if isinstance(e, bx.SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(e):
        return FailureReason.TLS  # a wrong CA bundle or endpoint: retrying will not help
    if isinstance(e, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError)):
        return FailureReason.UNAVAILABLE
    # Raised by read_body_into's direct path, where botocore does not wrap them.
    if isinstance(e, TimeoutError):
        return FailureReason.TIMEOUT
    if isinstance(e, (ConnectionError, http.client.HTTPException)):
        return FailureReason.UNAVAILABLE
    return FailureReason.ERROR


def is_transient(e: BaseException) -> bool:
    """Worth retrying, and a sign the endpoint is unhealthy (counts toward the breaker)."""
    return error_reason(e) in _TRANSIENT_REASONS
