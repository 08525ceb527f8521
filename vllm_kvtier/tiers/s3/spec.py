"""The S3 tier's spec: a shared bucket, listed at start-up and rescanned on a thread.

Who calls it: the tier registry's callers, at start-up. The scheduler's stores only list
and read headers (boto3); its listing is bounded by ``s3.scan_deadline_s``. boto3 is
imported only when a store opens.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from vllm_kvtier.catalog.base import Found, Listed, Listing, common_chunks
from vllm_kvtier.catalog.rescan import Rescanner
from vllm_kvtier.config import S3TierConfig
from vllm_kvtier.keys import TierName
from vllm_kvtier.metrics import CounterName, GaugeName
from vllm_kvtier.tiers.registry import CatalogContext, StoreContext
from vllm_kvtier.tiers.spec import MediumSpec, close_all, open_ranks

if TYPE_CHECKING:
    from vllm_kvtier.tiers.base import ChunkStore
    from vllm_kvtier.tiers.s3.store import S3Store

logger = logging.getLogger(__name__)

INSTALL_HINT = "the S3 tier needs boto3: pip install 'vllm-kvtier[s3]'"


class S3Spec(MediumSpec):
    name = TierName.S3
    section_type = S3TierConfig
    requires = ("boto3",)
    install_hint = INSTALL_HINT

    def open_store(self, section: S3TierConfig, ctx: StoreContext) -> ChunkStore:
        from vllm_kvtier.tiers.s3.store import S3Store

        return S3Store.from_config(section, ctx)

    def open_catalog(self, section: S3TierConfig, ctx: CatalogContext) -> Listing:
        """Every rank's prefix listed now, then rescanned on a thread to find what other
        instances stored. Chunks on only some ranks that this host's own manifest names
        are handed back for deletion."""
        opened = open_ranks(self, section, ctx)
        if opened is None:
            return Listing.empty(ctx.world_size)
        stores: list[S3Store] = opened  # type: ignore[assignment]
        found = _scan(stores, section.store.scan_deadline_s)
        counters = ctx.counters
        counters.add(CounterName.MANIFESTS_REFUSED, TierName.S3, sum(st.last_scan.manifests_refused for st in stores))
        cut = [st.rank for st in stores if st.last_scan.cut_short]
        if cut:
            counters.add(CounterName.SCAN_CUT_SHORT, TierName.S3, len(cut))
            logger.warning("kvtier s3: start-up scan of rank(s) %s cut short by s3.scan_deadline_s (%.0f s): "
                           "indexed what it reached, the rescans find the rest", cut, section.store.scan_deadline_s)
        # Chunks on only some ranks (a write in flight, a crashed one) are never indexed; those
        # our own manifest names (this host, rank and namespace before the restart: no other
        # live writer) are deleted, unless a scan was cut short (then they may be on every rank).
        partial = set().union(*found) - set(common_chunks(found))
        counters.set_gauge(GaugeName.PARTIAL_CHUNKS, TierName.S3, len(partial))
        own: set[str] = set().union(*(st.take_own_objects() for st in stores))
        for st in stores:
            r = st.last_scan
            logger.info("kvtier s3: rank %d: %d objects in the bucket (%d LIST, %d manifest GET, %d header GET)%s",
                        st.rank, r.objects, r.list_requests, r.manifest_gets, r.header_gets,
                        f"; problems {r.problems}" if r.problems else "")

        def rescan_counts() -> dict[CounterName, int]:
            return {CounterName.MANIFESTS_COLLECTED: sum(st.last_scan.manifests_collected for st in stores),
                    CounterName.MANIFESTS_REFUSED: sum(st.last_scan.manifests_refused for st in stores)}

        def close() -> None:
            close_all(opened)

        catalog = (Rescanner(TierName.S3, lambda: _rescan(stores), section.rescan_interval_s, initial=found,
                             counts=rescan_counts, on_close=close)
                   if section.rescan_interval_s > 0 else Listed(close))
        return Listing(found, catalog=catalog, local_chunks=frozenset(own),  # KV events: the rest is REMOTE
                       reclaim=() if cut else tuple(sorted(partial & own)))


def _scan(stores: list[S3Store], deadline_s: float) -> Found:
    """The start-up scan, within ``deadline_s`` for every rank together (each rank gets
    an equal share of what is left when its turn comes)."""
    end = time.monotonic() + deadline_s
    out = []
    for i, st in enumerate(stores):
        now = time.monotonic()
        out.append(st.scan(deadline=now + max(0.0, end - now) / (len(stores) - i)).found)
    return out


def _rescan(stores: list[S3Store]) -> Found:
    """A live instance's rescan (the rescan thread): collects stale manifests, and
    raises if a listing failed (a failed listing is not "everything was deleted")."""
    out = []
    for st in stores:
        got = st.scan(collect=True).found
        r = st.last_scan
        if not r.complete:
            raise RuntimeError(f"listing rank {st.rank} failed: {r.problems}")
        if r.manifests_collected:
            logger.info("kvtier s3: rank %d: deleted %d stale manifest(s)", st.rank, r.manifests_collected)
        out.append(got)
    return out


SPEC = S3Spec()
