"""Keys, the block index and its policies. Pure Python: no torch, no vllm, no I/O."""
