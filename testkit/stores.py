"""Stores opened by hand, as tests, benchmarks and examples do.

A store opens from its config section and a context, as the registry opens it. An NVMe
section needs a capacity, which a store never reads; :func:`nvme_section` fills it in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vllm_kvtier.chunkformat import MAX_CHUNK_BLOCKS
from vllm_kvtier.config.lower import NVMeTierConfig

__all__ = ["nvme_section"]


def nvme_section(path: str | Path, **options: Any) -> NVMeTierConfig:
    """An NVMe section for a store at ``path``, with any of the section's fields. Unless
    given, a store opened by hand uses 2 I/O threads and reads chunks of up to
    :data:`~vllm_kvtier.chunkformat.MAX_CHUNK_BLOCKS` blocks."""
    options.setdefault("io_threads", 2)
    options.setdefault("chunk_blocks", MAX_CHUNK_BLOCKS)
    return NVMeTierConfig(path=os.path.abspath(path), capacity_bytes=1 << 40, **options)
