"""The sections on what the connector publishes: ``exporter`` (a Prometheus endpoint of
its own) and ``events`` (bounds of the KV events vLLM collects)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvtier.config.checks import in_range


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
            in_range("exporter.port", self.port, 0, 65535)


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
        in_range("events.max_queued_blocks", self.max_queued_blocks, 1, 1 << 24)
        in_range("events.max_block_info", self.max_block_info, 0, 1 << 24)
