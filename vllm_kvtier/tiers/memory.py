"""The reference :class:`~vllm_kvtier.tiers.base.BlockTier`: blocks in a dict, in process memory.

It is what the contract means, written as plainly as possible, and the fake that higher
layers test against. Like every medium it stores a CRC32 per block and verifies it on
``get``, so a higher layer can drill the checksum path: flip a byte in :meth:`MemoryTier.raw`.
"""

from __future__ import annotations

import logging
import zlib
from collections import OrderedDict

from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.base import count_failure, refusal

logger = logging.getLogger(__name__)


class MemoryTier:
    """Dict of key -> (bytes, CRC32), least recently used first. See BlockTier for the contract."""

    def __init__(self, capacity_bytes: int, block_bytes: int, *, name: str = "memory") -> None:
        if block_bytes <= 0 or capacity_bytes < 0:
            raise ValueError(
                f"need block_bytes > 0 and capacity_bytes >= 0, got {block_bytes}, {capacity_bytes}"
            )
        self.name = name
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self.counters = Counters()
        self._blocks: OrderedDict[bytes, tuple[bytearray, int]] = OrderedDict()
        self._closed = False

    def put(self, key: bytes, data: bytes | memoryview) -> bool:
        why = "tier is closed" if self._closed else refusal(key, data, self.block_bytes)
        if why is None and self.block_bytes > self.capacity_bytes:
            why = f"capacity {self.capacity_bytes} B holds no block of {self.block_bytes} B"
        if why is not None:
            count_failure(self, "store_failures", key, why, logger)
            return False
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return True
        while self.usage_bytes() + self.block_bytes > self.capacity_bytes:
            self._blocks.popitem(last=False)
            self.counters.add("evictions", self.name)
        buf = bytearray(data)
        self._blocks[key] = (buf, zlib.crc32(buf))
        return True

    def get(self, key: bytes) -> bytes | None:
        entry = None if self._closed else self._blocks.get(key)
        if entry is None:
            return None
        buf, crc = entry
        if zlib.crc32(buf) != crc:
            del self._blocks[key]
            count_failure(self, "load_failures", key, "checksum mismatch", logger)
            return None
        self._blocks.move_to_end(key)
        return bytes(buf)

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def delete(self, key: bytes) -> bool:
        return self._blocks.pop(key, None) is not None

    def usage_bytes(self) -> int:
        return len(self._blocks) * self.block_bytes

    def close(self) -> None:
        self._closed = True
        self._blocks.clear()

    def raw(self, key: bytes) -> bytearray | None:
        """The stored bytes of ``key`` themselves, not a copy: for fault drills (flip a byte,
        then ``get`` must miss). Does not refresh recency. None if absent."""
        entry = self._blocks.get(key)
        return None if entry is None else entry[0]
