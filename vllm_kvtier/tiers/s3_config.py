"""The S3 tier's key layout and failure labels (no boto3 needed to import).

Who uses it: :mod:`vllm_kvtier.tiers.s3` (the store). The connection settings,
:class:`~vllm_kvtier.config.stores.S3Config`, live in the config package (re-exported
here for the store's callers).
"""

from __future__ import annotations

import hashlib
import http.client

from vllm_kvtier.config.stores import IO_ENGINES, SAFE_ID, IOEngineName, S3Config
from vllm_kvtier.tiers.chunkfile import ChunkFormatError
from vllm_kvtier.tiers.resilience import BreakerOpen, DeadlineExceeded

SUFFIX = ".kvt"
MANIFEST_SUFFIX = ".kvm"
#: First ranged GET of a header at scan time; a 4 KiB header holds up to 58 blocks' entries.
HEAD_PROBE_BYTES = 4096
INSTALL_HINT = "the S3 tier needs boto3: pip install 'vllm-kvtier[s3]'"

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


def error_reason(e: BaseException) -> str:
    """A short, stable label for a failure (counters, logs, ``IOResult.reason``)."""
    if isinstance(e, ChunkFormatError):
        return e.reason
    if isinstance(e, BreakerOpen):
        return "breaker_open"
    if isinstance(e, DeadlineExceeded):
        return "deadline"
    try:
        from botocore import exceptions as bx
    except ImportError:
        return "error"
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _THROTTLE_CODES or status in (429, 503):
            return "throttled"
        if code == "NoSuchBucket":
            return "no_bucket"
        if code in ("NoSuchKey", "NotFound", "404") or status == 404:
            return "missing"
        if code == "InvalidRange" or status == 416:
            return "truncated"
        if status in (401, 403):
            return "permission"
        if code in _SERVER_CODES or status >= 500:
            return "server_error"
        if code in ("RequestTimeout", "RequestTimeoutException"):
            return "timeout"
        return "client_error"
    if isinstance(e, (bx.ReadTimeoutError, bx.ConnectTimeoutError)):
        return "timeout"
    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)):
        return "credentials"
    if isinstance(e, bx.SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(e):
        return "tls"  # a wrong CA bundle or endpoint: retrying will not help
    if isinstance(e, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError)):
        return "unavailable"
    # Raised by read_body_into's direct path, where botocore does not wrap them.
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, (ConnectionError, http.client.HTTPException)):
        return "unavailable"
    return "error"


def is_transient(e: BaseException) -> bool:
    """Worth retrying, and a sign the endpoint is unhealthy (counts toward the breaker)."""
    return error_reason(e) in _TRANSIENT_REASONS
