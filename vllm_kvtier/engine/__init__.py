"""What the connector builds at start-up that needs no vLLM: the tiers below CPU (their
planners and data paths), the scheduler's view of a request's groups, and the model's
identity. The connector (:mod:`vllm_kvtier.connector`) reads vLLM's objects and calls in.
"""
