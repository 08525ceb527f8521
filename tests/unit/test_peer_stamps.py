"""Peer-read stamps as a seqlock (issue 31), at the unit level: a fake NIXL agent (the one
thing faked: it moves spans between two P/D ``PeerLink`` s in this process with memmove,
in an adversarial order, and lets the prefill side rewrite a slot mid-read). A block the
decode side accepts always holds exactly its key's bytes; the prefill side unstamps a
slot before a tier read's bytes land in it."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import pytest
import torch

from vllm_kvtier.config import NixlConfig, NixlTierConfig
from vllm_kvtier.jobs import ChunkRead, ChunkWriteJob, PeerRead
from vllm_kvtier.metrics import Counters
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.tiers.nixl.agent import PeerInfo, Region, XferResult
from vllm_kvtier.transfer.peer import STAMP

PLANES = (4096, 4096)
KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


class FakeAgent:
    """Transfers run at ``poll``, one per call: the block spans first, then ``between``
    (once, the other side's writer), then the stamp spans: the order a single RDMA READ
    may land in."""

    between: Callable[[], None] | None = None

    def __init__(self, name: str, config: object = None) -> None:
        self.name = name
        self._todo: list[tuple[int, list[tuple[int, int, int]], bytes]] = []
        self.notified: list[bytes] = []

    def register(self, memory: object) -> Region:
        return Region(1, 1)

    def peer_info(self) -> PeerInfo:
        return PeerInfo(self.name, b"md", (Region(1, 1),))

    def add_peer(self, info: PeerInfo) -> None:
        pass

    def remove_peer(self, name: str) -> None:
        pass

    def submit_read(self, job_id: int, peer: str, spans, *, notif: bytes = b"") -> None:
        self._todo.append((job_id, list(spans), notif))

    def notify(self, peer: str, notif: bytes) -> bool:
        self.notified.append(notif)
        return True

    def poll(self) -> list[XferResult]:
        if not self._todo:
            return []
        job_id, spans, notif = self._todo.pop(0)
        for local, remote, n in (s for s in spans if s[2] != STAMP):
            ctypes.memmove(local, remote, n)
        hook, FakeAgent.between = FakeAgent.between, None
        if hook is not None:
            hook()
        for local, remote, n in (s for s in spans if s[2] == STAMP):
            ctypes.memmove(local, remote, n)
        if notif:
            self.notified.append(notif)
        return [XferResult(job_id, True)]

    def get_notifs(self) -> dict:
        return {}

    def close(self) -> None:
        pass


@pytest.fixture
def links(monkeypatch):
    import vllm_kvtier.tiers.nixl.agent as agent_mod
    from vllm_kvtier.transfer.peer import PeerLink

    monkeypatch.setattr(agent_mod, "NixlAgent", FakeAgent)
    FakeAgent.between = None

    def make(name: str, **nixl) -> PeerLink:
        cfg = NixlTierConfig(NixlConfig(deadline_s=10.0), agent_name=name, **nixl)
        return PeerLink(cfg, CPUPool(4, PLANES, pin=False, prefault=False), rank=0, counters=Counters())

    return make("prefill"), make("decode", allowed_peers=("prefill-*",))


def fill(link, slot: int, value: int) -> None:
    for p in link.pool.planes:
        p[slot].fill_(value)


def read(decode, prefill):
    rid = decode.read(PeerRead("r", {"ranks": {"0": prefill.describe()}}, (1,), (2,), (KEY,), notify="r"))
    assert rid is not None
    for _ in range(10):
        for got, res in decode.poll():
            assert got == rid
            return res
    raise AssertionError("the read did not finish")


def holds(link, slot: int, value: int) -> bool:
    return all(bool((p[slot] == value).all()) for p in link.pool.planes)


def test_a_block_whose_save_completes_during_the_read_is_never_taken_torn(links):
    """The offer reached the decode side before the prefill's save landed: the slot is
    unstamped and half written when the read starts, complete and stamped by the time the
    stamp is read. Whatever is accepted must be the key's whole bytes."""
    prefill, decode = links
    fill(prefill, 1, 0)
    prefill.pool.planes[0][1].fill_(7)  # half of the block written
    prefill.stamp(1, None)

    def finish_save() -> None:
        fill(prefill, 1, 7)
        prefill.stamp(1, KEY)

    FakeAgent.between = finish_save
    res = read(decode, prefill)
    if KEY in res.good:
        assert holds(decode, 2, 7), "took a torn block as complete"
    assert decode.agent.notified == [b"r"]  # the offer is freed either way, once


def test_a_slot_rewritten_during_the_read_is_a_miss(links):
    """The slot held the key when the read began and was reused for another key while its
    bytes were being read: its stamp changed, so the block is not used."""
    prefill, decode = links
    fill(prefill, 1, 7)
    prefill.stamp(1, KEY)
    def reuse() -> None:
        prefill.stamp(1, None)
        fill(prefill, 1, 9)
        prefill.stamp(1, OTHER)

    FakeAgent.between = reuse
    res = read(decode, prefill)
    assert res.good == set() or holds(decode, 2, 7)


def test_a_complete_block_is_read(links):
    prefill, decode = links
    fill(prefill, 1, 7)
    prefill.stamp(1, KEY)
    res = read(decode, prefill)
    assert res.good == {KEY} and holds(decode, 2, 7)
    assert decode.agent.notified == [b"r"]


def test_a_tier_read_unstamps_its_slots_before_their_bytes_change():
    """Prefill side: a read from a lower tier into a slot that a peer may read clears the
    slot's stamp before the first byte lands, and stamps the new key after the last."""
    from vllm_kvtier.chunkformat import chunk_id_for
    from vllm_kvtier.tiers.memory import MemoryStore
    from vllm_kvtier.transfer.slots import SlotTable
    from vllm_kvtier.transfer.tier_io import ChunkWorker, DriverContext, DriverSettings

    slots = SlotTable(CPUPool(8, PLANES, pin=False, prefault=False))
    seen: list[tuple[int, bytes | None, int]] = []

    class Recorder:
        def stamp(self, slot: int, key: bytes | None) -> None:
            seen.append((slot, key, int(slots.pool.planes[0][slot][0])))

    slots.stamp_with(Recorder())
    store = MemoryStore("ns", slots.pool.slot_bytes)
    w = ChunkWorker("nvme", store, DriverSettings("write-through", 4, 5.0), DriverContext(slots, Counters()))
    for p in slots.pool.planes:
        p[0].fill_(3)
        p[5].fill_(1)
    slots.set_key(0, KEY)
    slots.set_key(5, OTHER)  # slot 5 holds OTHER (bytes 1), stamped
    cid = chunk_id_for((KEY,))
    w.write([ChunkWriteJob("nvme", cid, (0,), (KEY,))])
    import time

    from vllm_kvtier.jobs import WorkerReport

    deadline = time.monotonic() + 10
    meta = WorkerReport()
    while time.monotonic() < deadline and not meta.written:
        w.poll()
        w.take_meta(meta)
        time.sleep(0.005)
    seen.clear()
    assert w.start_read(ChunkRead("nvme", cid, (0,), (5,), (KEY,))) is not None
    done: list = []
    while time.monotonic() < deadline and not done:
        done = w.poll()
        time.sleep(0.005)
    assert done and done[0][2]
    assert torch.equal(slots.pool.planes[0][5], slots.pool.planes[0][0])
    assert seen and seen[0] == (5, None, 1)  # unstamped while it still held OTHER's bytes
    w.close()
