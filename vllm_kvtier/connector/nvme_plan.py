"""Scheduler-side policy of the NVMe tier: admission, demotion, chunking, eviction.

Who calls it: :class:`~vllm_kvtier.connector.scheduler.SchedulerHalf`, from vLLM's
scheduler thread. No I/O except the header scan at start-up.

* **Admission** (SSD endurance): a block is written only once it appeared in at least
  ``admit_min_seen`` requests' prompts (counted here, in a bounded table).
* **Write-back** (default): a block goes to NVMe when the CPU tier evicts it; the worker
  copies the slot out before the same step's saves reuse it. **Write-through**: every
  admitted block saved to the CPU tier is also written at once.
* **Chunking**: one step's writes are grouped, in order, into files of up to
  ``chunk_blocks`` blocks, so disk I/Os are large.
* **Capacity**: bytes are reserved when a write is planned; LRU files are evicted (and
  deleted by the worker) to make room. A key becomes loadable only when every TP rank
  reported its file durable.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from vllm_kvtier.config import NVMeTierConfig
from vllm_kvtier.connector.metadata import KVTierWorkerMeta, NVMeWriteJob
from vllm_kvtier.index.chunk_index import ChunkIndex
from vllm_kvtier.index.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.chunkfile import align_up, header_bytes_for
from vllm_kvtier.tiers.nvme import file_id_for, rank_dir, scan_dir

logger = logging.getLogger(__name__)

TIER = "nvme"
_SEEN_TABLE_SIZE = 1 << 18  # keys whose request count we remember (~30 MB at most)
#: Circuit breaker: after this many write failures in a row, stop writing for a while.
_BREAKER_FAILURES = 8
_BREAKER_PAUSE_S = 30.0


class NVMePlanner:
    def __init__(
        self, cfg: NVMeTierConfig, *, namespace: str, world_size: int, block_bytes_per_rank: int,
        counters: Counters,
    ) -> None:
        self.cfg = cfg
        self.world_size = world_size
        self.block_bytes = block_bytes_per_rank
        self.counters = counters
        # Capacity is per engine; each rank stores its shard of every file.
        self.index = ChunkIndex(cfg.capacity_bytes // world_size)
        self._seen: OrderedDict[BlockKey, int] = OrderedDict()
        self._demote: list[tuple[int, BlockKey]] = []
        self._through: list[tuple[int, BlockKey]] = []
        self._deletes: list[str] = []
        self._acks: dict[str, int] = {}
        #: Files that failed on some rank: a late "written" from another rank is ignored.
        self._failed_files: OrderedDict[str, None] = OrderedDict()
        self._failures_in_a_row = 0
        self._paused_until = 0.0
        self._rebuild(namespace)

    # ---- start-up ----------------------------------------------------------------

    def _rebuild(self, namespace: str) -> None:
        """Index what previous engines left on disk: files present on every rank."""
        per_rank = [scan_dir(rank_dir(self.cfg.path, namespace, r), namespace)[0] for r in range(self.world_size)]
        common = set(per_rank[0]).intersection(*per_rank[1:]) if per_rank else set()
        n_blocks = 0
        for fid in sorted(common):
            h = per_rank[0][fid]
            if h.block_bytes != self.block_bytes:
                continue
            if self.index.add_existing(fid, [BlockKey(k) for k in h.keys], h.total_bytes):
                n_blocks += h.nblocks
            else:
                self._deletes.append(fid)
        if common:
            logger.info("kvtier nvme: found %d blocks in %d files under %s", n_blocks, len(common), self.cfg.path)

    # ---- admission -----------------------------------------------------------------

    def note_request(self, keys: Sequence[bytes]) -> None:
        """Count one more request whose prompt holds ``keys``."""
        seen = self._seen
        for k in keys:
            key = BlockKey(k)
            seen[key] = seen.get(key, 0) + 1
            seen.move_to_end(key)
        while len(seen) > _SEEN_TABLE_SIZE:
            seen.popitem(last=False)

    def admitted(self, key: BlockKey) -> bool:
        if self._paused_until and time.monotonic() < self._paused_until:
            return False  # the breaker is open: the disk keeps failing
        return self._seen.get(key, 0) >= self.cfg.admit_min_seen and not self.index.knows(key)

    # ---- events from the CPU tier ----------------------------------------------------

    def on_cpu_evict(self, slot: int, key: BlockKey) -> None:
        if self.cfg.mode == "write-back" and self.admitted(key):
            self._demote.append((slot, key))

    def on_cpu_save(self, slot: int, key: BlockKey) -> None:
        if self.cfg.mode == "write-through" and self.admitted(key):
            self._through.append((slot, key))

    # ---- per step --------------------------------------------------------------------

    def file_bytes(self, nblocks: int) -> int:
        return header_bytes_for(nblocks) + nblocks * align_up(self.block_bytes)

    def _chunk(self, items: list[tuple[int, BlockKey]]) -> list[NVMeWriteJob]:
        jobs = []
        n = self.cfg.chunk_blocks
        for i in range(0, len(items), n):
            part = [(s, k) for s, k in items[i : i + n] if not self.index.knows(k)]
            if not part:
                continue
            keys = [k for _, k in part]
            fid = file_id_for(keys)
            evicted = self.index.reserve(fid, keys, self.file_bytes(len(keys)))
            if evicted is None:
                self.counters.add("store_skipped", TIER, len(keys))
                continue
            self._deletes.extend(evicted)
            jobs.append(NVMeWriteJob(fid, tuple(s for s, _ in part), tuple(keys)))
        return jobs

    def take_jobs(
        self, saved_this_step: set[BlockKey], cpu_slot_of: Callable[[BlockKey], int | None]
    ) -> tuple[list[NVMeWriteJob], list[NVMeWriteJob], list[str]]:
        """(demotes, write-through writes, deletes) for this step's metadata.

        The worker copies demoted slots *before* this step's saves and write-through slots
        *after* them, so a pair is dropped when the slot will not hold that key's bytes at
        that moment: a demoted key saved in this same step (its bytes never reached the
        slot), or a write-through key whose slot was reused later in the step.
        """
        self._demote = [(s, k) for s, k in self._demote if k not in saved_this_step]
        self._through = [(s, k) for s, k in self._through if cpu_slot_of(k) == s]
        before = self.index.evicted_blocks
        demotes = self._chunk(self._demote)
        through = self._chunk(self._through)
        self.counters.add("evictions", TIER, self.index.evicted_blocks - before)
        deletes = self._deletes
        self._demote, self._through, self._deletes = [], [], []
        self.counters.set_gauge("usage_bytes", TIER, self.index.used_bytes * self.world_size)
        self.counters.set_gauge("capacity_bytes", TIER, self.index.capacity_bytes * self.world_size)
        return demotes, through, deletes

    def drop_key(self, key: BlockKey) -> None:
        """``key``'s bytes are wrong (computed on top of a failed load): drop the file that
        holds or is writing it."""
        fid = self.index.file_holding(key)
        if fid is not None:
            self.index.remove(fid)
            self._acks.pop(fid, None)
            self._deletes.append(fid)

    def on_worker_meta(self, meta: KVTierWorkerMeta) -> None:
        if meta.failed:
            self._failures_in_a_row += len(meta.failed)
            if self._failures_in_a_row >= _BREAKER_FAILURES:
                logger.warning("kvtier nvme: %d writes failed in a row; pausing writes for %.0f s",
                               self._failures_in_a_row, _BREAKER_PAUSE_S)
                self._paused_until = time.monotonic() + _BREAKER_PAUSE_S
                self._failures_in_a_row = 0
        elif meta.written:
            self._failures_in_a_row = 0
        for fid in meta.failed | meta.bad:
            self._acks.pop(fid, None)
            self._failed_files[fid] = None
            while len(self._failed_files) > 4096:
                self._failed_files.popitem(last=False)
            if self.index.remove(fid):
                logger.warning("kvtier nvme: dropped chunk %s (write failed or unreadable)", fid)
            self._deletes.append(fid)  # delete whatever a rank may have left
        for fid, n in meta.written.items():
            if fid in meta.failed or fid in self._failed_files:
                continue
            self._acks[fid] = self._acks.get(fid, 0) + n
            if self._acks[fid] >= self.world_size:
                del self._acks[fid]
                self.index.confirm(fid)
