"""Names every layer shares, at the bottom of the house (imports nothing internal).

:class:`TierName` names a tier in counters, metadata and logs. It is a ``StrEnum``: a
member equals its string (``TierName.NVME == "nvme"``), so it crosses process boundaries
as a plain string and metric labels stay what operators' dashboards already use.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Literal


class TierName(StrEnum):
    """Where a block is held or comes from."""

    CPU = "cpu"
    NVME = "nvme"
    S3 = "s3"
    MOONCAKE = "mooncake"
    #: P/D peer to peer: another instance's CPU tier, read over NIXL.
    PEER = "peer"
    #: A counter that is not about one tier (``load_probes|all``, ``handoff_timeouts|all``).
    ALL = "all"


#: Eviction policies of the CPU tier (``cpu.eviction``; :mod:`vllm_kvtier.index.policy`).
EvictionName = Literal["lru", "s3fifo"]

#: Chunk ids, object ids and writer ids: safe in any file name, object key or log line.
SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
