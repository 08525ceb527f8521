"""The sections of the tiers below CPU that the worker's chunk driver runs: ``nvme``, ``s3``
and ``mooncake``, and :class:`LowerTierSection`, what each of them says."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from vllm_kvtier.config.checks import at_least, at_most, positive
from vllm_kvtier.config.stores import (
    HEADER_CACHE_BYTES,
    HEADER_CACHE_ENTRIES,
    MAX_IO_THREADS,
    MooncakeConfig,
    S3Config,
    check_bounds,
)
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.keys import EvictionName

#: Blocks per chunk at most (``nvme.chunk_blocks``, ``s3.chunk_blocks``): also the bound a
#: reader puts on a chunk header's block count before it allocates anything.
MAX_CHUNK_BLOCKS = 256


class LowerTierSection(Protocol):
    """What the section of every tier below CPU says, whatever its medium: the settings
    the worker's chunk driver reads. A medium without one states its fixed value."""

    @property
    def mode(self) -> Literal["write-back", "write-through"]: ...

    @property
    def admit_min_seen(self) -> int: ...

    @property
    def chunk_blocks(self) -> int: ...

    @property
    def capacity_bytes(self) -> int | None:
        """For the whole engine; None: unbounded."""
        ...

    @property
    def flush_interval_s(self) -> float: ...

    @property
    def flush_on_shutdown_s(self) -> float: ...

    @property
    def storage_dtype(self) -> Literal["native", "fp8"]: ...

    @property
    def header_cache_entries(self) -> int:
        """Chunk headers the worker keeps when it reads them from the tier (LRU)."""
        ...

    @property
    def header_cache_bytes(self) -> int:
        """... and the memory they hold at most."""
        ...

    @property
    def endpoint(self) -> str:
        """Where the tier is, for log lines: a path, a bucket, a pool."""
        ...


@runtime_checkable
class ChoosesEviction(Protocol):
    """A section that picks the order in which its tier's chunks leave (``nvme``). A tier
    whose section does not (``s3``, ``mooncake``, out-of-tree ones) evicts LRU."""

    @property
    def eviction(self) -> EvictionName: ...


class _FixedHeaderCache:
    """The header cache of a medium whose section does not set one: the defaults."""

    @property
    def header_cache_entries(self) -> int:
        return HEADER_CACHE_ENTRIES

    @property
    def header_cache_bytes(self) -> int:
        return HEADER_CACHE_BYTES


@dataclass(frozen=True)
class NVMeTierConfig(_FixedHeaderCache):
    """The NVMe tier: chunk files under ``path``, at most ``capacity_bytes`` of them.

    It survives restarts. A new engine pointed at the same ``path`` serves hits from what
    was stored. It needs the same model and layout: files live under a namespace digest.
    """

    path: str
    capacity_bytes: int
    #: "write-back": a block goes to NVMe when the CPU tier evicts it (and, at shutdown,
    #: every admitted block still only in DRAM is flushed). "write-through": every block
    #: saved to the CPU tier is also written to NVMe at once (for shared or durable caches).
    mode: Literal["write-back", "write-through"] = "write-back"
    #: Write a block only once it was part of at least this many requests' prompts. 1
    #: writes what DRAM evicts: a chat turn comes back long after a small DRAM pool has
    #: cycled, and only then is the hierarchy never below one LRU cache of the SSD's
    #: size. 2 keeps blocks seen once off the flash, and loses every first reuse
    #: (docs/planning.md has the measured trade-off).
    admit_min_seen: int = 1
    #: Blocks per chunk file: consecutive blocks go to disk together so I/Os are large.
    chunk_blocks: int = 16
    #: Which chunk file leaves a full tier. "kvaware": files of blocks already reused in
    #: DRAM, and files read again, live longer; one-off files leave first, oldest first.
    #: "lru": least recently written or read (the behaviour before kvaware). "s3fifo" and
    #: "arc": as for ``cpu.eviction``, over files. Measured in docs/planning.md ("NVMe
    #: eviction: kvaware over the tier's files"); ``kvtier plan --trace --nvme-eviction``
    #: replays each on your own traffic.
    eviction: EvictionName = "kvaware"
    direct_io: Literal["auto", "on", "off"] = "auto"
    #: I/O threads: more than the cores, since they mostly wait on the device and syncs.
    io_threads: int = 4
    #: Writes waiting for the disk beyond this are refused (counted), never queued forever.
    max_queued_writes: int = 64
    #: Upper bound on the time spent at shutdown flushing write-back blocks (every block
    #: still only in DRAM, whatever its admission count).
    flush_on_shutdown_s: float = 10.0
    #: Write-back: a block still only in DRAM is written in the background once it has
    #: been there this long, and every such block as soon as the engine has no request. So
    #: an abort (vLLM's default SIGTERM) or a crash loses at most this window of what was
    #: served under continuous traffic, and nothing after an idle moment. Cost: each block
    #: that outlives it in DRAM is written once (admission still keeps one-off blocks that
    #: are evicted sooner off the SSD). 0: only on eviction and at a clean shutdown.
    flush_interval_s: float = 10.0
    #: How blocks are stored. "native": the KV cache's bytes as they are. "fp8": e4m3 with
    #: a float32 scale per 1024 elements (vllm_kvtier/transfer/fp8.py): half the bytes and
    #: I/O of bf16/fp16, a quarter of fp32, at the cost of a small numeric drift in what is
    #: loaded back (measured in bench/fp8_drift.py). A cache already in FP8 is stored as is.
    #: Each setting has its own namespace: neither ever reads the other's blocks.
    storage_dtype: Literal["native", "fp8"] = "native"
    #: What moves the bytes between the chunk buffers and the files
    #: (:mod:`vllm_kvtier.tiers.nvme.file_io`). "posix" (default): ``pwrite``/``preadv`` in the
    #: I/O threads. "nixl": NIXL's POSIX backend (Linux AIO; needs the nixl package).
    #: "nixl-gds": NIXL's GDS backend (cuFile; only where that plugin loads, i.e. a CUDA host
    #: with libcufile). File names, syncs, headers and checksums are the same for all three,
    #: so a directory written with one reads with any other. Measured in bench/nixl_io.py.
    io_engine: Literal["posix", "nixl", "nixl-gds"] = "posix"
    #: Delete, at start, the directories other namespaces left under ``path`` (an earlier
    #: model, revision, TP size, dtype or storage format: KV this engine can never read).
    #: Off: they are only reported (a WARNING with each one's bytes and age). Never a
    #: directory a live engine holds (its rank directories' locks), never a name or file
    #: this tier does not write.
    gc_foreign_namespaces: bool = False


    def __post_init__(self) -> None:
        positive("nvme.capacity_bytes", self.capacity_bytes)
        if not self.path:
            raise ConfigError("nvme.path", "must not be empty")
        if "\0" in self.path:
            raise ConfigError("nvme.path", "must not contain a NUL byte")
        if not os.path.isabs(self.path):
            # Each process (scheduler, every worker) would resolve it against its own cwd.
            raise ConfigError("nvme.path", f"must be an absolute path, got {self.path!r}")
        for name in ("admit_min_seen", "io_threads", "max_queued_writes"):
            at_least(f"nvme.{name}", getattr(self, name), 1)
        at_least("nvme.chunk_blocks", self.chunk_blocks, 1)
        at_most("nvme.chunk_blocks", self.chunk_blocks, MAX_CHUNK_BLOCKS)
        at_most("nvme.io_threads", self.io_threads, MAX_IO_THREADS)
        at_least("nvme.flush_on_shutdown_s", self.flush_on_shutdown_s, 0)
        at_least("nvme.flush_interval_s", self.flush_interval_s, 0)
        check_bounds("nvme", self, durations=("flush_on_shutdown_s", "flush_interval_s"),
                     queues=("max_queued_writes",))

    @property
    def endpoint(self) -> str:
        return self.path


@dataclass(frozen=True)
class S3TierConfig:
    """The object-store tier: chunk objects in ``store.bucket`` under ``store.prefix``.

    In YAML the section is flat. The fields of
    :class:`~vllm_kvtier.tiers.s3.config.S3Config` sit next to the policy fields below.
    Those are bucket, prefix, region, endpoint_url, path_style, ca_bundle, profile,
    timeouts, retries, breaker, threads, multipart, manifests and io_engine. No credential
    field exists. Credentials come from the standard AWS chain (environment, profile,
    IRSA, instance metadata).
    """

    store: S3Config
    #: "write-through" (default): every admitted block saved to the CPU tier is uploaded
    #: at once, so other instances sharing the bucket can use it while this one runs.
    #: "write-back": a block is uploaded when the CPU tier evicts it (fewer PUTs; other
    #: instances see it later or never).
    mode: Literal["write-back", "write-through"] = "write-through"
    #: Upload a block only once it was part of at least this many requests' prompts. 1
    #: (default): S3 has no wear, and a bucket shared by many instances is where a
    #: prefix seen once here is seen again elsewhere. Raise it to cut PUT costs.
    admit_min_seen: int = 1
    #: Blocks per object: fewer, bigger requests (S3 bills and throttles per request).
    chunk_blocks: int = 16
    #: Bound on what this engine keeps in the bucket for its namespace (LRU over the
    #: objects it knows: its own and those found by scans). None: unbounded here; bound
    #: the bucket with a lifecycle expiration rule instead (see the README).
    capacity_bytes: int | None = None
    #: Re-list the bucket this often (seconds) to find objects other instances stored
    #: since start-up; 0 turns it off. Cost per rescan: ceil(objects/1000) LISTs, one GET
    #: per manifest and one ranged GET per object no manifest covers.
    rescan_interval_s: float = 60.0
    #: Upper bound on the time spent at shutdown flushing write-back blocks.
    flush_on_shutdown_s: float = 10.0
    #: Write-back only: as :attr:`NVMeTierConfig.flush_interval_s`.
    flush_interval_s: float = 10.0
    #: "native" or "fp8": as :attr:`NVMeTierConfig.storage_dtype` (fp8 halves PUT/GET bytes
    #: of a bf16 cache). Instances sharing a bucket share blocks only with the same setting.
    storage_dtype: Literal["native", "fp8"] = "native"


    def __post_init__(self) -> None:
        if self.capacity_bytes is not None:
            positive("s3.capacity_bytes", self.capacity_bytes)
        at_least("s3.admit_min_seen", self.admit_min_seen, 1)
        at_least("s3.chunk_blocks", self.chunk_blocks, 1)
        at_most("s3.chunk_blocks", self.chunk_blocks, MAX_CHUNK_BLOCKS)
        for name in ("rescan_interval_s", "flush_on_shutdown_s", "flush_interval_s"):
            at_least(f"s3.{name}", getattr(self, name), 0)
        check_bounds("s3", self, durations=("rescan_interval_s", "flush_on_shutdown_s", "flush_interval_s"))

    @property
    def header_cache_entries(self) -> int:
        return self.store.header_cache_entries

    @property
    def header_cache_bytes(self) -> int:
        return self.store.header_cache_bytes

    @property
    def endpoint(self) -> str:
        return f"bucket {self.store.bucket!r}"


@dataclass(frozen=True)
class MooncakeTierConfig(_FixedHeaderCache):
    """A Mooncake Store pool, shared by every instance that points at the same master.

    The pool is a ``mooncake_master`` plus clients pooling their DRAM, over TCP or RDMA.
    It is the KV store pool of prefill/decode disaggregation. The prefill instance writes,
    and the decode one loads.

    In YAML the section is flat. The fields of
    :class:`~vllm_kvtier.tiers.mooncake.store.MooncakeConfig` sit next to the policy
    fields below. Those are master, metadata_server, local_hostname, protocol,
    device_name, segment and buffer sizes, deadline_s, threads, replicas and breaker. There
    is one object per block, named by the block's chained hash. So any instance finds a
    prefix from its own block hashes. Leases and eviction are Mooncake's. ``kv_role:
    kv_consumer`` makes this instance read-only.
    """

    store: MooncakeConfig
    #: "write-through" (default): every admitted block saved to DRAM is put at once (a
    #: decode instance can load it as soon as the prefill step ran); "write-back": on
    #: DRAM eviction.
    mode: Literal["write-back", "write-through"] = "write-through"
    admit_min_seen: int = 1
    #: A lookup asks the master whether blocks exist, on a lookup thread; the request
    #: waits for the answer at most this long, asked again each step (the scheduler thread
    #: never waits; past it, a miss counted in ``lookup_timeouts``). A late answer is not
    #: lost: it is indexed when it comes, so a host on which every lookup is slower than
    #: this still finds its blocks (a loaded 2-core host: 1-5 ms, a process's first lookup
    #: 38-101 ms).
    lookup_timeout_s: float = 0.05
    #: Decode side of P/D: when the prefill instance says (``kv_transfer_params``) that it
    #: stored N blocks, wait up to this long for them to appear in the pool before
    #: recomputing instead (``handoff_timeouts`` and a warning per lost hand-off). On a
    #: loaded 2-core host they appeared within 63 ms (puts 20-120 ms).
    handoff_wait_s: float = 5.0
    #: P/D hand-offs through the pool (``kvtier_pool_blocks`` in ``kv_transfer_params``):
    #: the prefill side announces what it stored, the decode side waits for it. Off by
    #: default: the decode side's wait is asked for by the request (a client can send the
    #: field through vLLM's OpenAI server). Without it the pool is still read (hits are
    #: hits), the decode side just does not wait; an ignored hand-off is counted
    #: (``request_params_ignored{tier="mooncake"}``).
    accept_handoffs: bool = False


    def __post_init__(self) -> None:
        at_least("mooncake.admit_min_seen", self.admit_min_seen, 1)
        for name in ("lookup_timeout_s", "handoff_wait_s"):
            at_least(f"mooncake.{name}", getattr(self, name), 0)
        check_bounds("mooncake", self, durations=("lookup_timeout_s", "handoff_wait_s"))

    # The settings other tiers have, fixed here. Not fields: the parser refuses them.

    @property
    def chunk_blocks(self) -> int:
        """One block per object, named by the block's key: any instance finds it."""
        return 1

    @property
    def capacity_bytes(self) -> None:
        """The pool bounds itself."""
        return None

    @property
    def flush_interval_s(self) -> float:
        """Written when saved: nothing to flush."""
        return 0.0

    @property
    def flush_on_shutdown_s(self) -> float:
        """No flush at shutdown."""
        return 0.0

    @property
    def storage_dtype(self) -> Literal["native", "fp8"]:
        """Blocks are stored as they are."""
        return "native"

    @property
    def endpoint(self) -> str:
        return f"the pool at {self.store.master}"
