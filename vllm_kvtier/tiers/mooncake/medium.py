"""The Mooncake medium (:class:`MooncakeMedium`): the byte primitives of the Mooncake store.

Who calls it: the store kernel's I/O threads, several at once (see
:mod:`~vllm_kvtier.tiers.mooncake.store` for the store, the objects and the failures).
It moves whole objects through one registered arena, in batches, and turns Mooncake's
return codes into failure reasons. Every client call goes through the circuit breaker.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
from collections.abc import Callable
from typing import Any

from vllm_kvtier.chunkformat import ChunkFormatError, align_up
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.kernel import ReadShape
from vllm_kvtier.tiers.resilience import CircuitBreaker

__all__ = ["Arena", "ArenaSlice", "MooncakeError", "MooncakeMedium", "code_reason", "object_key"]

logger = logging.getLogger("vllm_kvtier.tiers.mooncake.store")

#: Mooncake's ErrorCode values (mooncake-store/include/types.h) -> our failure labels.
_CODE_REASONS: dict[int, FailureReason] = {
    -10: FailureReason.TRUNCATED,  # BUFFER_OVERFLOW
    -101: FailureReason.MISSING,  # SEGMENT_NOT_FOUND: the client that held the replica left the pool
    -200: FailureReason.POOL_FULL,  # NO_AVAILABLE_HANDLE: no space in any segment
    -400: FailureReason.BAD_REQUEST,  # INVALID_KEY
    -600: FailureReason.BAD_REQUEST,  # INVALID_PARAMS (e.g. a buffer smaller than the object)
    -703: FailureReason.NOT_READY,  # REPLICA_IS_NOT_READY: another client is still writing it
    -704: FailureReason.MISSING,  # OBJECT_NOT_FOUND (never stored, evicted or removed)
    -705: FailureReason.EXISTS,  # OBJECT_ALREADY_EXISTS
    -706: FailureReason.LEASE,  # OBJECT_HAS_LEASE
    -707: FailureReason.LEASE_EXPIRED,  # LEASE_EXPIRED before the transfer finished
    -710: FailureReason.MISSING,  # REPLICA_NOT_FOUND
    -712: FailureReason.MISSING,  # REPLICA_IS_GONE
    -714: FailureReason.NOT_READY,  # OBJECT_REPLICA_BUSY
    -800: FailureReason.TRANSFER,  # TRANSFER_FAIL
    -801: FailureReason.CHECKSUM,  # CHECKSUM_MISMATCH
    -900: FailureReason.UNAVAILABLE,  # RPC_FAIL: the master does not answer
    -901: FailureReason.UNAVAILABLE,  # RPC_TIMEOUT
    -1010: FailureReason.UNAVAILABLE,  # UNAVAILABLE_IN_CURRENT_STATUS
}
#: Reasons that say the pool is unhealthy (they count toward the circuit breaker); others
#: (missing, pool_full, checksum...) are answers about one object from a healthy pool.
_UNHEALTHY = frozenset({FailureReason.UNAVAILABLE, FailureReason.TRANSFER, FailureReason.ERROR})


def code_reason(rc: int) -> FailureReason:
    """The Mooncake medium's classifier: the reason of a negative Mooncake return code."""
    return _CODE_REASONS.get(rc, FailureReason.ERROR)


def object_key(namespace: str, rank: int, chunk_id: str) -> str:
    return f"kvtier/{namespace}/r{rank}/{chunk_id}"


# ---- the registered arena ----------------------------------------------------------------------


class ArenaSlice:
    """A page-aligned range of a store's arena (the ``buffer`` of a read result);
    :meth:`close` gives it back. Keep no view of it after closing."""

    def __init__(self, arena: Arena, offset: int, nbytes: int) -> None:
        self._arena: Arena | None = arena
        self.offset = offset
        self.nbytes = nbytes
        self.addr = arena.addr + offset
        self.view = arena.view[offset : offset + nbytes]

    def close(self) -> None:
        arena, self._arena = self._arena, None
        if arena is None:
            return
        self.view.release()
        arena.give(self.offset, self.nbytes)


class Arena:
    """One anonymous mapping, handed out first-fit in page-aligned slices (thread-safe)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = align_up(nbytes)
        self._map = mmap.mmap(-1, self.nbytes)
        anchor = ctypes.c_char.from_buffer(self._map)
        self.addr = ctypes.addressof(anchor)
        del anchor  # the address stays valid while the map lives; the export must not
        self.view = memoryview(self._map)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, length), sorted
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> ArenaSlice | None:
        need = align_up(max(nbytes, 1))
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, length - need)
                    return ArenaSlice(self, off, need)
        return None

    def give(self, offset: int, nbytes: int) -> None:
        with self._lock:
            free = self._free
            i = 0
            while i < len(free) and free[i][0] < offset:
                i += 1
            free.insert(i, (offset, nbytes))
            if i + 1 < len(free) and offset + nbytes == free[i + 1][0]:  # merge with the next
                free[i] = (offset, nbytes + free.pop(i + 1)[1])
            if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # and with the previous
                prev = free.pop(i - 1)
                free[i - 1] = (prev[0], prev[1] + free[i - 1][1])

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.addr <= addr and addr + nbytes <= self.addr + self.nbytes

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):  # a caller still holds a block view: the GC unmaps it later
            self._map.close()


# ---- the medium ---------------------------------------------------------------------------------


class MooncakeError(Exception):
    """A client call answered with a negative Mooncake return code (``rc``)."""

    def __init__(self, op: str, rc: int) -> None:
        super().__init__(f"{op}: Mooncake code {rc}")
        self.rc = rc


class _BreakerOpen(Exception):
    """The circuit breaker refused the call (nothing was sent)."""


class _NoArena(Exception):
    """No room in the registered arena for a transfer now."""


class MooncakeMedium:
    """The byte primitives of the Mooncake store for one (namespace, rank): whole objects in
    the pool, moved through the registered arena (see :mod:`~vllm_kvtier.tiers.mooncake.store`).
    Called by the kernel's I/O threads, several at once. Every client call goes through the
    breaker."""

    name = "mooncake"
    #: a pool object is fetched whole (the client has no ranged get)
    read_shape: ReadShape = "whole"

    def __init__(self, client: Any, arena: Arena, *, prefix: str, replicate: Any, breaker: CircuitBreaker,
                 max_batch: int) -> None:
        """``prefix``: the keys' common start, one (namespace, rank)'s (:func:`object_key`)."""
        self.client = client
        self.arena = arena
        self.prefix = prefix
        self.replicate = replicate
        self.breaker = breaker
        #: operations the kernel hands over per batch call (``mooncake.max_batch``)
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._requests: dict[str, int] = {}

    def key(self, chunk_id: str) -> str:
        return self.prefix + chunk_id

    def requests(self) -> dict[str, int]:
        """Client calls so far, by method (a batch counts once)."""
        with self._lock:
            return dict(self._requests)

    # ---- SizedMedium / AllocatingMedium --------------------------------------------------

    def size_of(self, chunk_id: str, deadline: float) -> int:
        """The object's size as the master tells it (unverified: the kernel bounds it)."""
        size = self._guarded(lambda: [int(self.call("get_size", self.key(chunk_id)))])[0]
        if size < 0:
            raise MooncakeError("get_size", size)
        return size

    def take_buffer(self, nbytes: int) -> ArenaSlice | None:
        return self.arena.take(nbytes)

    # ---- BatchingMedium ------------------------------------------------------------------

    def put_batch(self, items: list[tuple[str, memoryview]], deadline: float) -> list[BaseException | None]:
        """Copy each chunk into the arena, then one ``batch_put_from``. A key already stored
        is a success (``OBJECT_ALREADY_EXISTS``: the object is kept)."""
        out: list[BaseException | None] = [None] * len(items)
        staged: list[tuple[int, ArenaSlice, int]] = []
        try:
            for i, (_, view) in enumerate(items):
                buf = self.arena.take(view.nbytes)
                if buf is None:
                    out[i] = _NoArena(f"no room in the {self.arena.nbytes} B arena for {view.nbytes} B")
                    continue
                buf.view[: view.nbytes] = view
                staged.append((i, buf, view.nbytes))
            if staged:
                keys = [self.key(items[i][0]) for i, _, _ in staged]
                rcs = self._guarded(lambda: self.batch("batch_put_from", keys, [b.addr for _, b, _ in staged],
                                                       [n for _, _, n in staged], self.replicate), len(staged))
                for (i, _, _), rc in zip(staged, rcs, strict=True):
                    out[i] = None if rc in (0, -705) else MooncakeError("batch_put_from", rc)
        except _BreakerOpen as e:
            for i, _, _ in staged:
                out[i] = e
        finally:
            for _, buf, _ in staged:
                buf.close()
        return out

    def read_batch(self, items: list[tuple[str, int, memoryview]], deadline: float) -> list[BaseException | None]:
        """One ``batch_get_into`` of whole objects: into the views directly when they are
        arena memory (the kernel's reads), else through a staging slice of it. A key asked
        for twice is fetched once and copied (the client fills only one buffer per key of
        a batch); twice with another length, in a call of its own."""
        out: list[BaseException | None] = [None] * len(items)
        first: dict[str, int] = {}
        fetch: list[int] = []
        copies: list[tuple[int, int]] = []
        later: list[int] = []
        for i, (chunk_id, _, view) in enumerate(items):
            j = first.setdefault(chunk_id, i)
            if j == i:
                fetch.append(i)
            elif items[j][2].nbytes == view.nbytes:
                copies.append((i, j))
            else:
                later.append(i)
        for i, err in zip(fetch, self._get_batch([items[i] for i in fetch]), strict=True):
            out[i] = err
        for i, j in copies:
            out[i] = out[j]
            if out[j] is None:
                items[i][2][:] = items[j][2]
        if later:
            for i, err in zip(later, self.read_batch([items[i] for i in later], deadline), strict=True):
                out[i] = err
        return out

    def _get_batch(self, items: list[tuple[str, int, memoryview]]) -> list[BaseException | None]:
        """One ``batch_get_into`` of distinct keys."""
        out: list[BaseException | None] = [None] * len(items)
        plan: list[tuple[int, int, ArenaSlice | None]] = []  # (item, address, staging slice)
        try:
            for i, (_, offset, view) in enumerate(items):
                if offset != 0:
                    out[i] = ValueError(f"a ranged read (offset {offset}) of a whole-object medium")
                    continue
                addr = _address(view)
                if self.arena.contains(addr, view.nbytes):
                    plan.append((i, addr, None))
                    continue
                buf = self.arena.take(view.nbytes)
                if buf is None:
                    out[i] = _NoArena(f"no room in the {self.arena.nbytes} B arena for {view.nbytes} B")
                    continue
                plan.append((i, buf.addr, buf))
            if plan:
                keys = [self.key(items[i][0]) for i, _, _ in plan]
                rcs = self._guarded(lambda: self.batch("batch_get_into", keys, [a for _, a, _ in plan],
                                                       [items[i][2].nbytes for i, _, _ in plan]), len(plan))
                for (i, _, buf), rc in zip(plan, rcs, strict=True):
                    out[i] = self._got(items[i][2], rc, buf)
        except _BreakerOpen as e:
            for i, _, _ in plan:
                out[i] = e
        finally:
            for _, _, buf in plan:
                if buf is not None:
                    buf.close()
        return out

    @staticmethod
    def _got(view: memoryview, rc: int, staged: ArenaSlice | None) -> BaseException | None:
        if rc == -600:  # INVALID_PARAMS on a get: the object is larger than the chunk asked for
            return ChunkFormatError(f"the object is larger than the {view.nbytes} B asked for", FailureReason.FORMAT)
        if rc < 0:
            return MooncakeError("batch_get_into", rc)
        if rc < view.nbytes:
            return ChunkFormatError(f"truncated: {rc} of {view.nbytes} bytes", FailureReason.TRUNCATED)
        if staged is not None:
            view[:] = staged.view[: view.nbytes]
        return None

    # ---- Medium ---------------------------------------------------------------------------

    def put(self, chunk_id: str, view: memoryview, deadline: float) -> None:
        err = self.put_batch([(chunk_id, view)], deadline)[0]
        if err is not None:
            raise err

    def read_into(self, chunk_id: str, offset: int, dst: memoryview, deadline: float) -> None:
        err = self.read_batch([(chunk_id, offset, dst)], deadline)[0]
        if err is not None:
            raise err

    def delete(self, chunk_id: str) -> None:
        """A forced remove (a read lease does not block it); already gone is fine."""
        rc = self.batch("batch_remove", [self.key(chunk_id)], force=True)[0]
        if rc not in (0, -704):
            raise MooncakeError("batch_remove", rc)

    def classify(self, exc: BaseException) -> FailureReason:
        """The reason of a failure: a return code by :func:`code_reason`, the medium's own
        refusals by type. A ChunkFormatError never gets here: the kernel reads its reason."""
        if isinstance(exc, MooncakeError):
            return code_reason(exc.rc)
        if isinstance(exc, _BreakerOpen):
            return FailureReason.BREAKER_OPEN
        if isinstance(exc, _NoArena):
            return FailureReason.NO_BUFFER
        if isinstance(exc, ValueError):
            return FailureReason.BAD_REQUEST
        return FailureReason.ERROR

    def close(self) -> None:
        """Leave the pool and free the arena (about 2 s on a healthy pool, longer when the
        master is gone: the client's own RPC timeouts)."""
        try:
            self.client.unregister_buffer(self.arena.addr)
            self.client.close()
        except Exception as e:
            logger.warning("kvtier mooncake: closing the client failed: %s", e)
        self.arena.close()

    # ---- client calls -----------------------------------------------------------------------

    def call(self, method: str, *args: Any) -> Any:
        """One counted client call; an exception becomes -1 (``error``)."""
        self._count(method)
        try:
            return getattr(self.client, method)(*args)
        except Exception as e:
            logger.warning("kvtier mooncake: %s raised %s", method, e)
            return -1

    def batch(self, method: str, keys: list[str], *args: Any, **kw: Any) -> list[int]:
        """One counted batch call: per-key codes or sizes (an exception, or an answer of the
        wrong length, fails every key with -1)."""
        self._count(method)
        try:
            rcs = [int(rc) for rc in getattr(self.client, method)(keys, *args, **kw)]
        except Exception as e:
            logger.warning("kvtier mooncake: %s of %d keys raised %s", method, len(keys), e)
            return [-1] * len(keys)
        if len(rcs) != len(keys):
            logger.warning("kvtier mooncake: %s returned %d codes for %d keys", method, len(rcs), len(keys))
            return [-1] * len(keys)
        return rcs

    def _guarded(self, fn: Callable[[], list[int]], n: int = 1) -> list[int]:
        """``fn()``'s codes, through the breaker: refused at once while it is open; an
        answer with an unhealthy code (the pool, not one object) counts as a failure."""
        if not self.breaker.allow():
            raise _BreakerOpen("the Mooncake circuit breaker is open")
        rcs: list[int] = [-1] * n
        try:
            rcs = fn()
        finally:
            if any(rc < 0 and code_reason(rc) in _UNHEALTHY for rc in rcs):
                self.breaker.record_failure()
            else:
                self.breaker.record_success()
        return rcs

    def _count(self, method: str) -> None:
        with self._lock:
            self._requests[method] = self._requests.get(method, 0) + 1


def _address(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    anchor = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor
