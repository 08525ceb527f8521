"""Issue 14, bounded S3 state: the listing is authoritative (what a rescan no longer lists
leaves the scheduler's index, a pinned chunk at its unpin), every table a long-running
instance keeps is bounded (scan header caches, the writer's manifest table, the manifest
object itself), manifests of gone writers are collected, chunks on only some TP ranks are
never indexed.

Against a real S3 server (moto) on 127.0.0.1, with the real planner (ChunkPlanner,
Rescanner) on top of real S3Stores. The 100k-object bound uses fake listing pages (the
objects themselves would take minutes to upload to moto) and one real manifest.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from testkit import s3_server as s3srv
from testkit.s3_server import MotoServer
from tests.tiers.test_s3_store import BLOCK, NS, config, key, write
from vllm_kvtier.catalog.base import Found, Listing
from vllm_kvtier.catalog.rescan import Rescanner
from vllm_kvtier.chunkformat import ChunkHeader, make_header
from vllm_kvtier.jobs import WorkerReport
from vllm_kvtier.keys import BlockKey
from vllm_kvtier.metrics import Counters
from vllm_kvtier.plan.chunk_plan import ChunkPlanner, ChunkPolicy, PlannerContext
from vllm_kvtier.tiers.registry import StoreContext
from vllm_kvtier.tiers.s3.manifest import decode_manifest, encode_manifest
from vllm_kvtier.tiers.s3.store import S3Store

pytestmark = pytest.mark.s3
s3_server = s3srv.s3_server
s3_bucket = s3srv.s3_bucket


def planner(stores: list[S3Store], counters: Counters) -> tuple[ChunkPlanner, Rescanner]:
    """The S3 tier's planner as the connector builds it (engine/lower.py), its rescans
    run by the test (a long interval: the thread never fires on its own)."""

    def scan() -> Found:
        out = []
        for st in stores:
            got = st.scan(collect=True).found
            assert st.last_scan.complete
            out.append(got)
        return out

    found = scan()
    rescanner = Rescanner("s3", scan, 3600.0, initial=found)
    policy = ChunkPolicy("s3", "write-through", 1, 16, None)
    p = ChunkPlanner(policy, PlannerContext(len(stores), BLOCK, counters), Listing(found, catalog=rescanner))
    return p, rescanner


def step(p: ChunkPlanner) -> None:
    """One engine step of the planner (it applies the next slice of a finished rescan)."""
    p.take_jobs(set(), lambda k: None)


def loadable(p: ChunkPlanner, first: int, n: int) -> bool:
    return all(p.locate(BlockKey(key(first + i))) is not None for i in range(n))


@pytest.fixture
def store(s3_server: MotoServer, s3_bucket: str) -> Iterator[S3Store]:
    s = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 0, BLOCK))
    yield s
    s.close()


def test_object_deleted_out_of_band_leaves_the_index_a_pinned_one_at_unpin(
        store: S3Store, s3_server: MotoServer) -> None:
    for i in range(3):
        write(store, f"c{i}", 10 * i, 2, job=i + 1)
    counters = Counters()
    p, rescanner = planner([store], counters)
    try:
        assert all(loadable(p, 10 * i, 2) for i in range(3))
        p.index.pin("c1")  # a load is reading c1
        client = s3_server.client()
        for fid in ("c0", "c1"):
            client.delete_object(Bucket=store.config.bucket, Key=store.key(fid))
        rescanner.rescan_once()
        step(p)
        assert not loadable(p, 0, 2)  # gone at once
        assert not loadable(p, 10, 2)  # no new lookup finds it...
        assert "c1" in p.index  # ...but the load reading it keeps its entry
        assert loadable(p, 20, 2)
        p.index.unpin("c1")
        assert "c1" not in p.index and "c0" not in p.index
        assert counters.totals["rescan_removed_chunks|s3"] == 2

        # Written again (another instance) and listed: found again at the next rescan.
        write(store, "c0", 0, 2, job=9)
        rescanner.rescan_once()
        step(p)
        assert loadable(p, 0, 2)
    finally:
        p.close()


def test_pinned_chunk_listed_again_before_unpin_stays() -> None:
    h = make_header(NS, [key(1)], [0], BLOCK)
    listing: list[Found] = [[{"a": h}], [{}], [{"a": h}]]
    r = Rescanner("s3", lambda: listing.pop(0), 3600.0, initial=[{"a": h}])
    p = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 16, None), PlannerContext(1, BLOCK, Counters()), Listing([{"a": h}], catalog=r))
    p.index.pin("a")
    for _ in range(2):  # unchanged, then gone
        r.rescan_once()
    step(p)
    assert p.locate(BlockKey(key(1))) is None
    r.rescan_once()  # back before the load ended
    step(p)
    p.index.unpin("a")
    assert p.locate(BlockKey(key(1))) == ("a", 0)
    p.close()


def test_own_write_deleted_before_any_rescan_listed_it_is_removed() -> None:
    """A chunk this instance wrote (confirmed on every rank) and that expired before any
    listing showed it still leaves the index: the rescan knows our confirmed writes."""
    h = make_header(NS, [key(1)], [0], BLOCK)
    r = Rescanner("s3", lambda: [{}], 3600.0, initial=[{}])
    assert r.diff([{"a": h}]).added and not r.diff([{}]).added
    r.note_written("b")
    assert r.rescan_once().removed == frozenset({"b"})
    r.close()


def test_a_failed_listing_removes_nothing() -> None:
    """A listing that could not complete raises (engine/lower.py checks each store's
    ``last_scan.complete``): nothing is queued, and our writes are still checked next time."""
    h = make_header(NS, [key(1)], [0], BLOCK)
    results: list[Any] = [RuntimeError("listing failed"), [{}]]

    def scan() -> Found:
        got = results.pop(0)
        if isinstance(got, Exception):
            raise got
        return got  # type: ignore[no-any-return]

    r = Rescanner("s3", scan, 3600.0, initial=[{"a": h}])
    p = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 16, None), PlannerContext(1, BLOCK, Counters()), Listing([{"a": h}], catalog=r))
    r.note_written("b")
    with pytest.raises(RuntimeError):
        r.rescan_once()
    step(p)
    assert p.locate(BlockKey(key(1))) == ("a", 0)
    assert r.rescan_once().removed == frozenset({"a", "b"})
    p.close()


def test_a_huge_delta_is_applied_in_bounded_slices() -> None:
    n = 10_000
    found: Found = [{f"f{i}": make_header(NS, [key(i)], [0], BLOCK) for i in range(n)}]
    r = Rescanner("s3", lambda: found, 3600.0, initial=[{}])
    p = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 16, None), PlannerContext(1, BLOCK, Counters()), Listing([{}], catalog=r))
    r.rescan_once()
    sizes = []
    while True:
        p.refresh()  # a lookup: the step's slice
        sizes.append(len(p.index))
        p.refresh()  # another lookup in the same step: nothing more
        assert len(p.index) == sizes[-1]
        step(p)
        if not p.rescan_pending():
            break
    assert sizes[-1] == n and len(sizes) >= 3
    assert all(b - a <= 4096 for a, b in zip([0, *sizes], sizes, strict=False))
    p.close()


def test_chunks_on_only_some_ranks_are_never_indexed_and_counted(s3_server: MotoServer, s3_bucket: str) -> None:
    r0 = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 0, BLOCK))
    r1 = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 1, BLOCK))
    try:
        for st in (r0, r1):
            write(st, "both", 0, 2)
        write(r0, "only0", 10, 2, job=2)
        counters = Counters()
        p, rescanner = planner([r0, r1], counters)
        assert loadable(p, 0, 2) and not loadable(p, 10, 2)
        rescanner.rescan_once()
        step(p)
        assert not loadable(p, 10, 2)
        assert (counters.drain() or {})["gauges"]["partial_chunks|s3"] == 1
        p.close()
    finally:
        r0.close()
        r1.close()


# ---- manifests ------------------------------------------------------------------------------


def _manifest(s3_server: MotoServer, store: S3Store) -> tuple[int, dict[str, ChunkHeader]]:
    client = s3_server.client()
    got = client.get_object(Bucket=store.config.bucket, Key=store.manifest_key())
    data = got["Body"].read()
    return len(data), decode_manifest(data, NS, block_bytes=BLOCK)


def test_manifest_stays_bounded_across_ten_times_its_bound_with_lifecycle_deletes(
        s3_server: MotoServer, s3_bucket: str) -> None:
    bound = 12
    st = S3Store(config(s3_server, s3_bucket, manifest_max_entries=bound, manifest_every_writes=3),
                 StoreContext(NS, 0, BLOCK))
    client = s3_server.client()
    biggest = encode_manifest(NS, [(f"o{i:04d}", make_header(NS, [key(i)], [0], BLOCK)) for i in range(bound)])
    sizes = []
    try:
        for i in range(10 * bound):
            write(st, f"o{i:04d}", i, 1, job=i + 1)
            if i >= 4:  # a lifecycle rule expires what is older than a few writes
                client.delete_object(Bucket=s3_bucket, Key=st.key(f"o{i - 4:04d}"))
            assert st.manifest_entries() <= bound
            if i % 10 == 9:
                n, entries = _manifest(s3_server, st)
                sizes.append(n)
                assert len(entries) <= bound
    finally:
        st.close()
    n, entries = _manifest(s3_server, st)
    # Compressed sizes vary a little with the CRCs; the bound's worth of entries, not more.
    assert len(entries) == bound and max([*sizes, n]) <= 2 * len(biggest)
    # The newest writes, so a reader's scan covers what is live with no header GET.
    assert f"o{10 * bound - 1:04d}" in entries
    reader = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 0, BLOCK))
    try:
        assert len(reader.scan().found) == 4 and reader.last_scan.header_gets == 0
    finally:
        reader.close()


def test_restart_keeps_the_manifest_of_the_same_writer(s3_server: MotoServer, s3_bucket: str) -> None:
    a = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 0, BLOCK))
    write(a, "old", 0, 1)
    a.close()
    b = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 0, BLOCK))  # same host, rank, namespace
    assert b.writer_id == a.writer_id
    write(b, "new", 5, 1)
    b.close()
    listed = s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix=f"kv/{NS}/r0/manifest/")["Contents"]
    assert len(listed) == 1  # replaced, not added
    assert set(_manifest(s3_server, b)[1]) == {"old", "new"}


def test_stale_manifests_collected_and_unchanged_ones_not_fetched_again(
        s3_server: MotoServer, s3_bucket: str) -> None:
    gone = S3Store(config(s3_server, s3_bucket, writer_id="gone-writer"), StoreContext(NS, 0, BLOCK))
    write(gone, "g", 0, 1)
    gone.close()
    idle = S3Store(config(s3_server, s3_bucket, writer_id="idle-writer"), StoreContext(NS, 0, BLOCK))
    write(idle, "i", 5, 1)
    idle.close()
    client = s3_server.client()
    client.delete_object(Bucket=s3_bucket, Key=gone.key("g"))  # its only object expired

    live = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 0, BLOCK))
    try:
        assert set(live.scan(collect=True).found) == {"i"}
        assert live.last_scan.manifests_collected == 1  # covers nothing any more
        keys = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix=f"kv/{NS}/r0/manifest/")["Contents"]}
        assert keys == {idle.manifest_key()}
        # Unchanged since: no manifest GET, no header GET (the headers are cached).
        assert set(live.scan(collect=True).found) == {"i"}
        rep = live.last_scan
        assert (rep.manifest_gets, rep.manifests_unchanged, rep.header_gets, rep.from_cache) == (0, 1, 0, 1)
    finally:
        live.close()

    # Not rewritten for manifest_max_age_s: its writer is gone, the manifest is collected.
    old = S3Store(config(s3_server, s3_bucket, manifest_max_age_s=0.5), StoreContext(NS, 0, BLOCK))
    try:
        time.sleep(1.1)
        assert set(old.scan(collect=True).found) == {"i"}  # the object stays: only the manifest goes
        assert old.last_scan.manifests_collected == 1
        assert "Contents" not in client.list_objects_v2(Bucket=s3_bucket, Prefix=f"kv/{NS}/r0/manifest/")
    finally:
        old.close()


# ---- bounds past their limits ---------------------------------------------------------------

N_OBJECTS = 24_000  # listed objects: three times the writer's manifest bound below


@pytest.mark.slow  # a scale test: the full suite runs it, make test-fast does not
def test_scan_header_cache_and_manifest_table_stay_bounded_past_their_limits(
        s3_server: MotoServer, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """24k listed objects (fake listing pages), all covered by one real manifest: the
    scan's header cache holds at most ``header_cache_entries`` (stated bound: 1.5 KB each
    for 1-block headers, ~3 KB for 16-block chunks, see s3.header_cache_entries);
    a rescan fetches nothing again; the writer's manifest table holds at most
    ``manifest_max_entries`` however many chunks it wrote."""
    # The writer's table (rank 5: its manifest is not in the way of the scans below).
    writer = S3Store(config(s3_server, s3_bucket, manifest_every_writes=0, manifest_max_entries=8192),
                     StoreContext(NS, 5, BLOCK))
    for i in range(N_OBJECTS):
        writer.on_written(f"{i:06d}", make_header(NS, [key(i)], [0], BLOCK))
        assert writer.manifest_entries() <= writer.config.manifest_max_entries
    assert writer.manifest_entries() == writer.config.manifest_max_entries < N_OBJECTS
    writer.close()

    def listed(rank: int, n: int) -> Any:
        """Fake listing pages of ``n`` objects on ``rank`` plus the real manifests there,
        and one real manifest covering the ``n`` objects, as another writer leaves it."""
        st = S3Store(config(s3_server, s3_bucket), StoreContext(NS, rank, BLOCK))
        s3_server.client().put_object(Bucket=s3_bucket, Key=st.manifest_key("other"), Body=encode_manifest(
            NS, ((f"{i:06d}", make_header(NS, [key(i)], [0], BLOCK, rank=rank)) for i in range(n))))
        st.close()
        stamp = time.time()

        def install(st: S3Store) -> None:
            real = st.medium.list_pages

            def fake() -> Iterator[dict[str, Any]]:
                manifests = [o for page in real() for o in page.get("Contents", []) if "/manifest/" in o["Key"]]
                objs = [{"Key": st.key(f"{i:06d}"), "Size": 8192 + BLOCK, "LastModified": _Stamp(stamp + i)}
                        for i in range(n)]
                for i in range(0, n, 1000):
                    yield {"Contents": objs[i : i + 1000]}
                yield {"Contents": manifests}
            monkeypatch.setattr(st.medium, "list_pages", fake)
        return install

    install = listed(0, N_OBJECTS)
    # A reader refuses a manifest of more entries than its own bound: the fleet's is larger.
    st = S3Store(config(s3_server, s3_bucket, manifest_max_entries=N_OBJECTS), StoreContext(NS, 0, BLOCK))
    install(st)
    try:
        assert len(st.scan().found) == N_OBJECTS and st.last_scan.header_gets == 0
        assert st.header_cache_entries() == N_OBJECTS
        st.scan()  # nothing changed: no GET at all
        assert st.last_scan.manifest_gets == 0 and st.last_scan.from_cache == N_OBJECTS
    finally:
        st.close()

    # A smaller bound holds whatever the listing's size, in entries and in bytes (traced
    # on a smaller listing: tracing makes every allocation ten times slower).
    cap, n = 5_000, 20_000
    install = listed(1, n)
    st = S3Store(config(s3_server, s3_bucket, header_cache_entries=cap, manifest_max_entries=n),
                 StoreContext(NS, 1, BLOCK))
    install(st)
    try:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            assert len(st.scan().found) == n
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert st.header_cache_entries() == cap
        assert kept <= cap * 1536 + (1 << 20), kept  # ~1.1 KB an entry measured
    finally:
        st.close()


class _Stamp:
    """A listing's LastModified (what boto3 gives: something with ``timestamp()``)."""

    def __init__(self, t: float) -> None:
        self._t = t

    def timestamp(self) -> float:
        return self._t


def test_partial_rank_chunks_of_our_crashed_predecessor_are_deleted_at_start(
        s3_server: MotoServer, s3_bucket: str) -> None:
    """What a previous run of this host, rank and namespace left on only some ranks (its
    own manifest names it) is deleted by the scheduler at start; another writer's partial
    chunk (maybe a write in flight) is only left out of the index."""
    from vllm_kvtier.config import parse_config
    from vllm_kvtier.engine.lower import make_planners, tier_format

    ns = tier_format("s3", "native", namespace="ns", block_bytes=BLOCK, kv_dtype=None).namespace
    base = config(s3_server, s3_bucket)
    ranks = [S3Store(base, StoreContext(ns, r, BLOCK)) for r in range(2)]
    other = S3Store(config(s3_server, s3_bucket, writer_id="someone-else"), StoreContext(ns, 0, BLOCK))
    for st in ranks:
        write(st, "whole", 0, 2)
    write(ranks[0], "ours-torn", 10, 2, job=2)  # rank 1's write never happened (a crash)
    write(other, "theirs-torn", 20, 2, job=3)
    for st in (*ranks, other):
        st.close()  # manifests written
    s3 = {"bucket": s3_bucket, "prefix": "kv/", "endpoint_url": s3_server.url, "path_style": True,
          "rescan_interval_s": 0, "deadline_s": 2.0}
    counters = Counters()
    (p,) = make_planners(parse_config({"s3": s3}), namespace="ns", world_size=2, block_bytes_per_rank=BLOCK,
                         counters=counters)
    try:
        assert loadable(p, 0, 2) and not loadable(p, 10, 2) and not loadable(p, 20, 2)
        _, _, deletes = p.take_jobs(set(), lambda k: None)
        assert deletes == ["ours-torn"]
        assert counters.totals["reclaimed_files|s3"] == 1
        assert (counters.drain() or {})["gauges"]["partial_chunks|s3"] == 2
    finally:
        p.close()


def test_writer_manifest_forgets_objects_a_rescan_no_longer_lists(
        store: S3Store, s3_server: MotoServer) -> None:
    """Manifests are pruned of entries whose objects are gone: the planner hands the
    chunks a rescan dropped to the step's metadata once (``take_forgets``), the writer's
    store drops them from its manifest (no request sent), and the rewritten manifest
    object names only what the bucket still holds."""
    for i in range(4):
        write(store, f"c{i}", 10 * i, 2, job=i + 1)
    store.flush_manifest(blocking=True)
    counters = Counters()
    p, rescanner = planner([store], counters)
    try:
        assert store.manifest_entries() == 4
        client = s3_server.client()
        for fid in ("c0", "c2"):  # lifecycle expiry, as far as the instance can tell
            client.delete_object(Bucket=store.config.bucket, Key=store.key(fid))
        rescanner.rescan_once()
        step(p)
        gone = p.take_forgets()
        assert sorted(gone) == ["c0", "c2"]
        assert p.take_forgets() == []  # handed out once
        requests = store.stats().requests
        store.forget(gone + ["another-writers-chunk"])
        assert store.stats().requests == requests  # nothing sent
        assert store.manifest_entries() == 2
        store.flush_manifest(blocking=True)
        body = client.get_object(Bucket=store.config.bucket, Key=store.manifest_key())["Body"].read()
        assert sorted(decode_manifest(body, NS)) == ["c1", "c3"]
    finally:
        p.close()


def test_a_bad_read_deletes_only_chunks_this_instance_wrote() -> None:
    """On a shared tier a chunk whose read failed as damaged leaves the index either way;
    it is deleted only when this process wrote it (its header is its own write's), never
    when another writer's listing or manifest entry brought it (the failure may be the
    entry's: see test_forged_manifest_naming_real_objects_gets_nothing_deleted)."""
    theirs = make_header(NS, [key(1)], [0], BLOCK)
    counters = Counters()
    p = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 1, None), PlannerContext(1, BLOCK, counters), Listing([{"theirs": theirs}]))
    p.note_request([key(2)])
    p.on_cpu_save(0, BlockKey(key(2)))
    (job,) = p.take_jobs(set(), lambda k: 0)[1]
    p.on_worker_meta(WorkerReport(written={("s3", job.chunk_id): 1}))
    assert p.locate(BlockKey(key(2))) == (job.chunk_id, 0) and p.locate(BlockKey(key(1))) == ("theirs", 0)
    p.on_worker_meta(WorkerReport(bad={("s3", "theirs"), ("s3", job.chunk_id)}))
    assert p.take_jobs(set(), lambda k: None)[2] == [job.chunk_id]
    assert p.locate(BlockKey(key(1))) is None and p.locate(BlockKey(key(2))) is None
    assert counters.totals["forgotten_chunks|s3"] == 1
    p.close()


def _churn_listing(first: int, n: int) -> dict[str, ChunkHeader]:
    return {f"f{i:07d}": make_header(NS, [key(4 * i + j) for j in range(4)], [0] * 4, BLOCK)
            for i in range(first, first + n)}


def test_an_idle_engine_holds_one_merged_delta_not_every_rescans(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that takes no step keeps no rescan's delta apart: they merge by chunk id
    (a chunk listed then expired before a take is in neither), so 40 rescans of a bucket
    that turns over 500 chunks each hold about 500 chunks' entries, not 40 x 500. Before:
    every delta was queued until the next step (retained memory measured)."""
    monkeypatch.setattr("vllm_kvtier.catalog.rescan._MAX_PENDING_CHUNKS", 2000)
    rounds = iter(range(1, 41))
    r = Rescanner("s3", lambda: [_churn_listing(500 * next(rounds), 500)], 3600.0, initial=[_churn_listing(0, 500)])
    p = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 16, None), PlannerContext(1, BLOCK, Counters()), Listing([_churn_listing(0, 500)], catalog=r))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(40):
            r.rescan_once()
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 1 << 20, kept
    while True:  # the engine wakes: the index becomes the last listing
        step(p)
        if not p.rescan_pending():
            break
    assert set(p.index.chunk_ids()) == set(_churn_listing(500 * 40, 500))
    p.close()


def test_pending_rescan_changes_past_the_bound_resync(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket that grows by 500 chunks a rescan while the engine is idle: past the bound
    the pending changes are dropped and the next rescan sends one delta against what the
    planner last took; once the engine steps, its index is the listing."""
    monkeypatch.setattr("vllm_kvtier.catalog.rescan._MAX_PENDING_CHUNKS", 2000)
    rounds = iter(range(1, 11))
    r = Rescanner("s3", lambda: [_churn_listing(0, 500 * next(rounds))], 3600.0, initial=[{}])
    counters = Counters()
    p = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 16, None), PlannerContext(1, BLOCK, counters), Listing([{}], catalog=r))
    for _ in range(10):
        r.rescan_once()
    while True:
        step(p)
        if not p.rescan_pending():
            break
    assert set(p.index.chunk_ids()) == set(_churn_listing(0, 5000))
    assert counters.totals["rescan_resyncs|s3"] >= 1
    p.close()


def test_our_writes_waiting_for_a_listing_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """While listings fail, the chunk ids of our writes waiting to be checked by the next
    listing stay bounded (the rest are dropped and counted). Before: every id written was
    queued until a listing succeeded."""
    monkeypatch.setattr("vllm_kvtier.catalog.rescan._MAX_PENDING_CHUNKS", 1000)
    results: list[Any] = [RuntimeError("listing failed")] * 3 + [[{}]]

    def scan() -> Found:
        got = results.pop(0)
        if isinstance(got, Exception):
            raise got
        return got  # type: ignore[no-any-return]

    r = Rescanner("s3", scan, 3600.0, initial=[{}])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for round_ in range(3):
            for i in range(30_000):
                r.note_written(f"{round_}-{i:032d}")
            with pytest.raises(RuntimeError):
                r.rescan_once()
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 1 << 20, kept
    assert len(r.rescan_once().removed) == 1000  # the ids kept are still checked
    (d,) = r.take()
    assert d.counts["rescan_written_dropped"] == 89_000
    r.close()


def test_scan_header_cache_is_bounded_by_bytes(s3_server: MotoServer, s3_bucket: str) -> None:
    """The scan's header cache holds at most ``header_cache_bytes`` of headers (by
    header_memory_bytes) whatever ``header_cache_entries`` allows; a cache that overflowed
    makes the next scan read the unchanged manifest again instead of GETting headers."""
    from vllm_kvtier.chunkformat import header_memory_bytes

    writer = S3Store(config(s3_server, s3_bucket), StoreContext(NS, 0, BLOCK))
    for i in range(12):
        write(writer, f"c{i:02d}", 10 * i, 4, job=i + 1)
    writer.close()
    one = header_memory_bytes(make_header(NS, [key(0)] * 4, [0] * 4, BLOCK))
    st = S3Store(config(s3_server, s3_bucket, header_cache_bytes=5 * one, writer_id="reader"),
                 StoreContext(NS, 0, BLOCK))
    try:
        assert len(st.scan().found) == 12
        assert st.header_cache_bytes() <= 5 * one and st.header_cache_entries() == 5
        assert len(st.scan().found) == 12
        assert st.last_scan.manifest_gets == 1 and st.last_scan.header_gets == 0
    finally:
        st.close()


def test_a_failed_or_refused_write_deletes_nothing_on_a_shared_tier(s3_server: MotoServer, s3_bucket: str) -> None:
    """A chunk id on a shared tier may name another instance's object (a pool's ids are
    block keys; a bucket's may collide). A write of ours that failed on one rank, or was
    refused (queue full), leaves the index and queues no delete: the other instance's
    objects under that id stay. Before, the planner deleted the id on every rank."""
    cfg = config(s3_server, s3_bucket)
    counters = Counters()
    p = ChunkPlanner(ChunkPolicy("s3", "write-through", 1, 2, None), PlannerContext(2, BLOCK, counters), Listing([{}, {}]))
    where = {BlockKey(key(i)): i for i in range(4)}
    p.note_request([key(i) for i in range(4)])
    for i in range(4):
        p.on_cpu_save(i, BlockKey(key(i)))
    failed, refused = p.take_jobs(set(), where.get)[1]
    others = [S3Store(replace(cfg, writer_id="other"), StoreContext(NS, r, BLOCK)) for r in range(2)]
    for job in (failed, refused):  # the other instance stores the same ids on both ranks
        for st in others:
            write(st, job.chunk_id, 0, 2)
    for st in others:
        st.close()
    chunks = {k for k in _bucket_keys(s3_server, s3_bucket) if k.endswith(".kvt")}
    assert len(chunks) == 4
    p.on_worker_meta(WorkerReport(written={("s3", failed.chunk_id): 1}, failed={("s3", failed.chunk_id)},
                                  refused={("s3", refused.chunk_id)}))
    deletes = p.take_jobs(set(), lambda k: None)[2]
    ours = [S3Store(cfg, StoreContext(NS, r, BLOCK)) for r in range(2)]
    for st in ours:  # what the workers would do with them
        for fid in deletes:
            st.submit_delete(fid)
        st.close()
    assert deletes == []
    assert p.locate(BlockKey(key(0))) is None and p.locate(BlockKey(key(2))) is None
    assert {k for k in _bucket_keys(s3_server, s3_bucket) if k.endswith(".kvt")} == chunks
    p.close()


def _bucket_keys(server: MotoServer, bucket: str) -> set[str]:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}
