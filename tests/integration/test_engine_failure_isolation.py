"""An engine that fails to start leaves nothing behind for the next one of this process.

vLLM keeps the worker's KV connector in a process-wide slot and fills it only when empty.
An engine that fails after filling it would hand it, with its own KV cache config, to every
later engine of the process. The first engine here fails after the slot is filled: its
CPU tier asks for more memory than the machine has, refused as the worker registers its
KV cache."""

from __future__ import annotations

import random

import pytest

from tests.conftest import close_llm, generate, kvtier_config, make_llm, rand_tokens


def test_an_engine_that_failed_to_start_leaves_no_connector_behind(tiny_model):
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    with pytest.raises(Exception, match="cpu.capacity_bytes"):
        make_llm(tiny_model, kvtier_config({"cpu": {"capacity_bytes": 2**50}}))
    assert not has_kv_transfer_group()
    llm = make_llm(tiny_model, kvtier_config({}))
    try:
        prompt = rand_tokens(random.Random(7), 200)
        assert generate(llm, prompt).tokens == generate(llm, prompt).tokens
    finally:
        close_llm(llm)
