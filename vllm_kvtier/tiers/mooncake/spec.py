"""The Mooncake tier's spec: a shared key-value pool, one object per block, named by its key.

Who calls it: the tier registry's callers, at start-up. A pool cannot be listed: the
scheduler's catalog asks the master which chunks exist, on a thread of its own
(:class:`~vllm_kvtier.catalog.pool.PoolLookup`), each lookup bounded by
``lookup_timeout_s``. The mooncake package is imported only when a store opens.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, cast

from vllm_kvtier.catalog.base import Listing
from vllm_kvtier.catalog.pool import PoolLookup
from vllm_kvtier.config import MooncakeTierConfig
from vllm_kvtier.keys import TierName
from vllm_kvtier.tiers.base import Probeable
from vllm_kvtier.tiers.registry import CatalogContext, StoreContext
from vllm_kvtier.tiers.spec import MediumSpec, close_all, open_ranks

if TYPE_CHECKING:
    from vllm_kvtier.tiers.base import ChunkStore

INSTALL_HINT = (
    "the Mooncake tier needs the mooncake-transfer-engine package and libibverbs: "
    "pip install mooncake-transfer-engine (GPU hosts) or mooncake-transfer-engine-non-cuda "
    "(CPU-only), and apt-get install libibverbs1 (tools/setup-remote.sh does both for tests)")


class MooncakeSpec(MediumSpec):
    name = TierName.MOONCAKE
    section_type = MooncakeTierConfig
    key_named = True
    requires = ("mooncake.store",)
    install_hint = INSTALL_HINT

    def open_store(self, section: MooncakeTierConfig, ctx: StoreContext) -> ChunkStore:
        from vllm_kvtier.tiers.mooncake.store import MooncakeStore

        return MooncakeStore.from_config(section, ctx)

    def open_catalog(self, section: MooncakeTierConfig, ctx: CatalogContext) -> Listing:
        """Lookups by key through every rank's client (a pure client: no pool memory of
        its own). A read-only pool (``kv_consumer``) is never written."""
        writable = not ctx.read_only_pool
        opened = open_ranks(self, section, ctx)
        if opened is None:
            return Listing.empty(ctx.world_size, writable=writable)
        stores = [cast(Probeable, st) for st in opened]

        def exists_everywhere(ids: list[str]) -> list[bool]:
            per_rank = [st.exists(ids) for st in stores]
            return [all(col) for col in zip(*per_rank, strict=True)]

        lookups = PoolLookup(TierName.MOONCAKE, exists_everywhere, timeout_s=section.lookup_timeout_s,
                             counters=ctx.counters, on_close=functools.partial(close_all, opened))
        return Listing([{} for _ in range(ctx.world_size)], catalog=lookups, writable=writable)


SPEC = MooncakeSpec()
