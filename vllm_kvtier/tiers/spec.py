"""What every medium's spec shares (:class:`~vllm_kvtier.tiers.registry.TierSpec`): the
defaults, and opening stores so that a tier which cannot start is logged, counted and off.

Who calls it: the specs of :mod:`vllm_kvtier.tiers` (and out-of-tree ones), at start-up,
in the scheduler and in every worker. Opening a store may block.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any

from vllm_kvtier.catalog.base import Listing
from vllm_kvtier.errors import ConfigError, run_all
from vllm_kvtier.metrics import CounterName, Counters
from vllm_kvtier.tiers.registry import CatalogContext, StoreContext, TierSpec, open_store

if TYPE_CHECKING:
    from vllm_kvtier.chunkformat import ChunkHeader
    from vllm_kvtier.tiers.base import ChunkStore

logger = logging.getLogger(__name__)

__all__ = ["MediumSpec", "close_all", "open_or_none", "open_ranks"]


class MediumSpec:
    """Defaults of a spec: shared, named by chunk id, no extra dependency, no start-up
    work. A medium sets its attributes and writes ``open_store`` and ``open_catalog``."""

    name: str = ""
    section_type: type = object
    shared: bool = True
    key_named: bool = False
    requires: tuple[str, ...] = ()
    install_hint: str = ""

    def open_store(self, section: Any, ctx: StoreContext) -> ChunkStore:
        raise NotImplementedError

    def open_catalog(self, section: Any, ctx: CatalogContext) -> Listing:
        raise NotImplementedError

    def start_up(self, store: ChunkStore, section: Any, ctx: StoreContext, counters: Counters,
                 ) -> dict[str, ChunkHeader]:
        return {}


def open_or_none(spec: TierSpec, section: Any, ctx: StoreContext, counters: Counters, verb: str) -> ChunkStore | None:
    """``spec``'s store, or None when it cannot start here: logged and counted
    (``store_failures``), and serving goes on without it. ``verb``: what the log line says
    could not be done ("use", "reach"). A ConfigError (a setting that cannot run here)
    stops start-up."""
    try:
        return open_store(spec, section, ctx)
    except ConfigError:
        raise
    except Exception as e:  # OSError, ConnectionError, ImportError with the install hint...
        # Nothing is touched: an unsafe or locked NVMe directory (another engine's) stays as it is.
        logger.error("kvtier %s: tier disabled, cannot %s %s: %s", spec.name, verb, section.endpoint, e)
        counters.add(CounterName.STORE_FAILURES, spec.name)
        return None


def open_ranks(spec: TierSpec, section: Any, ctx: CatalogContext) -> list[ChunkStore] | None:
    """Every rank's store, opened for lookups; None (logged, counted) if one cannot."""
    stores: list[ChunkStore] = []
    for r in range(ctx.world_size):
        st = open_or_none(spec, section, dataclasses.replace(ctx.store, rank=r), ctx.counters, "reach")
        if st is None:
            close_all(stores)
            return None
        stores.append(st)
    return stores


def close_all(stores: list[ChunkStore]) -> None:
    """Close the scheduler's stores of a tier, each within a second."""
    run_all(functools.partial(st.close, timeout_s=1.0) for st in stores)
