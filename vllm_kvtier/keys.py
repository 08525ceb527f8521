"""Names every layer shares, at the bottom of the house (imports nothing internal).

A :data:`BlockKey` is vLLM's chained block hash (``request.block_hashes[i]``). It names
the whole token prefix up to the end of block ``i``. That includes LoRA, multimodal inputs
and ``cache_salt``, which vLLM folds into the hash. It does not name the model or the KV
layout; the :func:`namespace` digest does. Every tier that outlives one engine stores keys
inside it, so KV from an incompatible engine is never read back.

:class:`TierName` names a tier in counters, metadata and logs. It is a ``StrEnum``: a
member equals its string (``TierName.NVME == "nvme"``). So it crosses process boundaries
as a plain string, and metric labels stay what operators' dashboards already use.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Literal, NewType


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
EvictionName = Literal["lru", "s3fifo", "arc", "kvaware"]

#: Chunk ids, object ids and writer ids: safe in any file name, object key or log line.
SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


BlockKey = NewType("BlockKey", bytes)

#: Bump when the byte layout of a stored block changes.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class NamespaceFields:
    """Everything that changes the bytes of a stored block."""

    model: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int
    tp_rank: int
    layout: str
    hash_algo: str
    format_version: int = FORMAT_VERSION
    #: the KV cache groups of a hybrid model (:meth:`~vllm_kvtier.index.groups.GroupLayout.describe`);
    #: empty for one group, and then not part of the digest (namespaces of 0.1 unchanged)
    groups: str = ""


def namespace(fields: NamespaceFields) -> str:
    """A short stable digest of ``fields`` (hex, 16 characters)."""
    d = asdict(fields)
    if not d["groups"]:
        del d["groups"]
    blob = json.dumps(d, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
