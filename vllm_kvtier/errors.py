"""The small exception family of vllm_kvtier.

Serving paths never raise these into vLLM: a failed transfer becomes a miss and a
counter. They are raised at start-up (bad configuration) and by programming errors.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class for errors raised by vllm_kvtier."""


class ConfigError(KVTierError, ValueError):
    """Invalid configuration. The message names the offending field (dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"kvtier config field '{field}': {message}")
