"""The NVMe tier's spec: a private medium, one directory per rank under its lock.

Who calls it: the tier registry's callers, at start-up. The scheduler scans every rank's
directory read-only (:meth:`NVMeSpec.open_catalog`: it takes no lock); each worker opens
its own directory, takes its lock, then lists and cleans it (:meth:`NVMeSpec.start_up`).
All of it may block on the file system.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from vllm_kvtier.catalog.base import Listing
from vllm_kvtier.config import NVMeTierConfig
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, Counters, GaugeName
from vllm_kvtier.tiers.auth import refusal_reason
from vllm_kvtier.tiers.base import Scannable
from vllm_kvtier.tiers.nvme.dirs import (
    collect_namespace,
    foreign_namespaces,
    lock_holder,
    uncreatable_reason,
    unsafe_reason,
)
from vllm_kvtier.tiers.nvme.store import UNREADABLE_KEPT, NVMeStore, other_bytes, rank_dir, scan_dir
from vllm_kvtier.tiers.registry import CatalogContext, StoreContext
from vllm_kvtier.tiers.spec import MediumSpec

if TYPE_CHECKING:
    from vllm_kvtier.chunkformat import ChunkHeader
    from vllm_kvtier.tiers.base import ChunkStore

logger = logging.getLogger(__name__)


class NVMeSpec(MediumSpec):
    name = TierName.NVME
    section_type = NVMeTierConfig
    shared = False

    def open_store(self, section: NVMeTierConfig, ctx: StoreContext) -> ChunkStore:
        return NVMeStore.from_config(section, ctx)

    def open_catalog(self, section: NVMeTierConfig, ctx: CatalogContext) -> Listing:
        """A read-only scan of every rank's directory.

        Some directories turn the tier off here too. One is a directory held by another
        engine (its lock). Another is one the worker will refuse as unsafe (another user's,
        writable by others). Another is one it cannot create (a path under a file, a
        read-only parent). Then nothing of it is indexed and nothing is written. The
        worker's tier is off as well. No store is opened: that takes the lock.

        The scheduler usually runs on the workers' host, so it sees the path as they
        will. A path that only a worker's host lacks still fails there alone: each failed
        write is counted, and the write breaker pauses the tier."""
        n, ns, engine, world = section, ctx.store.namespace, ctx.store.engine, ctx.world_size
        dirs = [rank_dir(n.path, ns, r, engine) for r in range(world)]
        held = [(d, who) for d in dirs if (who := lock_holder(d)) is not None]
        unsafe = [why for r in range(world)
                  if (why := unsafe_reason(n.path, ns, r, engine) or uncreatable_reason(n.path, ns, r, engine))
                  is not None]
        if held or unsafe:
            if held:
                d, who = held[0]
                logger.error("kvtier nvme: tier disabled: %s is held by another engine (%s); two engines must not "
                             "share one NVMe directory (give each its own nvme.path); serving goes on without it",
                             d, who)
            else:
                logger.error("kvtier nvme: tier disabled: %s; serving goes on without it", unsafe[0])
            ctx.counters.add(CounterName.STORE_FAILURES, TierName.NVME)
            return Listing.empty(world, writable=False)
        refuses = functools.partial(refusal_reason, ctx.store.auth)
        # A chunk some rank could not read (EMFILE, EIO...) may be whole: never reclaimed.
        unread: set[str] = set()
        found = [scan_dir(d, ns, max_blocks=n.chunk_blocks, block_bytes=ctx.store.block_bytes, rank=r,
                          refuses=refuses, kept=unread)[0]
                 for r, d in enumerate(dirs)]
        # Capacity covers every byte the tier leaves in its directories, not only the chunks.
        reserved = max(other_bytes(d) for d in dirs)
        return Listing(found, reserved_bytes_per_rank=reserved, unread=frozenset(unread))

    def start_up(self, store: ChunkStore, section: NVMeTierConfig, ctx: StoreContext, counters: Counters,
                 ) -> dict[str, ChunkHeader]:
        """Every chunk the writer's directory holds, its debris deleted; what was dropped
        or kept unread is logged and counted. A replica reader lists nothing (it fetches
        headers). Rank 0 of data-parallel engine 0 also reports other namespaces' directories."""
        if ctx.replica or not isinstance(store, Scannable):
            return {}
        scanned = store.scan(cleanup=True)
        for reason, count in scanned.problems.items():
            kept = reason in ("not_regular", UNREADABLE_KEPT)  # neither is deleted (see scan_dir)
            logger.warning("kvtier nvme: %d file(s) %s at start-up: %s", count,
                           "skipped (kept)" if kept else "dropped", reason)
            counters.add(CounterName.LOAD_FAILURES, TierName.NVME, count)
            if not kept:
                counters.add(CounterName.RECLAIMED_FILES, TierName.NVME, count)
        if ctx.rank == 0 and ctx.engine == 0:
            _foreign_namespaces(section, ctx.namespace, counters)
        return scanned.found


def _foreign_namespaces(n: NVMeTierConfig, own: str, counters: Counters) -> None:
    """Report (and with ``nvme.gc_foreign_namespaces``, collect) the directories other
    namespaces left under ``nvme.path``: once per host, once its own lock is held."""
    left = 0
    for ns in foreign_namespaces(n.path, {own}):
        age = "no file" if ns.newest_age_s is None else f"newest file {ns.newest_age_s / 3600:.1f} h old"
        if n.gc_foreign_namespaces and not ns.keep_reason:
            freed = collect_namespace(ns)
            if freed or not ns.path.exists():
                logger.warning("kvtier nvme: collected namespace directory %s (%d files, %d bytes, %s)",
                               ns.path, ns.files, freed, age)
                counters.add(CounterName.RECLAIMED_BYTES, TierName.NVME, freed)
                continue
        left += ns.nbytes
        why = ns.keep_reason or "set nvme.gc_foreign_namespaces: true to delete it"
        logger.warning("kvtier nvme: another namespace's directory %s holds %d files, %d bytes (%s): KV this "
                       "engine never reads; kept: %s", ns.path, ns.files, ns.nbytes, age, why)
    counters.set_gauge(GaugeName.FOREIGN_BYTES, TierName.NVME, left)


SPEC = NVMeSpec()
