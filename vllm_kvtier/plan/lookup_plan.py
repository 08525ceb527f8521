"""Lookups: how many tokens of a request could be loaded, and whether the load is async.

Who calls it: :class:`~vllm_kvtier.plan.scheduler.SchedulerPlanner`, from vLLM's
scheduler thread only. Nothing here blocks or does I/O. A pool tier's answer is never
awaited: while it may still come, the lookup answers ``None`` and vLLM asks again.

A hit is the longest run of a request's block keys that some tier holds, from vLLM's own
prefix-cache hit on. Each key is looked up in the CPU tier first, then in each lower tier,
fastest first. A run stops at a key being filled from below (a promotion), and at a tier
that shadow verification quarantined.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_kvtier.config import KVTierConfig
from vllm_kvtier.keys import BlockKey, TierName
from vllm_kvtier.metrics import CounterName
from vllm_kvtier.plan.inputs import Request
from vllm_kvtier.plan.load_plan import LoadOptions
from vllm_kvtier.plan.parts import PlanExtras, PlanParts
from vllm_kvtier.plan.pool_handoff import PoolHandoff

TIER = TierName.CPU


class LookupPlanner:
    """Answers vLLM's lookups. Owns each request's latest hit start, kept from the lookup
    until the request's allocation (:meth:`take_start`)."""

    def __init__(self, cfg: KVTierConfig, parts: PlanParts, options: LoadOptions, handoff: PoolHandoff,
                 extras: PlanExtras, *, block_size: int) -> None:
        """``extras``: the optional parts a hit consults (P/D peer, prefetch, load policy,
        verification)."""
        self.cfg = cfg
        self.parts = parts
        self.options = options
        self.handoff = handoff
        self.extras = extras
        self.block_size = block_size
        self._start: dict[str, int] = {}

    def loadable_blocks(self, request: Request) -> int:
        """Prompt blocks that may come from a tier: every full one.

        An async load may cover the whole prompt. When it lands, vLLM's scheduler
        recomputes only the last token (``num_computed_tokens = num_tokens - 1``). So an
        exact multiple of the block size recomputes 1 token instead of a whole block. A
        sync load is capped by :meth:`sync_blocks`."""
        return request.num_prompt_tokens // self.block_size

    def sync_blocks(self, request: Request) -> int:
        """Blocks a sync load may cover.

        vLLM computes at least one token in the step that admits the request. It asserts
        ``num_new_tokens > 0``. So never the block holding the prompt's last token."""
        return max(0, (request.num_prompt_tokens - 1) // self.block_size)

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``.

        Returns (tokens after ``num_computed_tokens`` that can be loaded, whether the load
        is async). vLLM may ask again in a later step if it cannot admit the request now.
        The only state kept is the latest answer's starting block. The allocation needs it:
        vLLM sets ``request.num_computed_tokens`` only after that call.

        A pool tier (Mooncake): the pool's answer about the request's blocks may still
        come. Then this returns ``None``, and vLLM asks again next step
        (:meth:`lookups_pending`). The scheduler thread never waits for it.

        P/D decode side: the prefill instance may have reported ``kvtier_pool_blocks``
        blocks stored in the pool. Then the request gets ``None`` until they can all be
        found; vLLM asks again next step. It waits for at most ``mooncake.handoff_wait_s``.
        Then it goes on with what is there (the rest is recomputed)."""
        start = num_computed_tokens // self.block_size
        self._start[request.request_id] = start
        for tier in self.parts.lower:
            tier.refresh()
        limit = min(self.loadable_blocks(request), len(request.block_hashes))
        if start >= limit:
            return 0, False
        if self.extras.peer_plan is not None:
            n = self.extras.peer_plan.match(request, start, limit)
            if n:
                # Blocks being filled for another request right now are not read twice.
                n = next((i for i, h in enumerate(request.block_hashes[start : start + n])
                          if BlockKey(h) in self.parts.promotions), n)
            if n is not None and n >= self.cfg.min_load_blocks:
                return n * self.block_size, True  # read from the prefill instance over NIXL
        if self.lookups_pending(request, start, limit):
            return None, False  # a pool lookup of its blocks is under way: ask again next step
        keys = [BlockKey(h) for h in request.block_hashes[start:limit]]
        tiers = self._match(request.block_hashes, start, limit)
        if self.handoff.should_wait(request, start, limit, len(tiers)):
            return None, False
        nxt = start + len(tiers)
        if self.extras.prefetcher is not None and nxt < limit and self.extras.prefetcher.is_inflight(keys[len(tiers)]):
            return None, False  # its next block is being prefetched into DRAM: ask again next step
        if self.extras.load_policy is not None:
            tiers = tiers[: self.extras.load_policy.decide(request.request_id, tiers)]
        asynchronous = (self.options.always_async or self.cfg.load_mode == "async"
                        or any(t != TIER for t in tiers))
        if not asynchronous:
            tiers = tiers[: max(0, self.sync_blocks(request) - start)]
        if len(tiers) < self.cfg.min_load_blocks:
            return 0, False
        if self.extras.verify is not None and self.extras.verify.sample(request.request_id, keys[: len(tiers)], tiers):
            return 0, False  # shadow verification: recomputed, and the stored blocks compared
        return len(tiers) * self.block_size, asynchronous

    def stored_blocks(self, request: Request) -> int:
        """The run of the request's loadable blocks from its first that the tiers hold now.

        It matches as :meth:`lookup` would from block 0, with nothing submitted or
        recorded."""
        return len(self._match(request.block_hashes, 0, min(self.loadable_blocks(request), len(request.block_hashes))))

    def lookups_pending(self, request: Request, lo: int, hi: int) -> bool:
        """Submit pool lookups (:meth:`ChunkPlanner.discover`) of the keys of ``request``
        at positions ``[lo, hi)`` that DRAM does not hold. True while an answer about one
        of them is still to come: the caller answers vLLM ``None`` (ask again next step).
        Never waits for a pool. Every tier is asked."""
        keys = [k for h in request.block_hashes[lo:hi] if (k := BlockKey(h)) not in self.parts.index]
        if not keys:
            return False
        return any([tier.discover(keys) for tier in self.parts.lower])

    def present(self, request: Request, lo: int, hi: int) -> list[bool]:
        """Whether each key of ``request`` at positions ``[lo, hi)`` could be loaded now.

        A key counts if it is in DRAM, or in a lower tier after its refresh. This serves a
        hit that needs keys at scattered positions (a sliding-window group's window). A key
        whose pool lookup is still under way is absent for now. Call
        :meth:`lookups_pending` first to wait for it."""
        hashes = request.block_hashes
        hi = min(hi, len(hashes))
        for tier in self.parts.lower:
            tier.refresh()
        self.lookups_pending(request, lo, hi)
        return [len(self._match(hashes, p, p + 1)) == 1 for p in range(lo, hi)]

    def note_start(self, request: Request, num_computed_tokens: int) -> None:
        """What :meth:`lookup` records for the allocation, for a request whose hit was
        decided elsewhere (a group view of a hybrid model)."""
        self._start[request.request_id] = num_computed_tokens // self.block_size

    def take_start(self, req_id: str) -> int:
        """The first block of ``req_id``'s latest hit (0 if it was not looked up).
        Blocks before it are vLLM's own prefix-cache hit."""
        return self._start.pop(req_id, 0)

    def forget(self, req_id: str) -> None:
        """The request ended or was dropped (aborted before its allocation, too)."""
        self._start.pop(req_id, None)

    def record(self, request: Request) -> None:
        """Count a lookup of the blocks of ``request`` a load could cover (once per
        admission).

        Where a load may be async, that is every full prompt block (``load_mode: async``,
        a tier below CPU, a peer). Else it is all but the block of the last token. So a
        DRAM-only sync setup still reads a full hit as 100%."""
        may_be_async = (self.options.always_async or self.cfg.load_mode == "async" or bool(self.parts.lower)
                        or self.extras.peer_plan is not None)
        n = self.loadable_blocks(request) if may_be_async else self.sync_blocks(request)
        self.parts.counters.add(CounterName.LOOKUP_BLOCKS, TIER, n)

    def _match(self, hashes: Sequence[bytes], start: int, limit: int) -> list[str]:
        """The tier of each key of the run of loadable keys from ``start``."""
        tiers: list[str] = []
        cpu_quarantined = self.extras.verify is not None and self.extras.verify.quarantined(TIER)
        for h in hashes[start:limit]:
            key = BlockKey(h)
            if key in self.parts.promotions:
                break  # its CPU copy is being read from a lower tier right now
            if key in self.parts.index:
                if cpu_quarantined:
                    break  # shadow verification found a wrong block in DRAM: no hits for now
                tiers.append(TIER)
                continue
            loc = self.parts.locate(key)
            if loc is None:
                break
            tiers.append(loc[0].tier)
        return tiers
