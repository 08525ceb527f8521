"""Scheduler-side decisions: what to load, save, demote, promote, prefetch and evict.

Everything here runs on vLLM's scheduler thread (EngineCore process). It imports neither
vLLM nor torch, and does no I/O of its own (a tier's background rescan is a callable the
connector hands in). Inputs are plain (:mod:`vllm_kvtier.plan.inputs`). Outputs are the
jobs of :mod:`vllm_kvtier.jobs`. The connector translates vLLM's objects on both sides.

* :mod:`~vllm_kvtier.plan.scheduler`: :class:`SchedulerPlanner`, the whole step's policy.
* :mod:`~vllm_kvtier.plan.lookup_plan`: how many tokens of a request could be loaded.
* :mod:`~vllm_kvtier.plan.load_plan`: a hit becomes a load job; its pins end or are undone.
* :mod:`~vllm_kvtier.plan.save_plan`: which blocks to store in the CPU tier, in which slots.
* :mod:`~vllm_kvtier.plan.chunk_plan`: a tier below CPU (admission, chunking, capacity).
* :mod:`~vllm_kvtier.plan.promotions`: CPU slots being filled from below (one owner).
* :mod:`~vllm_kvtier.plan.prefetch`: promotions ahead of a request's next turn.
* :mod:`~vllm_kvtier.plan.load_policy`: load or recompute, by the measured costs.
* :mod:`~vllm_kvtier.plan.pool_handoff`, :mod:`~vllm_kvtier.plan.peer_plan`: P/D hand-off.
* :mod:`~vllm_kvtier.plan.req_state`: what is kept per request, and the table of requests.
* :mod:`~vllm_kvtier.plan.cpu_gauges`: the CPU tier's counters and gauges, once a step.
* :mod:`~vllm_kvtier.plan.request_params`: the trust boundary on a request's
  ``kv_transfer_params`` (what the config enables, the limits, the ignored-param counter).
"""
