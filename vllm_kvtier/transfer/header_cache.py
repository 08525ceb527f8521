"""The chunk headers one chunk driver holds (:class:`HeaderCache`).

Who calls it: its :class:`~vllm_kvtier.transfer.tier_io.ChunkWorker`, from the worker's
main thread only. A read needs its chunk's header, unless the store can fetch it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from vllm_kvtier.chunkformat import ChunkHeader, header_memory_bytes


class HeaderCache:
    """Headers by chunk id, oldest kept first.

    A store that cannot fetch a header (NVMe) needs every chunk's: all are kept. One that
    can (``bounded``: S3, Mooncake, a replica reader) makes this an LRU cache. It holds at
    most ``max_entries`` headers and ``max_bytes`` of their memory
    (:func:`~vllm_kvtier.chunkformat.header_memory_bytes`). A header dropped costs one
    more ranged GET at that chunk's next read."""

    def __init__(self, headers: Mapping[str, ChunkHeader] | None, *, bounded: bool, max_entries: int,
                 max_bytes: int) -> None:
        self.entries: OrderedDict[str, ChunkHeader] = OrderedDict(headers or {})
        self.bounded = bounded
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        #: memory the headers hold (``bounded`` only)
        self._bytes = 0
        if bounded:
            self._bytes = sum(map(header_memory_bytes, self.entries.values()))
            self._trim()

    def get(self, chunk_id: str) -> ChunkHeader | None:
        return self.entries.get(chunk_id)

    def keep(self, chunk_id: str, header: ChunkHeader) -> None:
        """``chunk_id``'s header, newest now; the oldest go while a bound is passed."""
        if not self.bounded:
            self.entries[chunk_id] = header
            return
        self.drop(chunk_id)
        self.entries[chunk_id] = header
        self._bytes += header_memory_bytes(header)
        self._trim()

    def drop(self, chunk_id: str) -> None:
        h = self.entries.pop(chunk_id, None)
        if h is not None and self.bounded:
            self._bytes -= header_memory_bytes(h)

    def _trim(self) -> None:
        """LRU out until both bounds hold (``bounded`` only)."""
        while self.entries and (len(self.entries) > self.max_entries or self._bytes > self.max_bytes):
            self._bytes -= header_memory_bytes(self.entries.popitem(last=False)[1])
