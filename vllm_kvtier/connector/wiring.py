"""Start-up wiring of the connector: the sizes, names and side services derived from
vLLM's configuration objects once, when vLLM builds the connector (either role).

Who calls it: :class:`~vllm_kvtier.connector.KVTierConnector`'s constructor. Nothing here
runs per step.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_kvtier import cpus
from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.connector.events import event_log
from vllm_kvtier.connector.scheduler import SchedulerHalf
from vllm_kvtier.engine.identity import model_identity
from vllm_kvtier.engine.lower import make_planners, make_workers, rank_role, stored_copies
from vllm_kvtier.engine.scheduler import GroupedPlanner, PlannerSetup
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.index.groups import GroupLayout, GroupSpec
from vllm_kvtier.index.identity import FingerprintMode, describe_line
from vllm_kvtier.keys import NamespaceFields, namespace
from vllm_kvtier.metrics import Counters
from vllm_kvtier.sysmem import available_memory, budget_overrun
from vllm_kvtier.tiers.registry import metric_tiers
from vllm_kvtier.transfer.worker import WorkerHalf, WorkerSetup

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("vllm_kvtier")

def rank_block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block of this rank's KV cache, over all its layers (a CPU slot's).

    With more than one KV cache group, the groups alias one memory region. Each
    ``KVCacheTensor`` spans it, and several layers share a tensor. A block is then that
    region divided by ``num_blocks``, as the worker's deduplicated layout sees it."""
    groups = kv_cache_config.kv_cache_groups
    tensors = list(getattr(kv_cache_config, "kv_cache_tensors", None) or ())
    if len(groups) > 1 and tensors and kv_cache_config.num_blocks:
        return max(int(t.size) for t in tensors) // int(kv_cache_config.num_blocks)
    total = 0
    for group in groups:
        total += group.kv_cache_spec.page_size_bytes * len(group.layer_names)
    return total


def kv_replicated(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> bool:
    """Whether every rank of a TP group holds the same KV cache.

    That is an MLA model with TP > 1 and no decode context parallelism. MLA means vLLM's
    ``MLAAttentionSpec`` in every KV cache group: one latent vector per token, not split by
    heads. DCP splits the latent cache's tokens across the TP ranks. Then each rank's shard
    is stored, as for other models."""
    par = vllm_config.parallel_config
    if par.tensor_parallel_size <= 1 or int(getattr(par, "decode_context_parallel_size", 1) or 1) > 1:
        return False
    try:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec
    except ImportError:  # pragma: no cover - every supported vLLM has it
        return False
    groups = kv_cache_config.kv_cache_groups
    return bool(groups) and all(isinstance(g.kv_cache_spec, MLAAttentionSpec) for g in groups)
_HYBRID_HINT = "or start vLLM with --disable-hybrid-kv-cache-manager"


def _spec_kind(spec: Any) -> tuple[str, int] | None:
    """("full" | "sliding", window) of an attention spec; None for any other kind."""
    from vllm.v1 import kv_cache_interface as kvi

    specs = [spec]
    uniform: Any = getattr(kvi, "UniformTypeKVCacheSpecs", None)
    if uniform is not None and isinstance(spec, uniform):
        specs = list(spec.kv_cache_specs.values())
    kinds = set()
    for s in specs:
        if isinstance(s, kvi.SlidingWindowSpec):
            kinds.add(("sliding", int(s.sliding_window)))
        elif isinstance(s, kvi.FullAttentionSpec) and not getattr(s, "sliding_window", None) \
                and not getattr(s, "attention_chunk_size", None):
            kinds.add(("full", 0))
        else:
            return None
    return kinds.pop() if len(kinds) == 1 else None


def group_layout(cfg: KVTierConfig, kv_cache_config: KVCacheConfig) -> GroupLayout:
    """The engine's KV cache groups, refusing at start what the tiers cannot store.

    State-space layers are refused (Mamba, linear attention: their state is not a per-block
    KV row). With more than one group, other attention kinds and mixed block sizes are
    refused. So are the features that move blocks by block id (P/D over NIXL, pool
    hand-offs, shadow verification). A ConfigError names the field or layer and what to
    do."""
    from vllm.v1 import kv_cache_interface as kvi

    groups = list(kv_cache_config.kv_cache_groups)
    attention = (kvi.AttentionSpec, *[c for c in [getattr(kvi, "UniformTypeKVCacheSpecs", None)] if c])
    for g in groups:
        spec = g.kv_cache_spec
        if isinstance(spec, kvi.MambaSpec) or not isinstance(spec, attention):
            layer = g.layer_names[0] if g.layer_names else "?"
            raise ConfigError(
                "kv_connector", f"layer {layer} keeps {type(spec).__name__} state (state-space / linear attention): "
                "KVTierConnector stores attention KV blocks only; serve this model without it (or with vLLM's "
                "native OffloadingConnector)")
    if len(groups) <= 1:
        bs = int(groups[0].kv_cache_spec.block_size) if groups else 1
        return GroupLayout((GroupSpec("full", bs, 0, len(groups[0].layer_names) if groups else 0),))
    specs = []
    for g in groups:
        kind = _spec_kind(g.kv_cache_spec)
        if kind is None:
            raise ConfigError("kv_connector", f"layer {g.layer_names[0]} uses {type(g.kv_cache_spec).__name__}: "
                              f"hybrid models are supported with full and sliding-window attention only; "
                              f"{_HYBRID_HINT}")
        specs.append(GroupSpec(kind[0], int(g.kv_cache_spec.block_size), kind[1], len(g.layer_names)))  # type: ignore[arg-type]
    if len({s.block_size for s in specs}) > 1:
        raise ConfigError("kv_connector", f"KV cache groups with different block sizes "
                          f"({sorted({s.block_size for s in specs})}) are not supported; {_HYBRID_HINT}")
    refused = [("nixl", cfg.nixl is not None, "remove the nixl section (P/D peer transfers)"),
               ("mooncake.accept_handoffs", cfg.mooncake is not None and cfg.mooncake.accept_handoffs,
                "set it to false"),
               ("verify.sample_rate", cfg.verify.sample_rate > 0, "set it to 0")]
    for name, on, what in refused:
        if on:
            raise ConfigError(name, f"not supported with a hybrid model ({len(groups)} KV cache groups): {what}, "
                              f"{_HYBRID_HINT}")
    return GroupLayout(tuple(specs))


def worker_rank(vllm_config: VllmConfig | None = None) -> int:
    """This worker's rank within its engine (TP x PP; chunk files are per rank).

    vLLM's world group spans every data-parallel engine of a MoE model. There world rank =
    ``data_parallel_rank * world_size + rank``. The rank within the engine names this
    worker's chunks. So the ranks of every engine count from 0, as each engine's scheduler
    counts them. :func:`dp_engine` tells the engines apart."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        world_rank = int(get_world_group().rank_in_group)
    except Exception:  # not initialised (unit tests drive the worker directly)
        return 0
    return engine_rank(world_rank, vllm_config)


def engine_rank(world_rank: int, vllm_config: VllmConfig | None) -> int:
    """The rank within its engine of vLLM's world rank ``world_rank``.

    The world spans the data-parallel engines of a MoE model. A dense model's engines are
    worlds of their own."""
    if vllm_config is None:
        return world_rank
    return world_rank % max(1, int(vllm_config.parallel_config.world_size))


def dp_engine(vllm_config: VllmConfig | None) -> int:
    """This engine's data-parallel index (0 without data parallelism).

    vLLM resets ``data_parallel_rank`` to 0 in each engine of a dense model. Those engines
    run independently. ``data_parallel_index`` keeps the engine's place, so it is read
    first."""
    if vllm_config is None:
        return 0
    par = vllm_config.parallel_config
    return int(getattr(par, "data_parallel_index", None) or par.data_parallel_rank or 0)


def engine_world_size(vllm_config: VllmConfig | None) -> int:
    """Ranks of one engine: tensor times pipeline parallelism (1 without a config)."""
    if vllm_config is None:
        return 1
    par = vllm_config.parallel_config
    return int(par.tensor_parallel_size * par.pipeline_parallel_size)


def pool_slots(cfg: KVTierConfig, block_bytes_per_rank: int, world_size: int, *, allocating: bool = True) -> int:
    """Number of CPU slots for the configured budget (whole engine, all ranks).

    ``allocating``: the caller is a worker, about to allocate its pool. It checks that its
    share of a fixed ``cpu.capacity_bytes`` fits in what this process may still allocate.
    A misfit is a ConfigError at start-up, not at the first request. Then the engine's
    ranks agree on the smallest figure (:func:`engine_min`). Each measured before any of
    them allocated. The scheduler calls this with ``allocating=False``. It does so only for
    the size it plans with until the workers' handshake comes."""
    if cfg.cpu.capacity_bytes is not None:
        budget = cfg.cpu.capacity_bytes
        overrun = budget_overrun(budget // max(1, world_size)) if allocating else None
        if overrun is not None:
            raise ConfigError("cpu.capacity_bytes", f"this rank's share (1/{world_size}): {overrun}")
        source = "cpu.capacity_bytes"
    else:
        available, where = available_memory()
        budget = int(available * cfg.cpu.capacity_fraction)
        source = f"cpu.capacity_fraction={cfg.cpu.capacity_fraction} of {available / 2**30:.1f} GiB ({where})"
    per_block = block_bytes_per_rank * world_size
    slots = budget // per_block if per_block else 0
    if allocating:
        slots = engine_min(slots)
        logger.info("kvtier: CPU tier %d blocks (%.1f MiB) from %s, the smallest over the engine's ranks", slots,
                    slots * per_block / 2**20, source)
    return int(slots)


def engine_min(value: int) -> int:
    """The smallest ``value`` over this engine's ranks.

    It is an all-reduce over vLLM's CPU process groups of tensor, then pipeline,
    parallelism. Every rank calls it at the same point (``register_kv_caches``). So it is
    also a barrier: no rank allocates its pool before every rank has measured. It returns
    ``value`` itself with one rank, or outside an engine. Unit tests drive the worker
    directly."""
    try:
        import torch
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        groups = [get_tp_group(), get_pp_group()]
    except Exception:  # not initialised
        return value
    t = torch.tensor([value], dtype=torch.int64)
    for group in groups:
        if group.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(t.item())


#: vLLM's older names of two layouts (``VLLM_KV_CACHE_LAYOUT`` takes both spellings).
_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
#: The namespace's ``layout`` where vLLM names none (no resolver, nothing resolved yet):
#: never equal to a resolved one, so such an engine shares KV only with its like.
UNRESOLVED_LAYOUT = "unresolved"


def kv_cache_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """The physical KV cache layout vLLM resolved for this engine, by its canonical name.

    Examples: ``LBHNC``, ``LBNHC``, ``BLHNC``. It is the stride order of a block's layers,
    heads, tokens and content. It decides how the bytes of a block sit in memory. That is
    how the worker stores them (``transfer/layout.py``), so it is part of the namespace.

    Both roles read the same value. vLLM >= 0.32 resolves it once in the engine core,
    before either role's connector is built. It uses the backends' supported layouts,
    ``VLLM_KV_CACHE_LAYOUT`` and a connector's requirement. It records it on every
    ``KVCacheConfig`` and on ``cache_config`` (workers adopt it by RPC). An older vLLM
    resolves it per process (``get_kv_cache_layout``: NHD, HND for FlashInfer on
    Blackwell, the env variable). The scheduler and the workers may then read different
    values. That is caught at the first step
    (:meth:`~vllm_kvtier.transfer.worker.WorkerHalf.begin_step`)."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) \
        or getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if not name:
        try:  # vLLM < 0.32: no recorded layout, a per-process resolver
            from vllm.v1.attention.backends.utils import get_kv_cache_layout  # type: ignore[attr-defined]

            name = get_kv_cache_layout()
        except Exception:  # neither: named as unresolved, never as a real layout
            name = None
    name = str(name) if name else UNRESOLVED_LAYOUT
    return _LAYOUT_ALIASES.get(name, name)


def engine_namespace(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, salt: str = "",
                     log: bool = False, groups: GroupLayout | None = None, fingerprint: FingerprintMode = "full",
                     cache_dir: Path | None = None, require_fingerprint: bool = False) -> str:
    """The digest naming what this engine stores; blocks of another namespace are never
    read back.

    Its inputs are the model's identity (weights, dtype, quantization, overrides, salt).
    They also include the KV dtype and shape, the TP size and the hash. And the resolved
    physical KV layout (:func:`kv_cache_layout`). ``log``: its inputs at INFO (once per
    engine: the scheduler role). ``require_fingerprint``:
    :func:`~vllm_kvtier.engine.identity.model_identity`'s."""
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    model = vllm_config.model_config
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    identity, fp = model_identity(vllm_config, salt, fingerprint=fingerprint, cache_dir=cache_dir,
                                  require_fingerprint=require_fingerprint)
    fields = NamespaceFields(
        model=identity.digest(),
        kv_dtype=str(cache.cache_dtype if cache.cache_dtype != "auto" else model.dtype),
        block_size=cache.block_size,
        num_layers=sum(len(g.layer_names) for g in kv_cache_config.kv_cache_groups),
        num_kv_heads=int(getattr(spec, "num_kv_heads", 0)),
        head_size=int(getattr(spec, "head_size", 0)),
        tp_size=par.tensor_parallel_size,
        tp_rank=0,
        # the planes format (transfer/layout.py) over vLLM's physical layout of a block
        layout="vllm-block-planes:" + kv_cache_layout(vllm_config, kv_cache_config),
        hash_algo=str(getattr(cache, "prefix_caching_hash_algo", "sha256")),
        groups=groups.describe() if groups is not None else "",
    )
    ns = namespace(fields)
    if log:
        cost = ("none" if fp is None else
                f"{fp.mode}, {fp.files} files, {fp.total_bytes / 2**30:.2f} GiB, {fp.bytes_hashed / 2**30:.2f} GiB "
                f"hashed, {fp.cached_files} file(s) from the cache, {fp.seconds * 1e3:.0f} ms")
        logger.info("kvtier: namespace %s from %s (weights fingerprint: %s) %s", ns,
                    describe_line(identity.describe()), cost,
                    describe_line({k: v for k, v in asdict(fields).items() if k != "model"}))
    return ns


def start_exporter(cfg: KVTierConfig, ns: str) -> Any:
    """The standalone ``/metrics`` endpoint when ``exporter.port`` is set (scheduler role),
    else None; a busy port is logged, never fatal."""
    ex = cfg.exporter
    if ex.port is None:
        return None
    from prometheus_client import CollectorRegistry

    from vllm_kvtier.exporter import StandaloneExporter

    exporter = StandaloneExporter(CollectorRegistry(), labels={"namespace": ns}, tiers=metric_tiers(cfg))
    try:
        port = exporter.start(ex.port, ex.addr)
    except OSError as e:  # a busy port must not stop the engine
        logger.error("kvtier: standalone exporter not started on %s:%s: %s", ex.addr, ex.port, e)
        return None
    logger.info("kvtier: standalone metrics on http://%s:%d/metrics", ex.addr, port)
    return exporter


def scheduler_half(cfg: KVTierConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                   ns: str, groups: GroupLayout | None = None) -> SchedulerHalf:
    """The scheduler role's half.

    It holds the CPU tier sized from the config, and the planners of the tiers below it.
    Their start-up scans run here. It holds the KV event log if vLLM's KV events are on."""
    par = vllm_config.parallel_config
    world = engine_world_size(vllm_config)
    block_bytes = rank_block_bytes(kv_cache_config)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    counters = Counters()
    # The lower tiers store one copy per TP group of a replicated (MLA) cache; the CPU tier
    # is one pool per worker process, so it holds one copy per rank (and is sized so).
    replicated = kv_replicated(vllm_config, kv_cache_config)
    copies = stored_copies(world, tp_size=par.tensor_parallel_size, replicated=replicated)
    if replicated:
        logger.info("kvtier: MLA latent cache replicated over %d TP ranks: the lower tiers store %d copy(ies) of "
                    "each block, the CPU tier one per rank", par.tensor_parallel_size, copies)
    engine = dp_engine(vllm_config)
    if engine or par.data_parallel_size > 1:
        logger.info("kvtier: data-parallel engine %d: NVMe directories of its own (capacity per engine), S3 and "
                    "pool chunks shared with the other engines", engine)
    lower = make_planners(cfg, namespace=ns, world_size=copies, block_bytes_per_rank=block_bytes,
                          counters=counters, kv_dtype=getattr(spec, "dtype", None),  # the worker's layout dtype
                          read_only_pool=getattr(vllm_config.kv_transfer_config, "kv_role", "") == "kv_consumer",
                          engine=engine)
    setup = PlannerSetup(vllm_config.cache_config.block_size, pool_slots(cfg, block_bytes, world, allocating=False),
                         slot_bytes_total=block_bytes * world, world_size=world, namespace=ns)
    half = SchedulerHalf(GroupedPlanner(cfg, setup, lower=lower, counters=counters, layout=groups,
                                        events=event_log(cfg.events, vllm_config, counters)))
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
    if policy != "recompute":
        logger.warning("kvtier: kv_load_failure_policy is %r: a block that cannot be loaded (a tier down, "
                       "a corrupt or missing block) fails its request. Set \"kv_load_failure_policy\":"
                       "\"recompute\" in --kv-transfer-config so vLLM recomputes it instead.", policy)
    if sync_load_failures_unsafe(vllm_config) and not half.planner.load_options.always_async:
        logger.info("kvtier: vLLM's V2 model runner with kv_load_failure_policy recompute: every load is "
                    "async (a rejected sync load would give wrong output there, vllm#49250)")
        half.planner.load_options.always_async = True
    return half


def sync_load_failures_unsafe(vllm_config: VllmConfig) -> bool:
    """Whether a sync load that fails after vLLM allocated and scheduled it gives wrong
    output.

    That is vLLM's V2 model runner with ``kv_load_failure_policy: recompute``
    (vllm#49250, open in 0.32). There the scheduler truncates the request's
    ``num_computed_tokens`` backward. The runner applies that to its CPU mirror only. So
    the recompute gathers tokens and positions from the old offset. Such engines get
    async loads only. A request then waits for its load outside the running batch. A
    failure (by block or by request) sets its ``num_computed_tokens`` before the runner
    first sees it. So nothing goes backward. Cost: one step of latency per hit. Under
    ``fail``, a failed sync load ends the request with an error (never wrong output). So
    sync loads stay."""
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
    return policy == "recompute" and bool(getattr(vllm_config, "use_v2_model_runner", False))


def shares_host_with_other_ranks(vllm_config: VllmConfig | None) -> bool:
    """Whether other ranks of this engine (TP/PP, or data-parallel ranks it started) run on
    this host.

    Their compute cores are not known in this process. vLLM computes them from the
    executor's CPU mask, which this worker no longer has. So ``background_cpus: auto``
    leaves the threads where they are rather than risk another rank's cores."""
    if vllm_config is None:
        return False
    par = vllm_config.parallel_config
    return par.local_world_size > 1 or par.data_parallel_size_local > 1


def worker_half(cfg: KVTierConfig, kv_cache_config: KVCacheConfig, ns: str,
                vllm_config: VllmConfig | None = None) -> WorkerHalf:
    """The worker role's half of this rank.

    Its data path (pool, copy engine, lower tiers) is built in ``register_kv_caches``. Its
    pool is sized there by :func:`pool_slots`. That is after vLLM allocated its own KV
    cache, in the process that allocates the pool. ``vllm_config`` gives the world size.
    It also tells a replicated (MLA) cache, whose lower-tier copy only the TP group's
    first rank writes. None: one rank, not replicated."""
    rank = worker_rank(vllm_config)
    replicated = vllm_config is not None and kv_replicated(vllm_config, kv_cache_config)
    tp = vllm_config.parallel_config.tensor_parallel_size if vllm_config is not None else 1
    world = engine_world_size(vllm_config)
    role = rank_role(rank, tp_size=tp, replicated=replicated)
    # here, on the compute thread, before any tier starts a thread
    cpus.configure(cfg.background_cpus, shared_host=shares_host_with_other_ranks(vllm_config))
    return WorkerHalf(cfg, WorkerSetup(
        kv_cache_config.num_blocks, functools.partial(pool_slots, cfg, rank_block_bytes(kv_cache_config), world),
        namespace=ns, rank=rank, make_tiers=functools.partial(make_workers, role=role, engine=dp_engine(vllm_config)),
        cache_dtype=fp8_cache_dtype(vllm_config)))


def under_multi_connector() -> bool:
    """Whether this worker's connector is one of vLLM's ``MultiConnector``.

    It hands the first sub-connector's start-up handshake to all of them. Another's
    scheduler (NIXL's) refuses ours. Then this worker sends none."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

        return isinstance(get_kv_transfer_group(), MultiConnector)
    except Exception:  # not initialised (unit tests drive the worker directly)
        return False


def adopt_pool_sizes(half: SchedulerHalf, sizes: dict[int, int]) -> None:
    """Plan for the smallest of the workers' pools (``sizes``: rank -> slots, from the
    start-up handshake). The ranks agreed on one size already (:func:`engine_min`); the
    smallest is taken all the same."""
    num_slots = min(sizes.values())
    if len(set(sizes.values())) > 1:
        logger.info("kvtier: the ranks' CPU pools differ (%s): planning for the smallest", sizes)
    logger.info("kvtier: CPU tier %d blocks per rank, as the workers allocated it", num_slots)
    half.planner.size_pool(num_slots)


def fp8_cache_dtype(vllm_config: VllmConfig | None) -> str:
    """vLLM's ``cache_dtype``, with ROCm's "fp8" named for what it is (e4m3fnuz): shadow
    verification decodes an fp8 cache's bytes by it."""
    if vllm_config is None:
        return "auto"
    dtype = str(vllm_config.cache_config.cache_dtype)
    if dtype in ("fp8", "fp8_e4m3"):
        import torch
        from vllm.platforms import current_platform

        try:
            if current_platform.fp8_dtype() == torch.float8_e4m3fnuz:
                return "fp8_e4m3fnuz"
        except Exception:  # a platform without fp8: the OCP format
            pass
    return dtype
