"""The ``cpu`` section: the CPU DRAM tier, the top of the hierarchy below the GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm_kvtier.config.checks import at_most, positive
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.keys import EvictionName

#: The longest key pin a request may ever ask for (``cpu.max_pin_ttl_s`` at most): a week.
MAX_PIN_TTL_S = 7 * 86400.0


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
            positive("cpu.capacity_bytes", self.capacity_bytes)
        positive("cpu.max_pin_ttl_s", self.max_pin_ttl_s)
        at_most("cpu.max_pin_ttl_s", self.max_pin_ttl_s, MAX_PIN_TTL_S)
        if not 0.0 < self.capacity_fraction <= 0.9:
            raise ConfigError("cpu.capacity_fraction",
                              f"must be in (0, 0.9] (0.5-0.7 is usual), got {self.capacity_fraction}")
        if not 0.0 <= self.max_pinned_fraction <= 0.9:
            raise ConfigError("cpu.max_pinned_fraction",
                              f"must be in [0, 0.9] (keep room for unpinned blocks), got {self.max_pinned_fraction}")
