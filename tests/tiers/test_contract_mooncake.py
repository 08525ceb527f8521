"""The store contract, bound to the Mooncake store against a real mooncake_master on
127.0.0.1 (testkit/mooncake_server.py; skipped with the reason where mooncake is missing).
Damage is done to the objects themselves, through a raw client of the same pool.

Reads land in the store's own registered arena, not in the injected pool, so every miss
here also asserts that the arena gave out no more than :data:`SMALL` for it; and the cases
that are Mooncake's own: a size from the master larger than any chunk this engine writes
(bounded before any arena memory is taken) and a put of an id that exists (the stored
object is kept, so a stale header is made through the raw client instead)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit import mooncake_server as mcsrv
from testkit.mooncake_server import MooncakeMaster, raw_client
from tests.tiers.contract import BLOCK, MAX_BLOCKS, NS, SMALL, StoreContract, block, key, wait_for
from vllm_kvtier.chunkformat import ChunkHeader, max_chunk_bytes
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.buffers import BufferPool, WriteBuffer
from vllm_kvtier.tiers.mooncake.store import MooncakeStore
from vllm_kvtier.tiers.registry import StoreContext

pytestmark = pytest.mark.mooncake

mooncake_master = mcsrv.mooncake_master  # fixture: one master for this module
#: Every store of this module gets a rank of its own: its own key space in the one pool.
_ranks = itertools.count()


@pytest.fixture(scope="module")
def raw(mooncake_master: MooncakeMaster) -> Iterator[Any]:
    with raw_client(mooncake_master.address) as client:
        yield client


class TestMooncakeStore(StoreContract):
    @pytest.fixture(autouse=True)
    def _pool_clients(self, mooncake_master: MooncakeMaster, raw: Any) -> None:
        self.master, self.raw = mooncake_master, raw

    def make_store(self, tmp_path: Path, **kw: Any) -> MooncakeStore:
        cfg = self.master.config(global_segment_bytes=16 << 20, deadline_s=kw.pop("read_deadline_s"),
                                 **({"max_queued_writes": kw.pop("max_queued_writes")}
                                    if "max_queued_writes" in kw else {}))
        kw.pop("rank", None)  # a rank of its own whatever was asked (distinct, as asked)
        ctx = StoreContext(NS, next(_ranks), BLOCK, buffers=kw.pop("buffers", None), auth=kw.pop("auth", None))
        return MooncakeStore(cfg, ctx, **kw)

    def get_raw(self, store: MooncakeStore, chunk_id: str) -> bytes:  # type: ignore[override]
        return bytes(self.raw.get(store.key(chunk_id)))

    def put_raw(self, store: MooncakeStore, chunk_id: str, data: bytes) -> None:  # type: ignore[override]
        assert self.raw.upsert(store.key(chunk_id), data) == 0

    def assert_miss(self, store: MooncakeStore, pool: BufferPool, chunk_id: str,  # type: ignore[override]
                    header: ChunkHeader | None, positions: list[int], reason: FailureReason,
                    keys: list[bytes] | None = None) -> None:
        """The contract's miss, and what the store's arena gave out for it bounded too."""
        medium = store.medium
        taken: list[int] = []
        take = medium.take_buffer  # type: ignore[attr-defined]

        def metered(nbytes: int) -> Any:
            taken.append(nbytes)
            return take(nbytes)

        medium.take_buffer = metered  # type: ignore[attr-defined]
        try:
            super().assert_miss(store, pool, chunk_id, header, positions, reason, keys)
        finally:
            del medium.take_buffer  # type: ignore[attr-defined]
        assert max(taken, default=0) <= SMALL, taken

    # ---- Mooncake's own cases ----------------------------------------------------------------

    def test_size_larger_than_any_chunk_is_too_large(self, store: MooncakeStore, pool: BufferPool) -> None:
        """get_size answers for the master; a size this engine could not have written is
        refused before the arena is asked for memory and before anything is fetched."""
        self.write(store, pool, "c1", 0, 2)
        data = self.get_raw(store, "c1")
        self.put_raw(store, "c1", data + bytes(max_chunk_bytes(MAX_BLOCKS, BLOCK) + 1 - len(data)))
        before = store.stats().requests.get("batch_get_into", 0)
        self.assert_miss(store, pool, "c1", None, [0], FailureReason.TOO_LARGE)
        assert store.stats().requests.get("batch_get_into", 0) == before  # nothing fetched

    def test_size_larger_than_the_arena_is_too_large_not_no_buffer(self, pool: BufferPool) -> None:
        """A 3 MiB object under our key, a 1 MiB arena: refused by the bound, never sized into
        the arena (which would only say ``no_buffer``, a transient miss kept for retries)."""
        cfg = self.master.config(global_segment_bytes=16 << 20, transfer_buffer_bytes=1 << 20)
        s = MooncakeStore(cfg, StoreContext(NS, next(_ranks), BLOCK, buffers=pool),
                          max_chunk_blocks=MAX_BLOCKS)
        try:
            self.put_raw(s, "big", bytes(3 << 20))
            self.assert_miss(s, pool, "big", None, [0], FailureReason.TOO_LARGE)
            assert FailureReason.TOO_LARGE.damaged and not FailureReason.NO_BUFFER.damaged
        finally:
            s.close(30.0)

    def test_a_put_of_an_existing_id_keeps_the_stored_object(self, store: MooncakeStore, pool: BufferPool) -> None:
        h = self.write(store, pool, "c1", 0, 2)
        wb = WriteBuffer([key(0), key(1)], BLOCK, pool)
        for i in range(2):
            with wb.block(i) as b:
                b[:] = bytes(BLOCK)
        assert store.submit_write(2, "c1", wb)
        assert wait_for(store, 2).ok  # OBJECT_ALREADY_EXISTS is a success: ids name their content
        r = self.read(store, "c1", h, [1])
        assert r.ok and r.blocks is not None and r.blocks[0].tobytes() == block(1), r.reason
        r.release()

    def test_stale_header_read_along_is_a_checksum_miss(self, store: MooncakeStore,  # type: ignore[override]
                                                       pool: BufferPool) -> None:
        """The contract's case, with the rewrite done through the raw client (a put here
        keeps the stored object, see above)."""
        h = self.write(store, pool, "c1", 0, 2)
        wb = WriteBuffer([key(0), key(1)], BLOCK, pool)
        for i in range(2):
            with wb.block(i) as b:
                b[:] = bytes(BLOCK)
        assert store.submit_write(3, "zeros", wb) and wait_for(store, 3).ok
        self.put_raw(store, "c1", self.get_raw(store, "zeros"))  # same keys, other bytes
        self.assert_miss(store, pool, "c1", h, [0], FailureReason.CHECKSUM)

    def test_headerless_reads_are_one_size_and_one_batched_get(self, store: MooncakeStore, pool: BufferPool) -> None:
        """A read without a header costs a get_size and ONE transfer (batched with others)."""
        headers = [self.write(store, pool, f"h{c}", 10 * c, 2, job=c + 1) for c in range(4)]
        before = store.stats().requests
        for c in range(4):
            store.submit_read(200 + c, f"h{c}", None, [1], [key(10 * c + 1)])
        for c in range(4):
            r = wait_for(store, 200 + c)
            assert r.ok and r.header == headers[c] and r.blocks is not None, r.reason
            assert r.blocks[0].tobytes() == block(10 * c + 1)
            r.release()
        after = store.stats().requests
        assert after["get_size"] - before.get("get_size", 0) == 4
        assert 1 <= after["batch_get_into"] - before.get("batch_get_into", 0) <= 4
