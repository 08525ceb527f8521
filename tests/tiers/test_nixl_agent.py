"""NIXL DRAM -> DRAM transfers between two real processes on 127.0.0.1 over UCX: the decode
side (this process) reads blocks out of the prefill side's pool (tests/nixl_peer.py, a
spawned process), the prefill side hears about it, and a peer that is gone or frozen costs
at most one deadline."""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.nixl_peer import pattern, serve
from vllm_kvtier.errors import ConfigError
from vllm_kvtier.tiers.nixl.agent import NixlAgent, NixlConfig, PeerInfo, Region, XferResult

HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12"))
requires_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="nixl is not installed (run tools/setup-remote.sh)")

POOL = 64 * 64 * 1024  # 64 blocks of 64 KiB on the serving side
BLK = 64 * 1024


@pytest.fixture(autouse=True)
def ucx_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RDMA here: keep UCX's InfiniBand module out, or a process that used UCX can crash
    at exit where libibverbs' provider plugins are installed (see the module doc of
    vllm_kvtier.tiers.nixl.agent). The spawned peer inherits it."""
    monkeypatch.setenv("UCX_MODULES", "^ib")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")


@dataclass
class Peer:
    proc: Any
    conn: Connection
    info: PeerInfo
    seed: int

    def notifs(self, timeout_s: float) -> dict[str, list[bytes]]:
        if self.conn.poll(timeout_s):
            kind, got = self.conn.recv()
            assert kind == "notifs"
            return dict(got)
        return {}


@pytest.fixture
def peer() -> Iterator[Peer]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    seed = 13
    proc = ctx.Process(target=serve, args=(theirs, f"prefill-{uuid.uuid4().hex[:8]}", POOL, seed), daemon=True)
    proc.start()
    try:
        assert ours.poll(60), "the peer process did not publish its agent"
        info = PeerInfo.from_dict(ours.recv())
        yield Peer(proc, ours, info, seed)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)  # a test may have frozen it
            with contextlib.suppress(OSError):  # the peer may be gone already
                ours.send("exit")
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


@pytest.fixture
def agent() -> Iterator[NixlAgent]:
    a = NixlAgent(f"decode-{uuid.uuid4().hex[:8]}", NixlConfig(deadline_s=2.0))
    yield a
    a.close()


def wait_result(agent: NixlAgent, job_id: int, limit_s: float) -> XferResult:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for r in agent.poll():
            if r.job_id == job_id:
                return r
        time.sleep(0.001)
    raise AssertionError(f"transfer {job_id} did not finish within {limit_s} s")


@pytest.mark.nixl
@requires_nixl
def test_read_blocks_from_another_process(agent: NixlAgent, peer: Peer) -> None:
    dst = np.zeros(16 * BLK, dtype=np.uint8)
    local = agent.register(dst)
    agent.add_peer(peer.info)
    remote = peer.info.regions[0]
    assert remote.nbytes == POOL
    wanted = [5, 0, 63, 17, 18, 19, 40, 2]  # scattered, out of order, some adjacent
    spans = [(local.addr + i * BLK, remote.addr + b * BLK, BLK) for i, b in enumerate(wanted)]
    agent.submit_read(1, peer.info.name, spans, notif=b"req-1")
    res = wait_result(agent, 1, 10)
    assert res.ok and res.reason == "" and res.nbytes == len(wanted) * BLK
    src = pattern(POOL, peer.seed)
    for i, b in enumerate(wanted):
        assert np.array_equal(dst[i * BLK : (i + 1) * BLK], src[b * BLK : (b + 1) * BLK]), f"block {b}"
    assert not dst[len(wanted) * BLK :].any()  # nothing written past the spans
    assert peer.notifs(10) == {agent.name: [b"req-1"]}  # the serving side can free the blocks
    assert agent.pending() == 0


@pytest.mark.nixl
@requires_nixl
def test_write_to_another_process_and_read_it_back(agent: NixlAgent, peer: Peer) -> None:
    src = np.full(2 * BLK, 0xA5, dtype=np.uint8)
    back = np.zeros(2 * BLK, dtype=np.uint8)
    a, b = agent.register(src), agent.register(back)
    agent.add_peer(peer.info)
    r = peer.info.regions[0]
    agent.submit_write(1, peer.info.name, [(a.addr, r.addr + 10 * BLK, 2 * BLK)])
    assert wait_result(agent, 1, 10).ok
    agent.submit_read(2, peer.info.name, [(b.addr, r.addr + 10 * BLK, 2 * BLK)])
    assert wait_result(agent, 2, 10).ok
    assert np.array_equal(back, src)


@pytest.mark.nixl
@requires_nixl
def test_out_of_range_and_unknown_peer_are_refused(agent: NixlAgent, peer: Peer) -> None:
    dst = np.zeros(BLK, dtype=np.uint8)
    local = agent.register(dst)
    r = peer.info.regions[0]
    agent.submit_read(1, peer.info.name, [(local.addr, r.addr, BLK)])  # peer not added yet
    agent.add_peer(peer.info)
    agent.submit_read(2, peer.info.name, [(local.addr, r.addr + POOL - BLK // 2, BLK)])  # past its pool
    agent.submit_read(3, peer.info.name, [(local.addr + 1, r.addr, BLK)])  # past our buffer
    agent.submit_read(4, peer.info.name, [])
    got = {res.job_id: res for res in agent.poll()}
    assert sorted(got) == [1, 2, 3, 4]
    assert all(not res.ok and res.reason == "bad_request" for res in got.values())
    assert not dst.any()


@pytest.mark.nixl
@requires_nixl
def test_peer_gone_fails_at_once(agent: NixlAgent, peer: Peer) -> None:
    dst = np.zeros(BLK, dtype=np.uint8)
    local = agent.register(dst)
    agent.add_peer(peer.info)
    r = peer.info.regions[0]
    agent.submit_read(1, peer.info.name, [(local.addr, r.addr, BLK)])
    assert wait_result(agent, 1, 10).ok
    peer.proc.kill()
    peer.proc.join(10)
    t0 = time.monotonic()
    agent.submit_read(2, peer.info.name, [(local.addr, r.addr, BLK)])
    res = wait_result(agent, 2, agent.config.deadline_s + 1.0)
    assert not res.ok and res.reason in ("peer_gone", "transfer_error", "deadline"), res.reason
    assert time.monotonic() - t0 <= agent.config.deadline_s + 1.0


@pytest.mark.nixl
@requires_nixl
def test_frozen_peer_costs_one_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TCP a frozen peer never answers: the read is aborted at its deadline."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # cross-memory attach would read a stopped process anyway
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(theirs, f"prefill-{uuid.uuid4().hex[:8]}", POOL, 3), daemon=True)
    proc.start()
    agent = NixlAgent(f"decode-{uuid.uuid4().hex[:8]}", NixlConfig(deadline_s=1.0))
    try:
        assert ours.poll(60)
        info = PeerInfo.from_dict(ours.recv())
        dst = np.zeros(4 * BLK, dtype=np.uint8)
        local = agent.register(dst)
        agent.add_peer(info)
        r = info.regions[0]
        agent.submit_read(1, info.name, [(local.addr, r.addr, 4 * BLK)])
        assert wait_result(agent, 1, 10).ok  # the path works while the peer runs
        os.kill(proc.pid, signal.SIGSTOP)
        # kill() returns before the peer has stopped: its progress thread could still
        # serve the next read. Wait until the kernel reports it stopped ("T").
        until = time.monotonic() + 5
        while Path(f"/proc/{proc.pid}/stat").read_text().split(") ", 1)[1][0] != "T":
            assert time.monotonic() < until, "the peer did not stop"
            time.sleep(0.01)
        time.sleep(0.05)  # and let any request already in flight on its side drain
        t0 = time.monotonic()
        agent.submit_read(2, info.name, [(local.addr, r.addr, 4 * BLK)])
        res = wait_result(agent, 2, 5.0)
        elapsed = time.monotonic() - t0
        assert not res.ok and res.reason == "deadline"
        assert 0.9 <= elapsed <= agent.config.deadline_s + 2.0  # a state check can itself block briefly
        assert agent.pending() == 0
    finally:
        agent.close()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


def test_peer_info_round_trip_and_rejects_garbage() -> None:
    info = PeerInfo("prefill-r0", b"\x00\x01md", (Region(0x7F0000001000, 4096), Region(0x7F0000100000, 1 << 20)))
    import json

    assert PeerInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    for bad in [None, {}, {"name": "", "metadata": "", "regions": []},
                {"name": "p", "metadata": "not base64!", "regions": []},
                {"name": "p", "metadata": "AA==", "regions": [[0, 10]]},
                {"name": "p", "metadata": "AA==", "regions": [["x", 1]]}]:
        with pytest.raises(ValueError):
            PeerInfo.from_dict(bad)


@pytest.mark.parametrize(("kw", "field"), [
    ({"backends": ()}, "nixl.backends"), ({"backends": ("POSIX",)}, "nixl.backends"),
    ({"deadline_s": 0}, "nixl.deadline_s"), ({"num_threads": -1}, "nixl.num_threads"),
])
def test_nixl_config_names_the_bad_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        NixlConfig(**kw)
    assert e.value.field == field
