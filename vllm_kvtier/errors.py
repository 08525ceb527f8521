"""The small exception family of vllm_kvtier, and the typed reason of every failed transfer.

Serving paths never raise these into vLLM: a failed transfer becomes a miss and a
counter, labelled with a :class:`FailureReason`. The exceptions are raised at start-up (bad
configuration) and by programming errors.

This module is at the bottom of the house: it imports nothing of the package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import StrEnum


class KVTierError(Exception):
    """Base class for errors raised by vllm_kvtier."""


class ConfigError(KVTierError, ValueError):
    """Invalid configuration. The message names the offending field (dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"kvtier config field '{field}': {message}")


class FailureReason(StrEnum):
    """Why a chunk write, read or delete failed.

    It is the label in counters, logs and :attr:`~vllm_kvtier.tiers.base.IOResult.reason`.
    Each medium maps its own exceptions or codes to these with ONE classifier function
    (``nvme.classify``, ``s3_config.error_reason``, ``mooncake.code_reason``). It never
    searches message text. :attr:`damaged` splits them in two for the reader of a failed
    read. DAMAGED: the stored bytes are wrong or gone; drop the chunk from the index and
    delete it. TRANSIENT: the way to it failed; keep it, a later read may succeed. On a
    shared bucket it is good data other instances use.

    The values are the counters' labels, so dashboards keep their series. A member
    compares (and hashes) equal to its string.
    """

    # ---- damaged: the chunk itself is wrong or gone --------------------------------------
    CHECKSUM = "checksum"  #: a block's (or the header's) CRC32 does not match
    TRUNCATED = "truncated"  #: the stored object ends before the bytes the header promises (or has holes)
    MISSING = "missing"  #: no such chunk (never stored, evicted, deleted)
    NAMESPACE = "namespace"  #: written by an engine with other bytes (model, dtype, geometry)
    FORMAT = "format"  #: not a chunk of this format, or of another block size
    KEY_MISMATCH = "key_mismatch"  #: a well-formed chunk, but not the key asked for at a read position (or another rank's)
    TOO_LARGE = "too_large"  #: a size read from stored bytes beyond what this engine could have written
    NOT_REGULAR = "not_regular"  #: a FIFO, device, socket or link where a chunk file should be
    BAD_REQUEST = "bad_request"  #: the medium refuses the request for this chunk (positions out of range...)
    IO_ERROR = "io_error"  #: the medium reports the bytes unreadable (EIO)
    AUTH_FAILED = "auth_failed"  #: signed with our key id, but a MAC does not verify: forged or altered
    # ---- transient: the way to the chunk failed ------------------------------------------
    DEADLINE = "deadline"  #: no answer within the read's deadline (a late answer is dropped)
    TIMEOUT = "timeout"  #: one request timed out (connect or read timeout)
    THROTTLED = "throttled"  #: the service asked us to slow down (S3 SlowDown, 429, 503)
    BREAKER_OPEN = "breaker_open"  #: refused at once: the circuit breaker is open
    UNAVAILABLE = "unavailable"  #: the service does not answer (connection refused, RPC failure)
    SERVER_ERROR = "server_error"  #: a 5xx from the service
    CLIENT_ERROR = "client_error"  #: another 4xx from the service
    CLOSED = "closed"  #: the store is closed
    NO_BUFFER = "no_buffer"  #: no transfer memory free right now (a registered arena is full)
    QUEUE_FULL = "queue_full"  #: too many writes queued (back-pressure)
    #: a write's source changed before the store copied it (a CPU slot reused): nothing written
    SUPERSEDED = "superseded"
    DISK_FULL = "disk_full"  #: ENOSPC / EDQUOT
    PERMISSION = "permission"  #: EACCES / EPERM / 401 / 403
    READ_ONLY = "read_only"  #: EROFS
    OS_ERROR = "os_error"  #: any other OSError
    NO_BUCKET = "no_bucket"  #: S3: the bucket does not exist
    CREDENTIALS = "credentials"  #: S3: no usable credentials
    TLS = "tls"  #: S3: certificate verification failed
    POOL_FULL = "pool_full"  #: Mooncake: no space in any segment
    NOT_READY = "not_ready"  #: Mooncake: another client is still writing it
    EXISTS = "exists"  #: Mooncake: already stored (a write answer)
    LEASE = "lease"  #: Mooncake: the object holds a read lease
    LEASE_EXPIRED = "lease_expired"  #: Mooncake: the lease expired before the transfer ended
    TRANSFER = "transfer"  #: Mooncake: the transfer engine failed
    ERROR = "error"  #: anything else (logged with its traceback where it is caught)
    #: not signed with a key we accept: no MAC while we verify, a MAC under another key, or
    #: a MAC we hold no key for. Never delivered, but kept: it may be another fleet's good
    #: data (the reader's index forgets it, so its blocks are written again).
    UNAUTHENTICATED = "unauthenticated"

    # A member hashes like its string, so ``reason in {"checksum", ...}`` works both ways.
    __hash__ = str.__hash__

    @property
    def damaged(self) -> bool:
        """True: the stored chunk is wrong or gone; a reader drops and deletes it. False:
        transient, the chunk stays indexed."""
        return self in DAMAGED


#: The reasons that mean the stored chunk itself is wrong or gone (see FailureReason.damaged).
DAMAGED: frozenset[FailureReason] = frozenset({
    FailureReason.CHECKSUM, FailureReason.TRUNCATED, FailureReason.MISSING, FailureReason.NAMESPACE,
    FailureReason.FORMAT, FailureReason.KEY_MISMATCH, FailureReason.TOO_LARGE, FailureReason.NOT_REGULAR,
    FailureReason.BAD_REQUEST, FailureReason.IO_ERROR, FailureReason.AUTH_FAILED,
})

#: The reasons counted in ``kvtier_auth_failures_total``: a chunk refused by its MAC.
AUTH_REASONS: frozenset[FailureReason] = frozenset({FailureReason.AUTH_FAILED, FailureReason.UNAUTHENTICATED})


def run_all(steps: Iterable[Callable[[], object] | None]) -> None:
    """Call every step in order, even when some raise; then raise the first failure.

    None is a part that is not there, and is skipped. This is for a shutdown: a part that
    cannot close must not keep the others' threads alive. The first failure is raised with
    the later ones in its notes. Only ``Exception`` is caught. An interrupt
    (``KeyboardInterrupt``, ``SystemExit``) stops at once, as it should."""
    first: BaseException | None = None
    for step in steps:
        if step is None:
            continue
        try:
            step()
        except Exception as e:  # noqa: PERF203 - each step is independent
            if first is None:
                first = e
            else:
                first.add_note(f"then also: {e!r}")
    if first is not None:
        raise first
