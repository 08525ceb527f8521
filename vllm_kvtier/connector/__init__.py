"""``KVTierConnector``: the thin vLLM adapter.

vLLM builds the connector twice: in the scheduler role (EngineCore process) and in the
worker role (each worker process). This class picks :class:`SchedulerHalf` or
:class:`WorkerHalf` by role and forwards vLLM's calls to it. The logic lives in ``plan/``
(scheduler side), ``transfer/`` (worker side), ``index/``, ``tiers/`` and ``engine/``
(what is built at start-up). Those never import vLLM. This package is the only one that
does. It holds the facade here and the translation of vLLM's objects (``scheduler.py``,
``metadata.py``). It also holds stats glue (``stats.py``), wiring (``wiring.py``) and the
entry point (``plugin.py``).

Turn it on with ``--kv-transfer-config '{"kv_connector":"KVTierConnector","kv_role":"kv_both",
"kv_load_failure_policy":"recompute","kv_connector_extra_config":{"preset":"interactive"}}'``
(``kv_connector_module_path: vllm_kvtier.connector`` also works without the entry point).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm_kvtier.config import parse_config
from vllm_kvtier.connector import wiring
from vllm_kvtier.connector.events import to_vllm
from vllm_kvtier.connector.metadata import KVTierHandshake, KVTierMetadata, KVTierWorkerMeta
from vllm_kvtier.connector.plugin import CacheHitSource, KVConnectorTransferResults, SupportsHMA, register
from vllm_kvtier.connector.scheduler import SchedulerHalf
from vllm_kvtier.connector.stats import KVTierPromMetrics, KVTierStats
from vllm_kvtier.engine.identity import digest_cache_dir
from vllm_kvtier.errors import run_all
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName
from vllm_kvtier.transfer.worker import WorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("vllm_kvtier")

__all__ = ["KVTierConnector", "register"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _scheduler_timed(fn: _F) -> _F:
    """Count a scheduler-role call's time (``scheduler_seconds``): the plugin's cost on
    the engine core's loop, between two forwards."""
    @functools.wraps(fn)
    def timed(self: KVTierConnector, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            if self._sched is not None:
                seconds = time.perf_counter() - t0
                self._sched.planner.counters.add(CounterName.SCHEDULER_SECONDS, TierName.CPU, seconds)
    return cast(_F, timed)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector that keeps KV blocks in tiers beyond GPU memory.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on for models mixing full and
    sliding-window attention. Blocks of every KV cache group are stored with their group
    (:mod:`vllm_kvtier.index.groups`). Models with state-space (Mamba, linear attention)
    layers are refused at start (:func:`~vllm_kvtier.connector.wiring.group_layout`)."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = parse_config(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.groups = wiring.group_layout(self.cfg, kv_cache_config)
        self.namespace = wiring.engine_namespace(vllm_config, kv_cache_config, salt=self.cfg.namespace_salt,
                                                 log=role == KVConnectorRole.SCHEDULER, groups=self.groups,
                                                 fingerprint=self.cfg.weights_fingerprint,
                                                 cache_dir=digest_cache_dir(self.cfg.weights_digest_cache_dir),
                                                 require_fingerprint=self.cfg.require_weights_fingerprint)
        self._exporter: Any = None
        self._sched: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        self._idle_step = False
        if role == KVConnectorRole.SCHEDULER:
            self._sched = wiring.scheduler_half(self.cfg, vllm_config, kv_cache_config, self.namespace,
                                                groups=self.groups)
            self._exporter = wiring.start_exporter(self.cfg, self.namespace)
        else:
            self._worker = wiring.worker_half(self.cfg, kv_cache_config, self.namespace, vllm_config)
            # vLLM refuses block-level load errors with more than one group.
            self._worker.request_level_failures = self.groups.hybrid
            # vLLM frees a sliding group's blocks as its window passes, not waiting for saves.
            self._worker.wait_saves = self.groups.hybrid
        logger.info("kvtier: %s role, namespace %s, config %s", role.name, self.namespace, self.cfg)

    @property
    def scheduler_half(self) -> SchedulerHalf | None:
        """The index and policy (scheduler role only), for introspection."""
        return self._sched

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a preempted request may simply recompute.
        return False

    # ---- worker role -----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVTierHandshake | None:
        # Once, after register_kv_caches: this rank's pool size, for the scheduler's index.
        if self._worker is None or self._worker.path is None or wiring.under_multi_connector():
            return None
        return KVTierHandshake(rank=self._worker.rank, num_slots=self._worker.num_slots)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # The earliest hook of a step (vLLM's V2 runner calls it after zeroing new blocks,
        # which no save of ours can read: see the worker's module docstring).
        if self._worker is not None and isinstance(kv_connector_metadata, KVTierMetadata):
            self._worker.begin_step(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._worker.begin_step(meta)  # no-op if handle_preemptions already ran it
        self._worker.start_loads()
        # No attention metadata: vLLM runs this step only to move KV (nothing scheduled).
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM >= 0.33 asks before it enables sleep mode. No: the namespace holds a digest of
        # the weights taken at start, so weights reloaded after a sleep (RLHF rollouts) would
        # be served KV computed by the old ones. vLLM then refuses the pair at start.
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-by-layer loads wait between attention layers: a full CUDA graph would
        # replay past those waits. The parsed config: a preset or config_file may set it.
        return parse_config(extra_config or {}).layer_pipelined_loads != "off"

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        # After the forward: copy out the blocks this step completed, ordered before any
        # later write to the KV cache (on CUDA the compute stream waits on our stream; the
        # host does not block). A request finished or preempted next may lose its blocks
        # before our next hook runs.
        assert self._worker is not None
        if self.has_connector_metadata():
            self._worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        recving = self._worker.transfer_results(finished_req_ids, idle_step=self._idle_step)
        return self._worker.take_sent() or None, recving or None

    if KVConnectorTransferResults is not None:

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            assert self._worker is not None
            recving = self._worker.transfer_results(finished_req_ids, idle_step=self._idle_step)
            return KVConnectorTransferResults(finished_sending=self._worker.take_sent(), finished_recving=recving,
                                              failed_recving=self._worker.take_failed_loads())

    def build_connector_worker_meta(self) -> Any:
        assert self._worker is not None
        report = self._worker.worker_meta()
        return None if report is None else KVTierWorkerMeta.from_report(report)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> KVTierStats | None:
        half = self._sched.planner if self._sched is not None else self._worker
        assert half is not None
        data = half.stats()
        if data and self._exporter is not None:
            self._exporter.observe(data)
        return KVTierStats(data) if data else None

    def shutdown(self) -> None:
        """Closes every part, and never raises.

        vLLM clears its connector global only after this returns. So a raise would leave
        this connector installed for the next engine of an in-process user. That is an
        ``LLM`` created after this one's ``shutdown``."""
        try:
            run_all([self._worker.shutdown if self._worker is not None else None,
                     self._sched.planner.close if self._sched is not None else None,
                     self._exporter.stop if self._exporter is not None else None])
        except Exception:
            logger.exception("kvtier: shutdown did not finish cleanly (what was in flight is lost, "
                             "as a cache loses it; nothing stored is damaged)")

    # ---- scheduler role ----------------------------------------------------------

    @_scheduler_timed
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.planner.get_num_new_matched_tokens(request, num_computed_tokens)

    @_scheduler_timed
    def on_new_request(self, request: Request) -> None:
        assert self._sched is not None
        self._sched.planner.on_new_request(request)

    @_scheduler_timed
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        if request.num_computed_tokens == 0 or num_external_tokens > 0:
            self._sched.planner.record_lookup(request)
        self._sched.planner.update_state_after_alloc_groups(request, blocks.get_block_ids(), num_external_tokens)

    @_scheduler_timed
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    @_scheduler_timed
    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)
        stats = getattr(connector_output, "kv_connector_stats", None)
        if self._exporter is not None and stats is not None:
            self._exporter.observe(stats.data)  # the workers' figures of this step

    @_scheduler_timed
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.planner.request_finished(request, block_ids)

    @_scheduler_timed
    def take_events(self) -> Iterable[KVCacheEvent]:
        # vLLM's KV events for our tiers (BlockStored / BlockRemoved, medium CPU or STORAGE):
        # nothing unless vLLM's kv_events_config turned them on (connector/events.py).
        if self._sched is None or self._sched.planner.events is None:
            return ()
        return to_vllm(self._sched.planner.take_events())

    @_scheduler_timed
    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.planner.request_finished_all_groups(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[Any, Any]) -> None:
        # Once, at start-up, before any request: the workers' pool sizes (KVTierHandshake).
        # Under MultiConnector this may be another connector's: then the estimate stays.
        sizes = {m.rank: m.num_slots for m in metadata.values() if isinstance(m, KVTierHandshake)}
        if self._sched is not None and sizes:
            wiring.adopt_pool_sizes(self._sched, sizes)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        # vLLM's default refuses pipeline stages above 0; every rank's size counts here.
        self.set_xfer_handshake_metadata(metadata)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.planner.has_pending_work()

    # ---- class-level hooks ---------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats | None:
        return KVTierStats(data) if data is not None else KVTierStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
