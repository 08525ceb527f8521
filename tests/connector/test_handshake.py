"""The workers' start-up handshake: the scheduler plans for the smallest rank's CPU pool,
over every pipeline stage, and ignores what another connector sent (vLLM's MultiConnector
hands one connector's handshake to all of them)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from vllm_kvtier.config import parse_config
from vllm_kvtier.connector import KVTierConnector
from vllm_kvtier.connector.metadata import KVTierHandshake
from vllm_kvtier.connector.scheduler import SchedulerHalf
from vllm_kvtier.engine.scheduler import GroupedPlanner, PlannerSetup


@dataclass
class _OtherConnectorsPayload(KVConnectorHandshakeMetadata):
    agent: str = "someone else's"


def _connector(num_slots: int) -> KVTierConnector:
    """A scheduler-role connector holding only its planner (what the handshake touches)."""
    conn = object.__new__(KVTierConnector)
    cfg = parse_config({"cpu": {"capacity_bytes": 1 << 20}})
    conn._sched = SchedulerHalf(GroupedPlanner(cfg, PlannerSetup(32, num_slots, 1024)))
    return conn


def test_the_smallest_rank_over_every_pipeline_stage_sizes_the_index():
    conn = _connector(100)
    conn.set_xfer_handshake_metadata_pp_aware({
        (0, 0): KVTierHandshake(rank=0, num_slots=64), (0, 1): KVTierHandshake(rank=1, num_slots=64),
        (1, 0): KVTierHandshake(rank=2, num_slots=60), (1, 1): _OtherConnectorsPayload(),
    })
    assert conn._sched.planner.index.num_slots == 60


def test_another_connectors_handshake_leaves_the_estimate():
    conn = _connector(100)
    conn.set_xfer_handshake_metadata_pp_aware({(0, 0): _OtherConnectorsPayload()})
    assert conn._sched.planner.index.num_slots == 100
