"""Moving block bytes between vLLM's KV tensors and the tiers: layouts, copy engines, jobs."""
