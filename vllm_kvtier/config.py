"""Typed, frozen configuration, parsed once at the edge.

Sources, lowest precedence first, merged section by section:

1. the built-in defaults of the dataclasses below;
2. ``preset: NAME``: the file ``configs/NAME.yaml`` shipped with the package;
3. ``config_file: PATH``: a YAML file with the same fields;
4. the fields given inline in ``kv_connector_extra_config``.

Every field is checked once here: unknown keys, wrong types, negative sizes and unknown
presets raise :class:`~vllm_kvtier.errors.ConfigError` naming the dotted field. Nothing
downstream re-validates. Units are in the names (``_bytes``, ``_s``). Secrets never live
here (S3 credentials come from the environment), so ``repr`` is safe to log.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from vllm_kvtier.errors import ConfigError
from vllm_kvtier.index.policy import EvictionName
from vllm_kvtier.tiers.mooncake import MooncakeConfig
from vllm_kvtier.tiers.nixl_agent import NixlConfig
from vllm_kvtier.tiers.s3_config import S3Config

PRESET_DIR = Path(__file__).resolve().parent / "presets"

LoadMode = Literal["sync", "async"]


@dataclass(frozen=True)
class CPUTierConfig:
    """The CPU DRAM tier: a pool of block slots allocated once at start-up.

    ``capacity_bytes`` is the budget for the whole engine (all TP ranks together).
    When it is not given, the budget is ``capacity_fraction`` of the DRAM that is
    *available* when the engine starts (after the OS, the model weights and vLLM's own
    KV cache have taken theirs): the brief's 50-70% rule, at its conservative end by
    default because vLLM workers and the API server keep growing after start-up.
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
    #: Which block leaves a full pool: "s3fifo" (scan-resistant: blocks reused by
    #: several requests, such as shared system prompts, survive a flood of one-off
    #: documents; see bench/trace_replay.py) or "lru" (least recently used).
    eviction: EvictionName = "s3fifo"
    #: Share of the pool that explicit prefix pins with a TTL may hold; pins beyond it
    #: are refused (and counted), so pinned prefixes never starve ordinary traffic.
    max_pinned_fraction: float = 0.5


@dataclass(frozen=True)
class NVMeTierConfig:
    """The NVMe tier: chunk files under ``path``, at most ``capacity_bytes`` of them.

    It survives restarts: a new engine pointed at the same ``path`` (and the same model
    and layout: files live under a namespace digest) serves hits from what was stored.
    """

    path: str
    capacity_bytes: int
    #: "write-back": a block goes to NVMe when the CPU tier evicts it (and, at shutdown,
    #: every admitted block still only in DRAM is flushed). "write-through": every block
    #: saved to the CPU tier is also written to NVMe at once (for shared or durable caches).
    mode: Literal["write-back", "write-through"] = "write-back"
    #: SSD endurance: write a block only once it was part of at least this many requests'
    #: prompts. 2 keeps one-off documents (most long prompts in mixed traffic) off the
    #: flash; 1 writes everything.
    admit_min_seen: int = 2
    #: Blocks per chunk file: consecutive blocks go to disk together so I/Os are large.
    chunk_blocks: int = 16
    direct_io: Literal["auto", "on", "off"] = "auto"
    #: I/O threads: more than the cores, since they mostly wait on the device and syncs.
    io_threads: int = 4
    #: Writes waiting for the disk beyond this are refused (counted), never queued forever.
    max_queued_writes: int = 64
    #: Upper bound on the time spent at shutdown flushing write-back blocks.
    flush_on_shutdown_s: float = 10.0
    #: How blocks are stored. "native": the KV cache's bytes as they are. "fp8": e4m3 with
    #: a float32 scale per 1024 elements (vllm_kvtier/transfer/fp8.py): half the bytes and
    #: I/O of bf16/fp16, a quarter of fp32, at the cost of a small numeric drift in what is
    #: loaded back (measured in bench/fp8_drift.py). A cache already in FP8 is stored as is.
    #: Each setting has its own namespace: neither ever reads the other's blocks.
    storage_dtype: Literal["native", "fp8"] = "native"
    #: What moves the bytes between the chunk buffers and the files
    #: (:mod:`vllm_kvtier.tiers.file_io`). "posix" (default): ``pwrite``/``preadv`` in the
    #: I/O threads. "nixl": NIXL's POSIX backend (Linux AIO; needs the nixl package).
    #: "nixl-gds": NIXL's GDS backend (cuFile; only where that plugin loads, i.e. a CUDA host
    #: with libcufile). File names, syncs, headers and checksums are the same for all three,
    #: so a directory written with one reads with any other. Measured in bench/nixl_io.py.
    io_engine: Literal["posix", "nixl", "nixl-gds"] = "posix"


@dataclass(frozen=True)
class S3TierConfig:
    """The object-store tier: chunk objects in ``store.bucket`` under ``store.prefix``.

    In YAML the section is flat: the fields of
    :class:`~vllm_kvtier.tiers.s3_config.S3Config` (bucket, prefix, region, endpoint_url,
    path_style, ca_bundle, profile, timeouts, retries, breaker, threads, multipart,
    manifests, io_engine) next to the policy fields below. No credential field exists: credentials
    come from the standard AWS chain (environment, profile, IRSA, instance metadata).
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
    #: "native" or "fp8": as :attr:`NVMeTierConfig.storage_dtype` (fp8 halves PUT/GET bytes
    #: of a bf16 cache). Instances sharing a bucket share blocks only with the same setting.
    storage_dtype: Literal["native", "fp8"] = "native"


@dataclass(frozen=True)
class MooncakeTierConfig:
    """A Mooncake Store pool (``mooncake_master`` plus clients pooling their DRAM, TCP or
    RDMA), shared by every instance that points at the same master: the KV store pool of
    prefill/decode disaggregation (the prefill instance writes, the decode one loads).

    In YAML the section is flat: the fields of
    :class:`~vllm_kvtier.tiers.mooncake.MooncakeConfig` (master, metadata_server,
    local_hostname, protocol, device_name, segment and buffer sizes, deadline_s, threads,
    replicas, breaker) next to the policy fields below. One object per block, named by the
    block's chained hash, so any instance finds a prefix from its own block hashes; leases
    and eviction are Mooncake's. ``kv_role: kv_consumer`` makes this instance read-only.
    """

    store: MooncakeConfig
    #: "write-through" (default): every admitted block saved to DRAM is put at once (a
    #: decode instance can load it as soon as the prefill step ran); "write-back": on
    #: DRAM eviction.
    mode: Literal["write-back", "write-through"] = "write-through"
    admit_min_seen: int = 1
    #: A lookup asks the master whether blocks exist; it waits at most this long (a dead
    #: master is a miss, never a stalled scheduler).
    lookup_timeout_s: float = 0.05
    #: Decode side of P/D: when the prefill instance says (``kv_transfer_params``) that it
    #: stored N blocks, wait up to this long for them to appear in the pool before
    #: recomputing instead.
    handoff_wait_s: float = 5.0


@dataclass(frozen=True)
class NixlTierConfig:
    """Prefill/decode disaggregation peer to peer: the decode instance reads a prompt's
    blocks straight out of the prefill instance's CPU tier over NIXL (UCX: RDMA, or TCP /
    shared memory on one host), using the ``kv_transfer_params`` vLLM passes through the
    request. In YAML the section is flat: :class:`~vllm_kvtier.tiers.nixl_agent.NixlConfig`'s
    fields (backends, deadline_s, num_threads, progress_thread) next to ``hold_s``."""

    store: NixlConfig
    #: Prefill side: how long a finished request's blocks stay pinned for the decode side
    #: to read them; reclaimed then if no read came (a decode instance that died).
    hold_s: float = 60.0


#: Fields of the flat ``s3`` / ``mooncake`` sections that belong to the tier config itself.
_S3_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(S3TierConfig)) - {"store"}
_MOONCAKE_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(MooncakeTierConfig)) - {"store"}
_NIXL_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(NixlTierConfig)) - {"store"}


@dataclass(frozen=True)
class LoadOrRecomputeConfig:
    """For hits below the CPU tier: load only the part of the prefix that is faster to
    read than to compute again (measured tier bandwidth and latency against the measured
    prefill rate, kept up to date at run time). CPU hits are always loaded."""

    enabled: bool = True
    #: Starting estimate of the prefill rate; None: 5000 tokens/s until measured.
    prefill_tokens_per_s: float | None = None
    #: A tier not read from for this long gets one load anyway, to measure it again.
    probe_interval_s: float = 30.0


@dataclass(frozen=True)
class PrefetchConfig:
    """Promote a conversation's blocks that left DRAM back into it when its request ends,
    ahead of the next turn (only with a tier below CPU)."""

    enabled: bool = True
    #: Promotions in flight at most (a bandwidth and memory budget).
    max_inflight_blocks: int = 256
    #: A queued prefetch older than this is dropped.
    max_age_s: float = 30.0


@dataclass(frozen=True)
class ExporterConfig:
    """A standalone Prometheus endpoint (``kvtier_*`` names, its own registry) for setups
    that do not scrape vLLM's ``/metrics`` (offline ``LLM`` use, tools). Served from the
    scheduler process, with the workers' figures as vLLM hands them to the scheduler."""

    #: TCP port; None: off (vLLM's own /metrics carries everything as ``vllm:kvtier_*``).
    port: int | None = None
    addr: str = "0.0.0.0"


@dataclass(frozen=True)
class FaultInjectionConfig:
    """Deliberate failures, for fault drills and tests. Off unless a rate is set."""

    #: Probability that one block load fails (the block is then recomputed).
    load_error_rate: float = 0.0
    seed: int = 0


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


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _read_yaml(path: Path, field_name: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(field_name, f"cannot read {path}: {e.strerror}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(field_name, f"{path} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(field_name, f"{path} must hold a mapping, not {type(data).__name__}")
    return data


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _check_value(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return the (possibly coerced) value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_value(path, value, a)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(path, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"must be a mapping, got {type(value).__name__}")
        if tp is S3TierConfig:
            return _build_flat(S3TierConfig, S3Config, _S3_POLICY_FIELDS, value, path)
        if tp is MooncakeTierConfig:
            return _build_flat(MooncakeTierConfig, MooncakeConfig, _MOONCAKE_POLICY_FIELDS, value, path)
        if tp is NixlTierConfig:
            return _build_flat(NixlTierConfig, NixlConfig, _NIXL_POLICY_FIELDS, value, path)
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {value!r}")
        return value
    if origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"must be a list, got {value!r}")
        item = typing.get_args(tp)[0]
        return tuple(_check_value(f"{path}[{i}]", v, item) for i, v in enumerate(value))
    raise TypeError(f"unsupported annotation {tp!r} for {path}")  # programming error


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(path, f"unknown key; allowed: {', '.join(sorted(names))}")
        kwargs[key] = _check_value(path, value, hints[key])
    for f in dataclasses.fields(cls):
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            path = f"{prefix}.{f.name}" if prefix else f.name
            raise ConfigError(path, "is required")
    return cls(**kwargs)


def _build_flat(tier_cls: type, store_cls: type, policy_fields: frozenset[str], data: Mapping[str, Any],
                path: str) -> Any:
    """A flat tier section (``s3``, ``mooncake``): policy fields are ``tier_cls``'s, the
    rest the store's config (which validates itself and names ``<section>.<field>``)."""
    store_fields = {f.name for f in dataclasses.fields(store_cls)}
    for key in data:
        if key not in store_fields and key not in policy_fields:
            allowed = ", ".join(sorted(store_fields | policy_fields))
            raise ConfigError(f"{path}.{key}", f"unknown key; allowed: {allowed}")
    hints = typing.get_type_hints(tier_cls)
    policy = {k: _check_value(f"{path}.{k}", v, hints[k]) for k, v in data.items() if k in policy_fields}
    store = _build(store_cls, {k: v for k, v in data.items() if k in store_fields}, path)
    return tier_cls(store, **policy)


def _validate(cfg: KVTierConfig) -> None:
    c = cfg.cpu
    if c.capacity_bytes is not None and c.capacity_bytes <= 0:
        raise ConfigError("cpu.capacity_bytes", f"must be > 0, got {c.capacity_bytes}")
    if not 0.0 < c.capacity_fraction <= 0.9:
        raise ConfigError(
            "cpu.capacity_fraction",
            f"must be in (0, 0.9] (the brief's rule is 0.5-0.7), got {c.capacity_fraction}",
        )
    if not 0.0 <= c.max_pinned_fraction <= 0.9:
        raise ConfigError(
            "cpu.max_pinned_fraction",
            f"must be in [0, 0.9] (keep room for unpinned blocks), got {c.max_pinned_fraction}",
        )
    n = cfg.nvme
    if n is not None:
        if n.capacity_bytes <= 0:
            raise ConfigError("nvme.capacity_bytes", f"must be > 0, got {n.capacity_bytes}")
        if not n.path:
            raise ConfigError("nvme.path", "must not be empty")
        for name in ("admit_min_seen", "chunk_blocks", "io_threads", "max_queued_writes"):
            if getattr(n, name) < 1:
                raise ConfigError(f"nvme.{name}", f"must be >= 1, got {getattr(n, name)}")
        if n.chunk_blocks > 256:
            raise ConfigError("nvme.chunk_blocks", f"must be <= 256, got {n.chunk_blocks}")
        if n.flush_on_shutdown_s < 0:
            raise ConfigError("nvme.flush_on_shutdown_s", f"must be >= 0, got {n.flush_on_shutdown_s}")
    s3 = cfg.s3
    if s3 is not None:
        if s3.capacity_bytes is not None and s3.capacity_bytes <= 0:
            raise ConfigError("s3.capacity_bytes", f"must be > 0, got {s3.capacity_bytes}")
        for name in ("admit_min_seen", "chunk_blocks"):
            if getattr(s3, name) < 1:
                raise ConfigError(f"s3.{name}", f"must be >= 1, got {getattr(s3, name)}")
        if s3.chunk_blocks > 256:
            raise ConfigError("s3.chunk_blocks", f"must be <= 256, got {s3.chunk_blocks}")
        for name in ("rescan_interval_s", "flush_on_shutdown_s"):
            if getattr(s3, name) < 0:
                raise ConfigError(f"s3.{name}", f"must be >= 0, got {getattr(s3, name)}")
    mc = cfg.mooncake
    if mc is not None:
        if mc.admit_min_seen < 1:
            raise ConfigError("mooncake.admit_min_seen", f"must be >= 1, got {mc.admit_min_seen}")
        for name in ("lookup_timeout_s", "handoff_wait_s"):
            if getattr(mc, name) < 0:
                raise ConfigError(f"mooncake.{name}", f"must be >= 0, got {getattr(mc, name)}")
    if cfg.nixl is not None and cfg.nixl.hold_s <= 0:
        raise ConfigError("nixl.hold_s", f"must be > 0, got {cfg.nixl.hold_s}")
    lr = cfg.load_or_recompute
    if lr.prefill_tokens_per_s is not None and lr.prefill_tokens_per_s <= 0:
        raise ConfigError("load_or_recompute.prefill_tokens_per_s", f"must be > 0, got {lr.prefill_tokens_per_s}")
    if lr.probe_interval_s < 0:
        raise ConfigError("load_or_recompute.probe_interval_s", f"must be >= 0, got {lr.probe_interval_s}")
    if cfg.prefetch.max_inflight_blocks < 1:
        raise ConfigError("prefetch.max_inflight_blocks", f"must be >= 1, got {cfg.prefetch.max_inflight_blocks}")
    if cfg.prefetch.max_age_s < 0:
        raise ConfigError("prefetch.max_age_s", f"must be >= 0, got {cfg.prefetch.max_age_s}")
    if cfg.exporter.port is not None and not 0 <= cfg.exporter.port < 65536:
        raise ConfigError("exporter.port", f"must be in [0, 65535], got {cfg.exporter.port}")
    if cfg.min_load_blocks < 1:
        raise ConfigError("min_load_blocks", f"must be >= 1, got {cfg.min_load_blocks}")
    r = cfg.fault_injection.load_error_rate
    if not 0.0 <= r <= 1.0:
        raise ConfigError("fault_injection.load_error_rate", f"must be in [0, 1], got {r}")


def parse_config(extra: Mapping[str, Any] | None) -> KVTierConfig:
    """Parse ``kv_connector_extra_config`` into a frozen :class:`KVTierConfig`.

    Called once per connector instance, in the scheduler and in every worker; it is pure
    (reads only the preset and config files) so all processes agree.
    """
    extra = dict(extra or {})
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config", "must be a mapping")
    merged: dict[str, Any] = {}
    preset = extra.get("preset")
    if preset is not None:
        if not isinstance(preset, str):
            raise ConfigError("preset", f"must be a string, got {preset!r}")
        path = PRESET_DIR / f"{preset}.yaml"
        if "/" in preset or not path.is_file():
            raise ConfigError(
                "preset", f"unknown preset {preset!r}; available: {', '.join(available_presets())}"
            )
        merged = _merge(merged, _read_yaml(path, "preset"))
    config_file = extra.get("config_file")
    if config_file is not None:
        if not isinstance(config_file, str):
            raise ConfigError("config_file", f"must be a string, got {config_file!r}")
        from_file = _read_yaml(Path(config_file), "config_file")
        for nested in ("preset", "config_file"):
            if nested in from_file:
                raise ConfigError(f"config_file.{nested}", "may only be given inline")
        merged = _merge(merged, from_file)
    merged = _merge(merged, extra)
    cfg = _build(KVTierConfig, merged, "")
    _validate(cfg)
    return cfg
