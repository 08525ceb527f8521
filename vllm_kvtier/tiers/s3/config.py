"""The S3 tier's key layout and failure labels (no boto3 needed to import).

Who uses it: the S3 tier's store, medium and scan (:mod:`vllm_kvtier.tiers.s3.store`,
:mod:`~vllm_kvtier.tiers.s3.medium`, :mod:`~vllm_kvtier.tiers.s3.scan`). The connection settings,
:class:`~vllm_kvtier.config.stores.S3Config`, live in the config package (re-exported
here for the store's callers).
"""

from __future__ import annotations

import hashlib
import http.client

from vllm_kvtier.chunkformat import ChunkFormatError
from vllm_kvtier.config.stores import IO_ENGINES, SAFE_ID, IOEngineName, S3Config
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.resilience import BreakerOpen, DeadlineExceeded

SUFFIX = ".kvt"
MANIFEST_SUFFIX = ".kvm"
#: First ranged GET of a header at scan time; a 4 KiB header holds up to 58 blocks' entries.
HEAD_PROBE_BYTES = 4096

__all__ = ["IO_ENGINES", "SAFE_ID", "IOEngineName", "S3Config"]  # re-exported for the store's callers
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
