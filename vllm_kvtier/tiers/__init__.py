"""Storage media. Each module moves bytes for one medium; none decides what to evict."""
