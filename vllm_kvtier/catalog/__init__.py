"""What the tiers below CPU hold, learned off the scheduler thread.

``base``: the contract the planner consumes (:class:`~vllm_kvtier.catalog.base.Rescans`,
:class:`~vllm_kvtier.catalog.base.PoolLookups`) and the plain data it takes. ``rescan``:
the rescan thread of a listed tier (S3). ``pool``: the lookup thread of a key-value pool
(Mooncake). This layer sits below ``plan/`` and beside ``tiers/``: it imports neither; the
connector hands it the tier's listing or lookup function.
"""
