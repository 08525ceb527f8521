"""A request as the plugin's scheduler side reads it from vLLM: only the fields it uses."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Req:
    """Stands in for vLLM's ``Request`` in scheduler-side tests."""

    request_id: str
    block_hashes: list[bytes]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    lora_request: None = None
    kv_transfer_params: dict | None = None
