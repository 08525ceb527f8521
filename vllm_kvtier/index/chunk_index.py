"""The scheduler's index of a chunk-file tier (NVMe): which keys are in which file.

Who calls it: the scheduler half, from vLLM's scheduler thread only. Pure bookkeeping.

Life of a chunk file: first :meth:`reserve`, when the scheduler decided to write it. Its
bytes count against the capacity at once. So the tier never exceeds its size even with
writes in flight. Then :meth:`confirm`, when every TP rank reported it durable; its keys
become loadable. Or :meth:`cancel`, when a write failed. Eviction is over whole files,
under an :class:`~vllm_kvtier.index.policy.EvictionPolicy` of file ids. It never takes a
pinned file (a load is reading it) nor one still being written. The bytes of such files
are counted, so :meth:`reserve` knows in O(1) whether a file fits before it evicts.

The policy is the caller's: ``nvme.eviction`` on NVMe (``kvaware`` by default), ``lru``
elsewhere. Under ``kvaware`` a file of blocks already reused (in two prompts) counts as
reused when written. Reused files and files read again live longer; one-off files leave
first, in order of age. No parent is given: a prompt's head often stays in DRAM, and its
files go down tail first anyway. Cost: O(log n) a write or read (a heap), as in DRAM.

A file the tier no longer holds is :meth:`retire`-d. It was deleted out of band or
expired by a bucket's lifecycle rule: an authoritative listing no longer shows it. It is
forgotten at once. If a load is reading it (pinned), it is no longer offered to lookups. It
is then forgotten when its last pin goes (:meth:`unpin`).

**Watching** (KV events): :attr:`ChunkIndex.watch`, when set, is called synchronously, on
the caller's thread. The call is ``watch(chunk_id, keys, True)`` when keys become
loadable from a file (confirmed, found, listed again). It is ``watch(chunk_id, keys,
False)`` when they stop being loadable (evicted, removed, retired). None (the default)
costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_kvtier.index.policy import EvictionPolicy, make_policy
from vllm_kvtier.keys import BlockKey


@dataclass
class _File:
    keys: tuple[BlockKey, ...]
    nbytes: int
    confirmed: bool = False
    pins: int = 0
    #: gone from the tier: removed at its last unpin
    retired: bool = False

    @property
    def held(self) -> bool:
        """Not evictable: still being written, or read by a load."""
        return not self.confirmed or self.pins > 0


class ChunkIndex:
    def __init__(self, capacity_bytes: int | None, eviction: str = "lru", file_bytes: int = 1) -> None:
        """``capacity_bytes`` None: unbounded (the tier is bounded elsewhere). ``eviction``:
        the order in which files leave, a :func:`~vllm_kvtier.index.policy.make_policy`
        name. ``file_bytes``: a typical file's size, to size the policy in files."""
        self._eviction = eviction
        self._file_bytes = max(1, file_bytes)
        self.used_bytes = 0
        #: bytes of files that cannot be evicted now (being written, or pinned)
        self._held_bytes = 0
        self._files: dict[str, _File] = {}
        self.resize(capacity_bytes)
        self._loc: dict[BlockKey, tuple[str, int]] = {}  # confirmed keys only
        self._pending: set[BlockKey] = set()
        self.evicted_blocks = 0
        #: Called with (file id, keys, loadable) as keys become loadable or stop being so.
        self.watch: Callable[[str, Sequence[BlockKey], bool], None] | None = None

    def resize(self, capacity_bytes: int | None) -> None:
        """Bound the index at ``capacity_bytes``. Only while it holds no file (the policy
        is sized anew): ValueError otherwise."""
        if self._files:
            raise ValueError("resize of a ChunkIndex in use")
        self.capacity_bytes = capacity_bytes
        files = 0 if capacity_bytes is None else capacity_bytes // self._file_bytes
        self.policy: EvictionPolicy[str] = make_policy(self._eviction, files)

    def __len__(self) -> int:
        return len(self._loc)

    def locate(self, key: BlockKey) -> tuple[str, int] | None:
        """(chunk_id, position) of a loadable key."""
        return self._loc.get(key)

    def writing(self) -> bool:
        """Whether some file is still being written (its keys not loadable yet)."""
        return bool(self._pending)

    def knows(self, key: BlockKey) -> bool:
        """Stored or being written: no need to write it again."""
        return key in self._loc or key in self._pending

    def reserve(self, chunk_id: str, keys: Sequence[BlockKey], nbytes: int, *, reused: bool = False) -> list[str] | None:
        """Account for a file about to be written, evicting the policy's files to make room.
        ``reused``: its blocks were reused before (the policy counts it as reused at once).

        Returns the evicted file ids (the caller deletes them), or None if it cannot fit
        (everything else pinned or in flight; nothing is changed then)."""
        if self.capacity_bytes is None:
            self._add(chunk_id, keys, nbytes, reused=reused)
            return []
        free = self.capacity_bytes - self.used_bytes
        if nbytes > free + self.used_bytes - self._held_bytes:
            return None
        victims: list[str] = []
        while free < nbytes:
            fid = self.policy.evict(self._evictable)
            assert fid is not None  # the evictable bytes were counted above
            victims.append(fid)
            f = self._files[fid]
            free += f.nbytes
            self.evicted_blocks += len(f.keys)
            self._drop(fid)
        self._add(chunk_id, keys, nbytes, reused=reused)
        return victims

    def _evictable(self, chunk_id: str) -> bool:
        return not self._files[chunk_id].held

    def _add(self, chunk_id: str, keys: Sequence[BlockKey], nbytes: int, *, confirmed: bool = False,
             reused: bool = False) -> None:
        if chunk_id in self._files:  # retired while a load read it, now written again
            self.remove(chunk_id)
        self._files[chunk_id] = _File(tuple(keys), nbytes)
        self._pending.update(keys)
        self.used_bytes += nbytes
        self._held_bytes += nbytes
        self.policy.insert(chunk_id)
        if reused:
            self.policy.access(chunk_id)
        if confirmed:
            self.confirm(chunk_id)

    def confirm(self, chunk_id: str) -> None:
        f = self._files.get(chunk_id)
        if f is None or f.confirmed:
            return
        f.confirmed = True
        if not f.pins:
            self._held_bytes -= f.nbytes
        self._pending.difference_update(f.keys)
        self._locate_keys(chunk_id, f)

    def _locate_keys(self, chunk_id: str, f: _File) -> None:
        new = []
        for pos, k in enumerate(f.keys):
            if k not in self._loc:
                self._loc[k] = (chunk_id, pos)
                new.append(k)
        if new and self.watch is not None:
            self.watch(chunk_id, new, True)

    def _unlocate_keys(self, chunk_id: str, f: _File) -> None:
        gone = []
        for pos, k in enumerate(f.keys):
            if self._loc.get(k) == (chunk_id, pos):
                del self._loc[k]
                gone.append(k)
        if gone and self.watch is not None:
            self.watch(chunk_id, gone, False)

    def add_existing(self, chunk_id: str, keys: Sequence[BlockKey], nbytes: int) -> bool:
        """A file found on disk at start-up. False if it does not fit (caller deletes it)."""
        if self.capacity_bytes is not None and self.used_bytes + nbytes > self.capacity_bytes:
            return False
        self._add(chunk_id, keys, nbytes, confirmed=True)
        return True

    def cancel(self, chunk_id: str) -> None:
        """A reserved write failed: forget it."""
        self.remove(chunk_id)

    def remove(self, chunk_id: str) -> tuple[BlockKey, ...]:
        if chunk_id in self._files:
            self.policy.discard(chunk_id)
        return self._drop(chunk_id)

    def _drop(self, chunk_id: str) -> tuple[BlockKey, ...]:
        """Forget ``chunk_id`` (the policy already has, or is told by the caller)."""
        f = self._files.pop(chunk_id, None)
        if f is None:
            return ()
        if f.held:
            self._held_bytes -= f.nbytes
        self.used_bytes -= f.nbytes
        self._pending.difference_update(f.keys)
        self._unlocate_keys(chunk_id, f)
        return f.keys

    def file_holding(self, key: BlockKey) -> str | None:
        """The file that stores or is writing ``key``, if any."""
        loc = self._loc.get(key)
        if loc is not None:
            return loc[0]
        if key in self._pending:
            return next((fid for fid, f in self._files.items() if not f.confirmed and key in f.keys), None)
        return None

    def touch(self, chunk_id: str) -> None:
        """A load read ``chunk_id``: a reuse, for the eviction policy."""
        if chunk_id in self._files:
            self.policy.access(chunk_id)

    def pin(self, chunk_id: str) -> None:
        f = self._files[chunk_id]
        if not f.held:
            self._held_bytes += f.nbytes
        f.pins += 1

    def unpin(self, chunk_id: str) -> None:
        f = self._files.get(chunk_id)
        if f is not None and f.pins > 0:
            f.pins -= 1
            if not f.held:
                self._held_bytes -= f.nbytes
            if f.pins == 0 and f.retired:
                self.remove(chunk_id)

    def retire(self, chunk_id: str) -> bool:
        """The tier no longer holds ``chunk_id``: forget it now, or at its last unpin if a load
        is reading it. A file still being written (reserved, not confirmed) is ours in
        flight and is kept. True if it is forgotten (now, or at its last unpin)."""
        f = self._files.get(chunk_id)
        if f is None or not f.confirmed:
            return False
        if f.pins:  # no new lookup finds it; the loads reading it finish
            f.retired = True
            self._unlocate_keys(chunk_id, f)
        else:
            self.remove(chunk_id)
        return True

    def unretire(self, chunk_id: str) -> None:
        """The tier holds ``chunk_id`` again (listed again before its last unpin)."""
        f = self._files.get(chunk_id)
        if f is not None and f.retired:
            f.retired = False
            self._locate_keys(chunk_id, f)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._files

    def chunk_ids(self) -> list[str]:
        return list(self._files)

    def loadable_keys(self, chunk_id: str) -> list[BlockKey]:
        """The keys lookups find in ``chunk_id`` now (none while it is written or retired)."""
        f = self._files.get(chunk_id)
        if f is None:
            return []
        return [k for pos, k in enumerate(f.keys) if self._loc.get(k) == (chunk_id, pos)]
