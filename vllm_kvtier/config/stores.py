"""Connection settings of the stores: where a bucket, a Mooncake pool or a NIXL agent is
and how to reach it. Each validates itself at construction (``ConfigError`` naming
``<section>.<field>``); none has a credential field, by design: S3 credentials come from
the standard AWS chain only, and Mooncake and NIXL have none to give.

The tiers (:mod:`vllm_kvtier.tiers`) import these; nothing here imports a tier.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal, get_args

from vllm_kvtier.errors import ConfigError
from vllm_kvtier.keys import SAFE_ID

MiB = 1 << 20
#: I/O threads per store at most (every tier's ``io_threads``): more only adds contention.
MAX_IO_THREADS = 256
#: Every deadline, timeout, interval and hold time at most (seconds): one day. Beyond it a
#: value is a typo or a unit mistake (ms for s), and a wait that long is a hang.
MAX_DURATION_S = 86400.0
#: Writes queued per store at most (every tier's ``max_queued_writes``): each holds a chunk
#: buffer (up to 256 blocks), so the bound is one on memory too.
MAX_QUEUED_WRITES = 4096
#: Attempts per request at most (``s3.max_attempts``): retries past this only delay a miss.
MAX_ATTEMPTS = 100
#: Chunk headers a worker keeps of a tier it reads headers from (LRU), by default: the
#: ``s3.header_cache_entries`` default, and what the other tiers use.
HEADER_CACHE_ENTRIES = 1 << 17
#: ... and the memory they hold at most (``s3.header_cache_bytes``).
HEADER_CACHE_BYTES = 256 * MiB
#: Entries a writer's manifest keeps at most (``s3.manifest_max_entries``): about 300 MB
#: of a manifest, and what a reader accepts of one.
MAX_MANIFEST_ENTRIES = 1 << 20


def check_bounds(section: str, obj: object, *, durations: tuple[str, ...] = (), queues: tuple[str, ...] = ()) -> None:
    """The upper bounds shared by every section: ``durations`` (seconds) at most
    :data:`MAX_DURATION_S`, ``queues`` at most :data:`MAX_QUEUED_WRITES`; ConfigError
    naming ``<section>.<field>``."""
    for name in durations:
        value = getattr(obj, name)
        if value is not None and not value <= MAX_DURATION_S:
            raise ConfigError(f"{section}.{name}", f"must be <= {MAX_DURATION_S:.0f} s (one day), got {value}")
    for name in queues:
        value = getattr(obj, name)
        if not value <= MAX_QUEUED_WRITES:
            raise ConfigError(f"{section}.{name}", f"must be <= {MAX_QUEUED_WRITES}, got {value}")

#: ``s3.io_engine`` values (see :attr:`S3Config.io_engine`).
IOEngineName = Literal["boto3", "nixl"]
IO_ENGINES: tuple[str, ...] = get_args(IOEngineName)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


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
    #: Names this writer's manifest; "" = a stable digest of the host name (a pod's name in
    #: Kubernetes), the NVMe path, the rank and the namespace. So a restarted instance
    #: replaces its manifest instead of adding one. Set one per instance when instances
    #: of one model share a host name and have no NVMe tier.
    writer_id: str = ""
    #: What moves chunk objects' bytes (:class:`~vllm_kvtier.tiers.s3.object_io.ObjectIO`).
    #: "boto3" (default): boto3 requests from the I/O threads. "nixl": NIXL's OBJ backend
    #: (aws-sdk-cpp; needs the nixl-cu12 package) for chunk PUTs up to
    #: ``multipart_threshold_bytes`` and for every chunk GET, whole or ranged; listing,
    #: header probes, manifests, deletes and multipart uploads stay on boto3. Credentials
    #: then come from aws-sdk-cpp's own default chain (the same sources), so ``profile``
    #: cannot be combined with it (export AWS_PROFILE instead). Same objects either way.
    io_engine: IOEngineName = "boto3"
    #: The most entries this writer's manifest keeps (its most recent writes; about 300 B
    #: each compressed for 16-block chunks); older objects are found by their header.
    manifest_max_entries: int = 1 << 16
    #: The most chunk headers a store keeps between rescans (LRU; about 3 KB each for
    #: 16-block chunks, so ~400 MB at most at the default; only listed objects are kept),
    #: so a rescan GETs no header it already read. Below the bucket's object count, each
    #: rescan GETs the headers of the rest again.
    header_cache_entries: int = HEADER_CACHE_ENTRIES
    #: The same caches bounded by the memory their headers hold (about 2.1 KB a 16-block
    #: header, 29 KB at 256 blocks): whichever bound is reached first evicts.
    header_cache_bytes: int = HEADER_CACHE_BYTES
    #: A manifest not rewritten for this long (its writer is gone) is deleted by a rescan.
    manifest_max_age_s: float = 7 * 86400.0
    #: The start-up scan (every rank's listing, manifests and header GETs together) ends
    #: by then: what it reached is indexed, the rest is found by the rescans.
    scan_deadline_s: float = 300.0

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> ConfigError:
            return ConfigError(f"s3.{name}", msg)

        for name in ("manifest_max_entries", "header_cache_entries", "header_cache_bytes"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.manifest_max_entries > MAX_MANIFEST_ENTRIES:
            raise bad("manifest_max_entries", f"must be <= {MAX_MANIFEST_ENTRIES}, got {self.manifest_max_entries}")
        if not self.manifest_max_age_s > 0:
            raise bad("manifest_max_age_s", "must be > 0")

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
        if self.ca_bundle is not None and ("\0" in self.ca_bundle or not os.path.isabs(self.ca_bundle)):
            raise bad("ca_bundle", f"must be an absolute path without NUL bytes, got {self.ca_bundle!r}")
        if self.ca_bundle is not None and not os.path.isfile(self.ca_bundle):
            raise bad("ca_bundle", f"{self.ca_bundle!r} is not a file")
        for name in ("connect_timeout_s", "read_timeout_s", "deadline_s", "backoff_max_s", "scan_deadline_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0")
        for name in ("backoff_base_s", "breaker_cooldown_s"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        for name in ("max_attempts", "breaker_failures", "io_threads", "max_queued_writes"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.io_threads > MAX_IO_THREADS:
            raise bad("io_threads", f"must be <= {MAX_IO_THREADS}, got {self.io_threads}")
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
        check_bounds("s3", self, durations=("connect_timeout_s", "read_timeout_s", "deadline_s", "backoff_base_s",
                                            "backoff_max_s", "breaker_cooldown_s", "scan_deadline_s"),
                     queues=("max_queued_writes",))
        if self.max_attempts > MAX_ATTEMPTS:
            raise bad("max_attempts", f"must be <= {MAX_ATTEMPTS}, got {self.max_attempts}")


@dataclass(frozen=True)
class MooncakeConfig:
    """Where the pool is and how to reach it. No secret here (Mooncake has none to give)."""

    #: ``host:port`` of the ``mooncake_master`` RPC service.
    master: str
    #: Where transfer engines find each other: ``P2PHANDSHAKE`` (no metadata service,
    #: peers handshake directly), ``http://host:port/metadata`` (the master's built-in HTTP
    #: metadata server, ``-enable_http_metadata_server``) or an etcd address.
    metadata_server: str = "P2PHANDSHAKE"
    #: This client's address as other pool members reach it; "" = the address of the local
    #: interface that routes to the master.
    local_hostname: str = ""
    protocol: Literal["tcp", "rdma"] = "tcp"
    #: RDMA devices for ``protocol: rdma``, e.g. ``mlx5_0`` or ``mlx5_0,mlx5_1``; "" lets
    #: Mooncake pick. Ignored with tcp.
    device_name: str = ""
    #: DRAM this client contributes to the pool (0: a pure client; other nodes host the pool).
    global_segment_bytes: int = 1 << 30
    #: Mooncake's own staging buffer (its bytes-based API; this tier does not use it much).
    local_buffer_bytes: int = 16 * MiB
    #: The registered arena every transfer of this store goes through; a chunk larger than
    #: it cannot be stored, and reads in flight share it.
    transfer_buffer_bytes: int = 256 * MiB
    #: Per read, from submission.
    deadline_s: float = 5.0
    #: Bound on the start-up probe of the master (Mooncake's own setup retries for 90 s).
    connect_timeout_s: float = 2.0
    #: Threads for reads and, separately, as many for writes and deletes.
    io_threads: int = 2
    #: Jobs moved by one batch call.
    max_batch: int = 16
    #: Writes waiting beyond this are refused (counted as store_skipped). One object per
    #: block: a 4096-token prompt queues 64+ puts in one step.
    max_queued_writes: int = 256
    #: Copies Mooncake keeps of each chunk (in different segments where it can).
    replicas: int = 1
    #: Consecutive unhealthy batches that open the circuit breaker.
    breaker_failures: int = 5
    breaker_cooldown_s: float = 5.0

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> ConfigError:
            return ConfigError(f"mooncake.{name}", msg)

        m = _HOST_PORT.match(self.master)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise bad("master", f"{self.master!r} is not host:port (e.g. '10.0.0.5:50051')")
        if not self.metadata_server or any(c.isspace() for c in self.metadata_server):
            raise bad("metadata_server", "must be 'P2PHANDSHAKE', an http://... URL or an etcd address")
        if any(c.isspace() for c in self.local_hostname):
            raise bad("local_hostname", "must not contain whitespace")
        if self.protocol not in ("tcp", "rdma"):
            raise bad("protocol", f"{self.protocol!r}: allowed 'tcp', 'rdma'")
        if any(c.isspace() for c in self.device_name):
            raise bad("device_name", "a comma-separated list of RDMA device names, without spaces")
        for name in ("global_segment_bytes", "local_buffer_bytes"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if self.transfer_buffer_bytes < MiB:
            raise bad("transfer_buffer_bytes", "must be >= 1 MiB (1048576)")
        for name in ("deadline_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0")
        if self.breaker_cooldown_s < 0:
            raise bad("breaker_cooldown_s", "must be >= 0")
        for name in ("io_threads", "max_batch", "max_queued_writes", "replicas", "breaker_failures"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.io_threads > MAX_IO_THREADS:
            raise bad("io_threads", f"must be <= {MAX_IO_THREADS}, got {self.io_threads}")
        check_bounds("mooncake", self, durations=("deadline_s", "connect_timeout_s", "breaker_cooldown_s"),
                     queues=("max_queued_writes", "max_batch"))

    @property
    def master_host_port(self) -> tuple[str, int]:
        host, port = self.master.rsplit(":", 1)
        return host.strip("[]"), int(port)


@dataclass(frozen=True)
class NixlConfig:
    """How this worker's agent transfers."""

    #: NIXL backends to create; UCX moves DRAM (and VRAM) between agents.
    backends: tuple[str, ...] = ("UCX",)
    #: Per transfer, from submission; past it the transfer is aborted and its blocks are
    #: recomputed (``load_failures``, reason ``deadline`` in the log). 30 s, not 5: the first
    #: read from a new peer also sets up the connection, whose round trips progress only as
    #: both engines step (no progress thread), and on a loaded host that took 11.8 s (2 cores,
    #: load 15; later reads 1-15 ms), so 5 s lost the hand-off. A gone peer fails at once
    #: (``peer_gone``), not here; keep ``nixl.hold_s`` above this.
    deadline_s: float = 30.0
    #: Backend worker threads (0: the backend's default).
    num_threads: int = 0
    #: NIXL's UCX progress thread. Off by default: it polls without pause (NIXL's Python
    #: API fixes its delay at 0), which costs one CPU core per worker, idle or not. Without
    #: it, transfers progress when this agent is polled: the worker polls every step, and
    #: the scheduler keeps a prefill engine stepping while it holds offers (RDMA reads
    #: need no progress on the side read from at all).
    progress_thread: bool = False

    def __post_init__(self) -> None:
        if not self.backends or not all(isinstance(b, str) and b.isalnum() for b in self.backends):
            raise ConfigError("nixl.backends", "a non-empty list of NIXL backend names, e.g. [UCX]")
        if "UCX" not in self.backends:
            raise ConfigError("nixl.backends", "must include UCX (agent to agent transfers)")
        if not self.deadline_s > 0:
            raise ConfigError("nixl.deadline_s", "must be > 0")
        if self.num_threads < 0:
            raise ConfigError("nixl.num_threads", "must be >= 0")
        if self.num_threads > MAX_IO_THREADS:
            raise ConfigError("nixl.num_threads", f"must be <= {MAX_IO_THREADS}, got {self.num_threads}")
        check_bounds("nixl", self, durations=("deadline_s",))
