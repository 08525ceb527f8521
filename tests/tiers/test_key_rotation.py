"""Key rotation and turning auth on, on real stores over one real S3 server (moto): two
instances, each a scheduler-side :class:`ChunkPlanner` built from its own scan and a worker's
:class:`ChunkWorker` over its own :class:`S3Store`, sharing one bucket (what the connector
wires, without an engine).

A rolling rotation: A signs with k1; B rotates to (k2 signs, k1 verifies) and loads A's
chunks; A rotates too and writes with k2; k1 is dropped: k1's chunks are never indexed
again, their prefixes are written again (signed with k2), and then load. And the worker's
side: a chunk refused as ``unauthenticated`` is forgotten by the planner so that it is
written again (it used to stay indexed, offered every 10 s, and block its own rewrite)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from testkit import s3_server as s3srv
from testkit.s3_server import MotoServer
from tests.tiers.test_s3_store import NS, config
from vllm_kvtier.catalog.base import Listing
from vllm_kvtier.config.integrity import AuthConfig
from vllm_kvtier.errors import ConfigError, FailureReason
from vllm_kvtier.jobs import ChunkRead, ChunkWriteJob, WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext
from vllm_kvtier.tiers.auth import ChunkAuth, load_auth
from vllm_kvtier.tiers.cpu import CPUPool
from vllm_kvtier.tiers.memory import MemoryStore
from vllm_kvtier.tiers.registry import StoreContext
from vllm_kvtier.tiers.s3.store import S3Store
from vllm_kvtier.transfer.slots import SlotTable
from vllm_kvtier.transfer.tier_io import ChunkWorker, DriverContext, DriverSettings

s3_server = s3srv.s3_server  # fixtures: a moto server for this module, a fresh bucket per test
s3_bucket = s3srv.s3_bucket

K1, K2 = bytes(range(32)), bytes(range(100, 132))
SLOT = 4096
TIER = "s3"


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(4, "big") * 8)


class Instance:
    """One engine's S3 tier for rank 0: the planner (from a scan of the bucket, as at
    start-up) and the worker's data path, both with ``auth``."""

    def __init__(self, server: MotoServer, bucket: str, auth: ChunkAuth | None, writer: str) -> None:
        self.pool = CPUPool(8, (SLOT,), pin=False, prefault=False)
        self.slots = SlotTable(self.pool)
        self.counters = Counters()
        self.store = s3 = S3Store(config(server, bucket, writer_id=writer, manifest_every_writes=1),
                                  StoreContext(NS, 0, SLOT, auth=auth), max_chunk_blocks=2)
        self.worker = ChunkWorker(TIER, s3, DriverSettings("write-through", 2, 1.0), DriverContext(self.slots, self.counters, fetches_headers=True))
        self.scan = s3.scan()
        self.planner = ChunkPlanner(ChunkPolicy(TIER, "write-through", 1, 2, None), PlannerContext(1, SLOT, self.counters), Listing([self.scan.found]))

    def count(self, name: str) -> float:
        return self.counters.totals.get(f"{name}|{TIER}", 0)

    def settle(self, done: int = 0) -> tuple[WorkerReport, list[tuple[int, ChunkRead, bool]]]:
        meta, finished = WorkerReport(), []
        end = time.monotonic() + 15
        while time.monotonic() < end:
            finished += self.worker.poll()
            self.worker.take_meta(meta)
            if len(meta.written) + len(meta.failed) + len(finished) >= done:
                break
            time.sleep(0.01)
        self.planner.on_worker_meta(meta)
        return meta, finished

    def save(self, keys: list[BlockKey]) -> int:
        """The CPU tier saved ``keys`` (slot i holds key i's bytes): write-through writes
        what the planner admits. The number of chunks written."""
        self.planner.note_request(keys)
        for i, k in enumerate(keys):
            self.pool.planes[0][i].fill_(k[0] ^ i)
            self.slots.set_key(i, k)
            self.planner.on_cpu_save(i, k)
        slot_of = {k: i for i, k in enumerate(keys)}
        _, through, deletes = self.planner.take_jobs(set(), slot_of.get)
        self.worker.delete(deletes)
        self.worker.write(through)
        meta, _ = self.settle(len(through))
        assert not meta.failed, meta.failed
        return len(through)

    def load(self, keys: list[BlockKey]) -> list[bool]:
        """Read every key the planner locates into slots 4.. ; True for each that loaded."""
        reads = []
        for n, k in enumerate(keys):
            loc = self.planner.locate(k)
            if loc is None:
                reads.append(None)
                continue
            rid = self.worker.start_read(ChunkRead(TIER, loc[0], (loc[1],), (4 + n % 4,), (k,)))
            reads.append(rid)
        _, finished = self.settle(sum(r is not None for r in reads))
        ok = {rid: good for rid, _, good in finished}
        return [r is not None and ok.get(r, False) for r in reads]

    def close(self) -> None:
        self.worker.close()
        self.planner.close()
        self.store.close()


def test_a_rolling_rotation_across_two_instances(s3_server: MotoServer, s3_bucket: str) -> None:
    old = [key(1), key(2)]
    new = [key(11), key(12)]
    # A signs with k1 and stores a prefix.
    a = Instance(s3_server, s3_bucket, ChunkAuth(K1), "a")
    assert a.save(old) == 1 and a.count("blocks_stored") == 2
    a.close()
    # B rotates first: k2 signs, k1 verifies. It indexes A's chunk and loads it.
    b = Instance(s3_server, s3_bucket, ChunkAuth(K2, [K1]), "b")
    assert len(b.scan.found) == 1 and not b.scan.problems
    assert b.load(old) == [True, True] and b.count("blocks_loaded") == 2
    b.close()
    # A rotates too: it still reads its k1 chunk, and writes with k2.
    a = Instance(s3_server, s3_bucket, ChunkAuth(K2, [K1]), "a")
    assert a.load(old) == [True, True]
    assert a.save(new) == 1
    a.close()
    # k1 is dropped everywhere: k1's chunk is never indexed (nor its manifest trusted),
    # k2's is; the old prefix is a miss, written again with k2, then loaded.
    c = Instance(s3_server, s3_bucket, ChunkAuth(K2), "b")
    assert len(c.scan.found) == 1 and c.scan.problems.get(FailureReason.UNAUTHENTICATED) == 1, c.scan.problems
    # A's manifest is signed with k2 now (rewritten at its close); nothing signed with k1 is trusted.
    assert c.load(new) == [True, True]
    assert c.load(old) == [False, False]
    assert c.save(old) == 1 and c.count("blocks_stored") == 2  # the rewrite
    assert c.load(old) == [True, True]
    c.close()
    d = Instance(s3_server, s3_bucket, ChunkAuth(K2), "d")  # and the next instance finds both
    assert len(d.scan.found) == 2
    assert d.load(old + new) == [True] * 4 and d.count("load_failures") == 0
    d.close()


def test_a_chunk_refused_as_unauthenticated_is_forgotten_and_written_again() -> None:
    """A chunk indexed and then found signed with a key this instance does not accept (a
    rotation; an object replaced): the worker reports it ``untrusted``, not bad; the
    planner forgets it (counted) without deleting it, its keys are admitted and written
    again; a rescan that lists it again does not bring it back."""
    pool = CPUPool(8, (SLOT,), pin=False, prefault=False)
    slots = SlotTable(pool)
    counters = Counters()
    old_fleet = MemoryStore(NS, SLOT, auth=ChunkAuth(K1), max_chunk_blocks=2)
    mine = MemoryStore(NS, SLOT, auth=ChunkAuth(K2), max_chunk_blocks=2)
    w = ChunkWorker(TIER, mine, DriverSettings("write-through", 2, 1.0), DriverContext(slots, counters, fetches_headers=True))
    other = ChunkWorker(TIER, old_fleet, DriverSettings("write-through", 2, 1.0), DriverContext(slots, Counters(), fetches_headers=True))
    keys = [key(1), key(2)]
    try:
        for i, k in enumerate(keys):
            slots.set_key(i, k)
        other.write([ChunkWriteJob(TIER, "c1", (0, 1), tuple(keys))])
        m, end = WorkerReport(), time.monotonic() + 10
        while not m.written and time.monotonic() < end:
            other.poll()
            other.take_meta(m)
            time.sleep(0.01)
        assert m.written
        raw = old_fleet.raw("c1")
        assert raw is not None
        mine.forge("c1", bytes(raw))  # one medium, as a shared bucket is
        planner = ChunkPlanner(ChunkPolicy(TIER, "write-through", 1, 2, None), PlannerContext(1, SLOT, counters), Listing([{}]))
        planner.index.add_existing("c1", keys, 2 * SLOT)  # indexed before (e.g. a header cached)
        assert planner.locate(keys[0]) == ("c1", 0) and not planner.admitted(keys[0])
        rid = w.start_read(ChunkRead(TIER, "c1", (0,), (5,), (keys[0],)))
        meta, end = WorkerReport(), time.monotonic() + 10
        done: list[Any] = []
        while not done and time.monotonic() < end:
            done += w.poll()
            time.sleep(0.01)
        w.take_meta(meta)
        assert [(r, ok) for r, _, ok in done] == [(rid, False)]
        assert meta.untrusted == {(TIER, "c1")} and not meta.bad
        planner.note_request(keys)
        planner.on_worker_meta(meta)
        assert planner.locate(keys[0]) is None and planner.admitted(keys[0])
        assert counters.totals.get(f"untrusted_chunks|{TIER}") == 1
        for i, k in enumerate(keys):
            planner.on_cpu_save(i, k)
        _, through, deletes = planner.take_jobs(set(), {k: i for i, k in enumerate(keys)}.get)
        assert deletes == []  # not deleted: it may be another fleet's good data
        assert [j.keys for j in through] == [tuple(keys)]  # written again
    finally:
        w.close()
        other.close()
        mine.close()
        old_fleet.close()


def test_a_key_named_chunk_refused_as_unauthenticated_is_deleted_for_its_rewrite() -> None:
    """A pool (Mooncake) names a chunk by its key and keeps an existing object on a put:
    the rewrite needs the old object gone."""
    planner = ChunkPlanner(ChunkPolicy("mooncake", "write-through", 1, 1, None, key_named=True), PlannerContext(1, SLOT, Counters()), Listing([{}]))
    k = key(3)
    planner.index.add_existing(k.hex(), [k], SLOT)
    planner.on_worker_meta(WorkerReport(untrusted={("mooncake", k.hex())}))
    planner.note_request([k])
    planner.on_cpu_save(0, k)
    _, through, deletes = planner.take_jobs(set(), {k: 0}.get)
    assert deletes == [k.hex()] and [j.chunk_id for j in through] == [k.hex()]


def test_verify_keys_config(tmp_path: Any) -> None:
    f = tmp_path / "old.key"
    f.write_text(K1.hex() + "\n")
    f.chmod(0o600)
    auth = load_auth(AuthConfig(verify_key_files=(str(f),), verify_key_envs=("OLD2",)),
                     {"KVTIER_AUTH_KEY": K2.hex(), "OLD2": bytes(range(50, 82)).hex()})
    assert auth is not None and auth.key_id == ChunkAuth(K2).key_id
    assert auth.key_ids == {ChunkAuth(K).key_id for K in (K1, K2, bytes(range(50, 82)))}
    assert K1.hex() not in repr(auth) and K2.hex() not in repr(auth)
    with pytest.raises(ConfigError, match=r"auth\.verify_key_envs\[0\]"):  # named but unset
        load_auth(AuthConfig(verify_key_envs=("NOPE",)), {"KVTIER_AUTH_KEY": K2.hex()})
    with pytest.raises(ConfigError, match=r"auth\.verify_key_files"):  # no signing key
        load_auth(AuthConfig(verify_key_files=(str(f),)), {})
    with pytest.raises(ConfigError, match=r"auth\.verify_key_files\[1\]"):
        AuthConfig(verify_key_files=(str(f), "relative"))
    with pytest.raises(ConfigError, match=r"auth\.verify_key_envs\[0\]"):
        AuthConfig(verify_key_envs=("1BAD",))
    f.chmod(0o644)
    with pytest.raises(ConfigError, match=r"auth\.verify_key_files\[0\]"):
        load_auth(AuthConfig(verify_key_files=(str(f),)), {"KVTIER_AUTH_KEY": K2.hex()})
