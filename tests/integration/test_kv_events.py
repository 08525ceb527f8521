"""KV events end to end: real vLLM engines publishing over ZMQ on 127.0.0.1
(``--kv-events-config``), a ZMQ SUB socket here decoding vLLM's own msgspec types.

The hashes are checked against vLLM's own: with prefix caching on, the same stream carries
vLLM's GPU ``BlockStored`` events for the same blocks, so every hash we publish must be one
vLLM published, with the same tokens."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from testkit import s3_server as s3srv
from tests.conftest import BLOCK_SIZE, close_llm, generate, kvtier_counters, make_llm
from tests.integration.test_nvme_engine import SETS, nvme_config, run_engine, run_process
from tests.integration.test_s3_engine import objects, s3_config

s3_server = s3srv.s3_server
s3_bucket = s3srv.s3_bucket

TOPIC = "kvtier-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Subscriber:
    """A ZMQ SUB socket on an engine's event endpoint (127.0.0.1), decoding vLLM's
    ``KVEventBatch``."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sock.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []

    def drain(self) -> None:
        while self.sock.poll(timeout=50):
            _topic, _seq, payload = self.sock.recv_multipart()
            self.events.extend(self.decoder.decode(payload).events)

    def wait_for(self, done: Callable[[], bool], *, step: Callable[[], None] | None = None,
                 timeout_s: float = 120.0) -> None:
        """Collect until ``done()`` (``step()`` between polls: an in-process engine's idle
        step, which lands background writes)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain()
            if done() or time.monotonic() > deadline:
                return
            if step is not None:
                step()

    def stored(self, medium: str, **fields: Any) -> list[BlockStored]:
        return [e for e in self.events if isinstance(e, BlockStored) and e.medium == medium
                and all(getattr(e, k) == v for k, v in fields.items())]

    def removed(self, medium: str) -> list[BlockRemoved]:
        return [e for e in self.events if isinstance(e, BlockRemoved) and e.medium == medium]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def events_config(port: int) -> dict:
    """vLLM's publisher binds only a wildcard endpoint (``tcp://*:N``); given a host
    (``tcp://127.0.0.1:N``) it connects to a subscriber that binds, which delivered nothing
    on this machine's loopback (pyzmq 27 / libzmq 4.3.5, even with plain sockets). So it
    binds, and the subscriber connects over 127.0.0.1."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": TOPIC}


def gpu_blocks(sub: Subscriber) -> dict[Any, list[int]]:
    """vLLM's own GPU events: hash -> token ids of that block."""
    out: dict[Any, list[int]] = {}
    for e in sub.stored("GPU"):
        for i, h in enumerate(e.block_hashes):
            out[h] = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
    return out


def prompt_hashes(sub: Subscriber, prompt: list[int]) -> list[Any]:
    """The hashes vLLM published for the full blocks of ``prompt``, in order."""
    by_tokens = {tuple(t): h for h, t in gpu_blocks(sub).items()}
    full = len(prompt) // BLOCK_SIZE
    return [by_tokens.get(tuple(prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])) for i in range(full)]


def hashes(events: list[Any]) -> set[Any]:
    return {h for e in events for h in e.block_hashes}


def test_cpu_and_nvme_events_carry_vllms_hashes_and_cpu_eviction_removes(tiny_model, tmp_path):
    """Two 10-block prompts through a 16-block CPU tier with a write-through NVMe tier:
    BlockStored for CPU (at the save) and for NVMe (once the write is acknowledged) for
    every full block, with vLLM's hashes, tokens and parents; the second prompt's saves
    evict the first's blocks from CPU: BlockRemoved (medium CPU) for them."""
    p1, p2 = SETS[1][0], SETS[1][1]
    port = free_port()
    kv = nvme_config(tmp_path / "nvme", cpu_blocks=16, mode="write-through")
    llm = make_llm(tiny_model, kv, kv_events_config=events_config(port), enable_prefix_caching=True)
    sub = Subscriber(port)
    try:
        time.sleep(0.5)  # our subscription reaches the publisher
        generate(llm, p1)
        sub.wait_for(lambda: len(prompt_hashes(sub, p1)) == 10 and None not in prompt_hashes(sub, p1)
                     and set(prompt_hashes(sub, p1)) <= hashes(sub.stored("STORAGE", ownership="nvme")),
                     step=llm.llm_engine.step)
        h1 = prompt_hashes(sub, p1)
        assert None not in h1 and len(set(h1)) == 10, "vLLM's own GPU events name every block"
        gpu = gpu_blocks(sub)

        cpu = sub.stored("CPU")
        assert set(h1) <= hashes(cpu)
        assert hashes(cpu) <= set(gpu), "every hash we publish is one vLLM publishes"
        by_hash = {e.block_hashes[0]: e for e in cpu}
        for i, h in enumerate(h1):
            e = by_hash[h]
            assert e.token_ids == p1[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE] and e.block_size == BLOCK_SIZE
            assert e.parent_block_hash == (h1[i - 1] if i else None)
            assert e.locality is None and e.group_idx == 0 and e.lora_name is None

        nvme = sub.stored("STORAGE", ownership="nvme")
        assert set(h1) <= hashes(nvme) <= set(gpu)
        assert {e.locality for e in nvme} == {"LOCAL"}
        first = next(e for e in nvme if e.block_hashes[0] == h1[0])
        assert first.token_ids == p1[:BLOCK_SIZE] and first.parent_block_hash is None
        assert not sub.removed("CPU")

        generate(llm, p2)  # 10 more blocks in a 16-block tier: some of p1's are evicted
        sub.wait_for(lambda: len(hashes(sub.removed("CPU"))) >= 4, step=llm.llm_engine.step)
        gone = hashes(sub.removed("CPU"))
        assert len(gone) >= 4 and gone <= set(h1), "the evicted blocks are the first prompt's"
        h2 = prompt_hashes(sub, p2)
        assert None not in h2 and set(h2) <= hashes(sub.stored("CPU"))
        assert not sub.removed("STORAGE"), "the NVMe tier evicted nothing"
    finally:
        sub.close()
        close_llm(llm)


def test_a_restart_announces_what_its_nvme_tier_found(tiny_model, tmp_path):
    """A stores a prompt in its NVMe tier and closes; B, started on the
    same directory with KV events on, announces the blocks its start-up scan found
    (STORAGE / nvme / LOCAL: its own directory) at its first steps, under vLLM's hashes."""
    p = SETS[2][0]
    kv = nvme_config(tmp_path / "nvme", cpu_blocks=16, mode="write-through")
    run_engine(tiny_model, kv, [p])
    port = free_port()
    llm = make_llm(tiny_model, kv, kv_events_config=events_config(port), enable_prefix_caching=True)
    sub = Subscriber(port)
    try:
        time.sleep(0.5)
        generate(llm, p, 1)  # its first steps: the start-up backlog goes out
        sub.wait_for(lambda: None not in prompt_hashes(sub, p), step=llm.llm_engine.step)
        h = prompt_hashes(sub, p)
        assert None not in h and len(h) == len(p) // BLOCK_SIZE
        found = sub.stored("STORAGE", ownership="nvme")
        assert set(h) <= hashes(found) and {e.locality for e in found} == {"LOCAL"}
    finally:
        sub.close()
        close_llm(llm)


@pytest.mark.s3
def test_second_instance_publishes_what_its_rescan_found_as_remote(tiny_model, s3_server, s3_bucket, tmp_path):
    """B (this process, KV events on) starts on an empty bucket with a background rescan;
    A (another process, another writer id) then stores a prompt there and exits. B's
    rescan finds A's chunks: at its next step B publishes BlockStored (medium STORAGE,
    ownership s3, locality REMOTE) with A's block keys, which are vLLM's hashes of those
    blocks (B's own GPU events for the same prompt name them)."""
    p = SETS[3][0]
    probe = SETS[4][0]  # shares no block with p
    port = free_port()
    kv_b = s3_config(s3_server.url, s3_bucket, rescan_interval_s=0.5, writer_id="writer-b")
    llm = make_llm(tiny_model, kv_b, kv_events_config=events_config(port), enable_prefix_caching=True)
    sub = Subscriber(port)
    try:
        time.sleep(0.5)
        kv_a = s3_config(s3_server.url, s3_bucket, writer_id="writer-a")
        run_process(tiny_model, kv_a, [p], tmp_path)  # A stores, writes its manifest, exits
        assert any(k.endswith(".kvt") for k in objects(s3_server, s3_bucket)), "A stored its chunks"
        full = len(p) // BLOCK_SIZE

        def remote() -> set[Any]:
            return hashes(sub.stored("STORAGE", ownership="s3", locality="REMOTE"))

        # An idle in-process engine does not step: B's lookups apply its finished rescans.
        # They are a probe's, not p's: had B computed p before its rescan landed (a slow
        # machine), it would have stored p's chunks itself, and announced them as LOCAL.
        deadline = time.monotonic() + 120
        while len(remote()) < full and time.monotonic() < deadline:
            generate(llm, probe, 1)
            sub.wait_for(lambda: len(remote()) >= full, timeout_s=1.0)
        found = remote()
        assert len(found) >= full, f"B announced {len(found)} of A's {full} blocks; B: {kvtier_counters(llm)}"
        generate(llm, p, 1)  # B's own GPU events for p name the same hashes
        sub.wait_for(lambda: None not in prompt_hashes(sub, p), step=llm.llm_engine.step)
        assert set(prompt_hashes(sub, p)) <= found, "A's keys are vLLM's hashes of those blocks"
        gpu = gpu_blocks(sub)
        for e in sub.stored("STORAGE", ownership="s3", locality="REMOTE"):
            # Tokens of a scanned block are known only if a live request of B named it in
            # the same step; otherwise vLLM's placeholder form (hash only).
            assert e.token_ids == gpu[e.block_hashes[0]] if e.token_ids else e.block_size == 0
    finally:
        sub.close()
        close_llm(llm)
