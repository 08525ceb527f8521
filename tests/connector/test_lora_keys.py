"""LoRA requests and model identity (issue 13): vLLM folds only the adapter's *name* into
its block hashes, so the connector keys a LoRA request's blocks by the adapter's content.
vLLM's real ``Scheduler`` with the connector in the SCHEDULER role, a fake worker
(``sched_helpers``), real adapter files in ``tmp_path``."""

from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

from tests.sched_helpers import (
    BLOCK_SIZE,
    FakeWorker,
    all_saves,
    block_bytes,
    connector,
    make_request,
    make_scheduler,
    make_vllm_config,
    prompt_tokens,
    sched_half,
)
from vllm_kvtier.index.adapters import adapter_key
from vllm_kvtier.index.identity import fingerprint_weights

BS = BLOCK_SIZE


def write_adapter(path: Path, seed: int) -> Path:
    """A PEFT-shaped adapter directory: adapter_config.json and one safetensors file of
    random bytes (same names and sizes for every seed)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj"]}))
    rng = random.Random(seed)
    tensors = {f"base_model.model.layers.{i}.q_proj.lora_A.weight": rng.randbytes(16_384) for i in range(2)}
    header, off = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [off, off + len(data)]}
        off += len(data)
    blob = json.dumps(header).encode()
    f = path / "adapter_model.safetensors"
    f.write_bytes(struct.pack("<Q", len(blob)) + blob + b"".join(tensors.values()))
    os.utime(f, ns=(seed + 1, seed + 1))  # a rewrite is seen even within one mtime tick
    return path


def lora_request(req_id: str, prompt: list[int], adapter: Path, max_tokens: int = 1) -> Request:
    make_request("init", [3])  # the hash seed, as make_request sets it up
    from vllm.utils.hashing import sha256

    return Request(request_id=req_id, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0), pooling_params=None,
                   block_hasher=get_request_block_hasher(BS, sha256),
                   lora_request=LoRARequest("ad", 1, str(adapter)))


def new_scheduler(model_dir):
    return make_scheduler(make_vllm_config(model_dir, {"cpu": {"capacity_bytes": 64 * block_bytes()}}))


def test_lora_blocks_are_keyed_by_adapter_content(tiny_model, tmp_path):
    adapter = write_adapter(tmp_path / "ad", seed=1)
    sched, worker = new_scheduler(tiny_model), FakeWorker()
    prompt = prompt_tokens(4 * BS + 1)
    a = lora_request("a", prompt, adapter)
    sched.add_request(a)
    worker.run_until_idle(sched)
    fp = bytes.fromhex(fingerprint_weights(adapter, mode="sampled").digest)  # adapters: sampled
    saved = [k for j in all_saves(worker.metas, "a") for k in j.keys]
    assert saved == [adapter_key(fp, h) for h in a.block_hashes[:4]]
    assert set(saved).isdisjoint(a.block_hashes)  # never vLLM's name-only hashes

    conn = connector(sched)
    assert conn.get_num_new_matched_tokens(lora_request("b", prompt, adapter), 0) == (4 * BS, False)
    # The same adapter name and path, rewritten with other weights: a miss, not stale KV.
    write_adapter(adapter, seed=2)
    assert conn.get_num_new_matched_tokens(lora_request("c", prompt, adapter), 0) == (0, False)
    # And back: the first content finds its blocks again.
    write_adapter(adapter, seed=1)
    assert conn.get_num_new_matched_tokens(lora_request("d", prompt, adapter), 0) == (4 * BS, False)


def test_an_adapter_that_cannot_be_fingerprinted_skips_the_tiers(tiny_model, tmp_path):
    sched, worker = new_scheduler(tiny_model), FakeWorker()
    prompt = prompt_tokens(4 * BS + 1, seed=3)
    missing = tmp_path / "gone"
    r = lora_request("a", prompt, missing)
    assert connector(sched).get_num_new_matched_tokens(r, 0) == (0, False)
    sched.add_request(r)
    worker.run_until_idle(sched)
    assert all_saves(worker.metas, "a") == []  # neither loaded nor saved
    assert sched_half(sched).planner.counters.totals["lora_unkeyed_requests|all"] >= 1
    # a request without LoRA is unaffected
    sched.add_request(make_request("plain", prompt))
    worker.run_until_idle(sched)
    assert len(all_saves(worker.metas, "plain")) == 1
