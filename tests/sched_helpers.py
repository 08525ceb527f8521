"""Drive vLLM's real ``Scheduler`` with ``KVTierConnector`` in the SCHEDULER role.

Small equivalents of vLLM's own test helpers (``tests/v1/kv_connector/unit/utils.py``:
``create_vllm_config``, ``create_scheduler``, ``create_request``,
``create_model_runner_output``, ``assert_scheduler_empty``), which the wheel does not ship.
No model forward and no worker run: :class:`FakeWorker` reads the ``KVTierMetadata`` of
each step and reports every transfer as done, as a worker that completes them would.
It also models the CPU pool as ``slot -> key`` so a load that would read a slot
overwritten by a save (or a save into a slot an in-flight load still reads) fails the test.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_kvtier.connector import KVTierConnector
from vllm_kvtier.connector.metadata import KVTierMetadata, KVTierWorkerMeta
from vllm_kvtier.connector.scheduler import SchedulerHalf

BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
# The "tiny" model of testkit.tinymodel: 2 layers, 2 KV heads of 64, float32.
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 64
DTYPE = torch.float32
#: A token that is neither EOS (2) nor a stop token: requests run to max_tokens.
SAMPLED_TOKEN = 7


def block_bytes(block_size: int = BLOCK_SIZE) -> int:
    """Bytes of one KV block over all layers (what one CPU slot holds)."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=DTYPE)
    return spec.page_size_bytes * NUM_LAYERS


def make_vllm_config(
    model_dir: str | Path,
    extra_config: dict[str, Any] | None = None,
    *,
    block_size: int = BLOCK_SIZE,
    max_num_batched_tokens: int = 1024,
    max_num_seqs: int = 16,
    enable_chunked_prefill: bool = True,
) -> VllmConfig:
    model_config = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=False)
    scheduler_config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
        async_scheduling=False,
    )
    kv_transfer_config = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="vllm_kvtier.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(extra_config or {}),
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config,
    )


def make_scheduler(vllm_config: VllmConfig, num_blocks: int = 128, sliding_window: int | None = None) -> Scheduler:
    """The real scheduler with one full-attention group for the model's layers; it
    builds our connector in the SCHEDULER role itself. ``sliding_window``: a hybrid
    model instead: group 0 is layer 0 with that sliding window, group 1 layer 1 (full)."""
    block_size = vllm_config.cache_config.block_size
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=DTYPE)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    groups = [KVCacheGroupSpec(layers, spec)]
    if sliding_window is not None:
        swa = SlidingWindowSpec(block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                                dtype=DTYPE, sliding_window=sliding_window)
        groups = [KVCacheGroupSpec(layers[:1], swa), KVCacheGroupSpec(layers[1:2], spec)]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )


_hash_ready = False


def make_request(req_id: str, prompt: list[int], max_tokens: int = 4,
                 block_size: int = BLOCK_SIZE, kv_transfer_params: dict[str, Any] | None = None) -> Request:
    """A request as vLLM builds it; ``kv_transfer_params`` arrive as a client's
    ``kv_transfer_params`` field does (through ``SamplingParams.extra_args``)."""
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(
            max_tokens=max_tokens, temperature=0.0,
            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def prompt_tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` deterministic token ids in [3, 1000) (no BOS/EOS); ``seed`` varies them."""
    return [3 + (seed * 7919 + i * 31) % 997 for i in range(n)]


def connector(scheduler: Scheduler) -> KVTierConnector:
    conn = scheduler.connector
    assert isinstance(conn, KVTierConnector)
    return conn


def sched_half(scheduler: Scheduler) -> SchedulerHalf:
    half = connector(scheduler).scheduler_half
    assert half is not None
    return half


def meta_of(out: SchedulerOutput) -> KVTierMetadata:
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVTierMetadata)
    return meta


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


@dataclass
class FakeWorker:
    """Plays the worker: completes every save and sync load at once (a held request is
    reported in ``finished_sending`` in the step of its final save) and reports every
    chunk write durable in its step; async loads complete when the test says so (or at
    once with ``auto_recv``)."""

    auto_recv: bool = True
    #: The CPU pool as the worker would hold it: slot -> key last written.
    pool: dict[int, bytes] = field(default_factory=dict)
    #: Async loads issued and not reported yet: req_id -> [(slot, key)].
    pending_recv: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    #: Requests whose async load completes in the next step's output.
    recv_done: set[str] = field(default_factory=set)
    #: Block ids to report as failed loads in the next step's output.
    fail_blocks: set[int] = field(default_factory=set)
    metas: list[KVTierMetadata] = field(default_factory=list)
    outputs: list[SchedulerOutput] = field(default_factory=list)

    def complete_recv(self, *req_ids: str) -> None:
        self.recv_done.update(req_ids)

    #: Per request: load positions (indexes into LoadJob.block_ids) to report as failed.
    fail_load_positions: dict[str, list[int]] = field(default_factory=dict)
    #: Requests whose async load fails as a whole (``failed_recving``, hybrid models).
    fail_requests: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    def _apply(self, scheduler: Scheduler, meta: KVTierMetadata) -> tuple[set[str], set[str]]:
        for job in meta.saves + meta.loads + meta.saves_after:
            # Every job touches only blocks its request still owns in this step (a save
            # from freed or reassigned blocks would copy another request's KV).
            owned = set().union(*scheduler.kv_cache_manager.get_block_ids(job.req_id))  # every group's
            assert set(job.block_ids) <= owned, f"{job} uses blocks {job.req_id} does not own"
        self._apply_saves(meta, meta.saves)  # before the forward, like the real worker
        for job in meta.loads:
            assert len(job.block_ids) == len(job.slots) == len(job.keys)
            reads = list(zip(job.slots, job.keys, strict=True))
            for pos in self.fail_load_positions.pop(job.req_id, ()):
                self.fail_blocks.add(job.block_ids[pos])
            self.fail_blocks.update(job.unloadable)  # no CPU slot: the worker reports them failed
            if job.peer_read is not None:  # a P/D peer read fills its slots (a real one checks stamps)
                for slot, key in zip(job.peer_read.slots, job.peer_read.keys, strict=True):
                    self.pool[slot] = key
            if job.req_id in self.fail_requests:
                self.fail_requests.discard(job.req_id)
                self.failed_recving.add(job.req_id)
                reads = []  # nothing is read: reported failed with finished_recving
            if job.asynchronous:
                self.pending_recv[job.req_id] = reads
            else:
                for slot, key in reads:
                    assert self.pool.get(slot) == key, f"sync load of {job.req_id} reads a stale slot {slot}"
        self._apply_saves(meta, meta.saves_after)  # after the forward
        if self.auto_recv:
            self.recv_done.update(self.pending_recv)
        recving = set()
        for rid in list(self.recv_done):
            reads = self.pending_recv.pop(rid, None)
            if reads is None:
                continue
            for slot, key in reads:
                assert self.pool.get(slot) == key, f"async load of {rid} reads a stale slot {slot}"
            recving.add(rid)
        self.recv_done -= recving
        # Final saves ran before the forward: vLLM held those requests' blocks for them.
        return {job.req_id for job in meta.saves}, recving

    def _apply_saves(self, meta: KVTierMetadata, jobs: list) -> None:
        for job in jobs:
            assert len(job.block_ids) == len(job.slots) == len(job.keys)
            for slot, key in zip(job.slots, job.keys, strict=True):
                assert 0 <= slot < meta.num_slots
                for rid, reads in self.pending_recv.items():
                    assert slot not in {s for s, _ in reads}, (
                        f"save of {job.req_id} overwrites slot {slot} under the in-flight "
                        f"async load of {rid}")
                self.pool[slot] = key

    def step(self, scheduler: Scheduler) -> SchedulerOutput:
        out = scheduler.schedule()
        meta = meta_of(out)
        self.metas.append(meta)
        self.outputs.append(out)
        sending, recving = self._apply(scheduler, meta)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = scheduler.requests[rid]
            # Partial prefill chunks sample nothing (the runner discards the token).
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([SAMPLED_TOKEN] if done else [])
        invalid, self.fail_blocks = self.fail_blocks, set()
        failed = self.failed_recving & recving
        self.failed_recving -= failed
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                invalid_block_ids=invalid,
                failed_recving=failed,
            ),
        )
        # Every chunk write (demotion, write-through) is durable in its own step, as on a
        # rank whose store wrote it.
        written = {(job.tier, job.chunk_id): 1 for job in meta.demotes + meta.write_through}
        if written:
            mro.kv_connector_output.kv_connector_worker_meta = KVTierWorkerMeta(written=written)
        scheduler.update_from_output(out, mro)
        return out

    def run_until_idle(self, scheduler: Scheduler, max_steps: int = 200) -> list[SchedulerOutput]:
        outs = []
        for _ in range(max_steps):
            if not scheduler.has_requests():
                return outs
            outs.append(self.step(scheduler))
        raise AssertionError(f"scheduler not idle after {max_steps} steps")


def all_saves(metas: Iterable[KVTierMetadata], req_id: str | None = None) -> list:
    return [j for m in metas for j in m.saves + m.saves_after if req_id is None or j.req_id == req_id]


def all_loads(metas: Iterable[KVTierMetadata], req_id: str | None = None) -> list:
    return [j for m in metas for j in m.loads if req_id is None or j.req_id == req_id]


def assert_scheduler_empty(scheduler: Scheduler, initial_free_blocks: int) -> None:
    """Nothing left anywhere: no request, every GPU block free, no connector state."""
    assert not scheduler.requests
    assert not scheduler.running
    assert len(scheduler.waiting) == 0
    assert len(scheduler.kv_holding_waiting) == 0
    assert not scheduler.finished_recving_kv_req_ids
    assert not scheduler.failed_recving_kv_req_ids
    assert free_blocks(scheduler) == initial_free_blocks
    for block in scheduler.kv_cache_manager.block_pool.blocks:
        assert block.ref_cnt == 0 or block.is_null
    half = sched_half(scheduler)
    assert not half.planner.tracked_requests() and not half.planner.held_requests()
    assert not half.planner.has_pending_work()
    assert not any(half.planner.index.is_pinned(s) for s in range(half.planner.index.num_slots))


__all__ = [
    "BLOCK_SIZE", "RequestStatus", "FakeWorker", "all_loads", "all_saves",
    "assert_scheduler_empty", "block_bytes", "connector", "free_blocks", "make_request",
    "make_scheduler", "make_vllm_config", "meta_of", "prompt_tokens", "sched_half",
]
