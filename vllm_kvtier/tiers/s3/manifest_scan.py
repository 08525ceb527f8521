"""The manifests an S3 scan reads (:class:`ManifestReader`, used by
:class:`~vllm_kvtier.tiers.s3.scan.S3Scanner`).

Who calls it: the scanner, on the thread that runs a scan. Manifest GETs run on the scan's
pool of threads. :meth:`ManifestReader.read` may run on any thread (the store's manifest
flush reads its writer's earlier one).

A manifest is hostile input; :mod:`~vllm_kvtier.tiers.s3.scan` says how each is bounded
and checked before it is decoded, and what a scan spends on them at most.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm_kvtier.chunkformat import ChunkFormatError, ChunkHeader
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.auth import ChunkAuth
from vllm_kvtier.tiers.resilience import DeadlineExceeded
from vllm_kvtier.tiers.s3.config import error_reason
from vllm_kvtier.tiers.s3.manifest import (
    SIG_BYTES,
    iter_manifest,
    manifest_name_refusal,
    max_manifest_bytes,
    signed_body,
)
from vllm_kvtier.tiers.s3.medium import S3Medium

__all__ = ["MANIFEST_READS_PER_SCAN", "MAX_MANIFEST_BYTES", "STABLE_REFUSALS", "BucketListing", "ManifestReader",
           "ManifestWork"]

# The S3 tier logs under one name, whichever of its modules speaks.
logger = logging.getLogger("vllm_kvtier.tiers.s3.store")

#: Why an object's own header was refused that the same bytes will always give: remembered
#: (by listed size) so that a rescan does not fetch it again.
STABLE_REFUSALS = frozenset({FailureReason.UNAUTHENTICATED, FailureReason.AUTH_FAILED, FailureReason.KEY_MISMATCH,
                             FailureReason.FORMAT, FailureReason.NAMESPACE, FailureReason.TOO_LARGE})

#: The largest manifest object a scan reads, whatever the config: a store refuses one
#: above :meth:`ManifestReader.limit_bytes` (what ``manifest_max_entries`` entries of
#: ``chunk_blocks`` blocks can need), and this, by its ``ContentLength`` before reading it.
#: A manifest is decoded as it arrives (:func:`~vllm_kvtier.tiers.s3.manifest.iter_manifest`,
#: which bounds its own fields), so its size costs transfer, not memory.
MAX_MANIFEST_BYTES = 1 << 30
#: Manifests a scan reads at most (beyond: the next scans read them, oldest first after
#: this writer's own and those read before). Each read costs a GET and a pass over its
#: bytes on the scheduler's process, so a bucket of forged ones costs each scan this much
#: at most.
MANIFEST_READS_PER_SCAN = 64
#: ... and the listed bytes of the manifests a scan reads at most (one is always read).
#: With a key a manifest is decoded only once its signature verifies: a forged one costs
#: a pass of HMAC over its bytes. Without, each is decoded (up to
#: :data:`~vllm_kvtier.tiers.s3.manifest.MAX_INFLATION` times its bytes), so fewer.
MANIFEST_BYTES_PER_SCAN = 64 << 20
UNSIGNED_MANIFEST_BYTES_PER_SCAN = 4 << 20
#: A signed manifest up to this long is held in memory while its signature is checked,
#: then decoded; a longer one is read twice (see :meth:`ManifestReader.read`).
MANIFEST_HOLD_BYTES = 4 << 20
#: Manifests refused for their bytes remembered at most (by ETag and size): one listed
#: unchanged is not read again.
MAX_REFUSED_MANIFESTS = 4096
#: Manifest names whose tag was checked, remembered at most (with a key; one listed again
#: is not checked again, nor counted refused again).
MAX_CHECKED_MANIFEST_NAMES = 16384
#: Why a manifest was refused that the same bytes will always give.
_STABLE_MANIFEST_REFUSALS = STABLE_REFUSALS | {FailureReason.CHECKSUM}


@dataclass
class _Tally:
    """What one manifest read decoded: manifests given to the decoder, and their bytes."""

    manifests: int = 0
    nbytes: int = 0


@dataclass
class ManifestWork:
    """What a scan spent on manifests (see :class:`~vllm_kvtier.tiers.s3.scan.ScanReport`)."""

    gets: int = 0
    refused: int = 0
    deferred: int = 0
    decoded: int = 0
    decoded_bytes: int = 0


@dataclass
class BucketListing:
    """What one LIST of a rank's prefix showed."""

    #: object_id -> (size, LastModified as a timestamp, key)
    objects: dict[str, tuple[int, float, str]] = field(default_factory=dict)
    #: manifest key -> (ETag, LastModified as a timestamp, size)
    manifests: dict[str, tuple[str, float, int]] = field(default_factory=dict)
    requests: int = 0
    #: the scan's deadline passed before the last page
    cut: bool = False


class ManifestReader:
    """The manifests of one store's prefix: which a scan reads, and what it remembers.

    It remembers, across scans, each manifest's ETag when last read. It remembers those
    refused for their bytes, and with a key the names checked. All are kept only while
    listed. ``own_key`` is the key of this store's writer's manifest. ``block_bytes`` and
    ``max_chunk_blocks`` bound every entry decoded."""

    def __init__(self, medium: S3Medium, *, block_bytes: int, max_chunk_blocks: int, auth: ChunkAuth | None,
                 own_key: str) -> None:
        self.medium = medium
        self.block_bytes = block_bytes
        self.max_chunk_blocks = max_chunk_blocks
        self.auth = auth
        self.own_key = own_key
        #: manifest key -> ETag when last read (only manifests the last listing showed)
        self._etags: dict[str, str] = {}
        #: manifest key -> (ETag, size, why) of manifests refused for their bytes: not read
        #: again while listed unchanged (LRU, at most :data:`MAX_REFUSED_MANIFESTS`)
        self._refused: OrderedDict[str, tuple[str, int, FailureReason]] = OrderedDict()
        #: manifest key -> why its name is refused (None: it verifies), with a key only (LRU,
        #: at most :data:`MAX_CHECKED_MANIFEST_NAMES`; only manifests the last listing showed)
        self._checked_names: OrderedDict[str, FailureReason | None] = OrderedDict()
        #: listed objects that this writer id's manifest names, see :meth:`take_own_objects`
        self._own_objects: frozenset[str] = frozenset()

    def take_own_objects(self) -> frozenset[str]:
        """The objects this writer's manifest named at the start-up scan: handed out once,
        then dropped."""
        out, self._own_objects = self._own_objects, frozenset()
        return out

    def fresh(self, listing: BucketListing, *, all_listed: bool) -> list[str]:
        """The listed manifests changed since they were last read (``all_listed``: every
        listed one)."""
        return [m for m, (etag, _, _) in listing.manifests.items() if all_listed or self._etags.get(m) != etag]

    def forget_unlisted(self, listing: BucketListing) -> None:
        """Forget what is kept of manifests ``listing`` no longer shows."""
        self._etags = {m: e for m, e in self._etags.items() if m in listing.manifests}
        for m in [m for m in self._refused if m not in listing.manifests]:
            del self._refused[m]
        for m in [m for m in self._checked_names if m not in listing.manifests]:
            del self._checked_names[m]

    def headers(self, pool: ThreadPoolExecutor, listing: BucketListing, fresh: list[str], collect: bool,
                problem: Callable[[str], None], doomed: list[str], late: Callable[[], bool],
                work: ManifestWork) -> dict[str, ChunkHeader]:
        """Headers from the manifests in ``fresh`` (changed since the last scan).

        Only the objects the listing shows count. With ``collect``, some other writers'
        manifests go to ``doomed``. Those are stale ones (not rewritten for
        ``manifest_max_age_s``) and ones that cover nothing. What it read, refused,
        deferred and decoded goes to ``work``."""
        covered: dict[str, ChunkHeader] = {}
        own = self.own_key
        too_old = time.time() - self.medium.config.manifest_max_age_s
        chosen = self._choose(listing, fresh, problem, work)
        read = functools.partial(self._read_listed, keep=listing.objects, late=late)
        for mkey, (got, tally) in zip(chosen, pool.map(read, chosen), strict=True):
            work.gets += 1
            work.decoded += tally.manifests
            work.decoded_bytes += tally.nbytes
            if isinstance(got, FailureReason):
                problem(f"manifest_{got}")
                if got in _STABLE_MANIFEST_REFUSALS:  # the same bytes are refused again: not read again
                    self._refuse(mkey, listing, got, work)
                continue
            self._etags[mkey] = listing.manifests[mkey][0]
            live = got  # listed objects only
            if mkey == own and not collect:  # the start-up scan only: see take_own_objects
                self._own_objects = frozenset(live)
            if not live and collect and mkey != own:
                doomed.append(mkey)
            covered.update(live)
        if collect:
            doomed.extend(m for m, (_, modified, _) in listing.manifests.items()
                          if modified < too_old and m != own and m not in doomed)
        return covered

    def _choose(self, listing: BucketListing, fresh: list[str], problem: Callable[[str], None],
                work: ManifestWork) -> list[str]:
        """The manifests of ``fresh`` this scan reads.

        Some are not read. With a key, one whose name does not verify
        (:meth:`_name_refusal`). One refused before and listed unchanged (same ETag and
        size). One listed larger than :meth:`limit_bytes` (refused). And those past
        this scan's budget: :data:`MANIFEST_READS_PER_SCAN`,
        :data:`MANIFEST_BYTES_PER_SCAN`, or without a key
        :data:`UNSIGNED_MANIFEST_BYTES_PER_SCAN`. Those are left to the next scans
        (``manifest_deferred``). This writer's own comes first, then those of writers read
        before, then the oldest."""
        limit = self.limit_bytes()
        todo = []
        for m in fresh:
            why = self._name_refusal(m, work)
            if why is not None:
                problem(f"manifest_{why}")
                continue
            etag, _, size = listing.manifests[m]
            old = self._refused.get(m)
            if old is not None and old[:2] == (etag, size):
                problem(f"manifest_{old[2]}")
                continue
            if size > limit:
                problem(f"manifest_{FailureReason.TOO_LARGE}")
                self._refuse(m, listing, FailureReason.TOO_LARGE, work)
                continue
            todo.append(m)
        known = self._etags
        # Oldest first among the rest: a flood of forged manifests comes after the writers it
        # targets, so it cannot push theirs back past the budget.
        todo.sort(key=lambda m: (m != self.own_key, m not in known, listing.manifests[m][1]))
        chosen: list[str] = []
        nbytes = 0
        budget = UNSIGNED_MANIFEST_BYTES_PER_SCAN if self.auth is None else MANIFEST_BYTES_PER_SCAN
        for m in todo:
            size = listing.manifests[m][2]
            if chosen and (len(chosen) >= MANIFEST_READS_PER_SCAN or nbytes + size > budget):
                problem("manifest_deferred")
                work.deferred += 1
                continue
            chosen.append(m)
            nbytes += size
        return chosen

    def _name_refusal(self, key: str, work: ManifestWork) -> FailureReason | None:
        """Why manifest ``key`` is not read, by its name alone (with a key: its tag must
        verify; without, None). A name is checked once while listed; a refused one is
        counted in ``work.refused`` the first time. No request is made."""
        if self.auth is None:
            return None
        checked = self._checked_names
        if key in checked:
            checked.move_to_end(key)
            return checked[key]
        _, why = manifest_name_refusal(key.rsplit("/", 1)[-1], self.auth, self.medium.namespace, self.medium.rank)
        checked[key] = why
        while len(checked) > MAX_CHECKED_MANIFEST_NAMES:
            checked.popitem(last=False)
        if why is not None:
            work.refused += 1
        return why

    def _refuse(self, key: str, listing: BucketListing, why: FailureReason, work: ManifestWork) -> None:
        etag, _, size = listing.manifests[key]
        self._etags.pop(key, None)
        self._refused[key] = (etag, size, why)
        self._refused.move_to_end(key)
        while len(self._refused) > MAX_REFUSED_MANIFESTS:
            self._refused.popitem(last=False)
        work.refused += 1

    def limit_bytes(self) -> int:
        """The largest manifest this scanner reads: ``manifest_max_entries`` entries of
        ``chunk_blocks``-block headers and a signature, at most :data:`MAX_MANIFEST_BYTES`."""
        return min(MAX_MANIFEST_BYTES,
                   max_manifest_bytes(self.medium.config.manifest_max_entries, self.max_chunk_blocks) + SIG_BYTES)

    def read(self, key: str, keep: Container[str] | None, late: Callable[[], bool] = lambda: False,
             *, writer_id: str | None = None) -> dict[str, ChunkHeader]:
        """The entries of manifest ``key`` whose object is in ``keep`` (None: all).

        The object's length is bounded before it is read. At most
        ``manifest_max_entries`` entries are decoded. Only kept entries become objects. It
        raises what the GET, :func:`~vllm_kvtier.tiers.s3.manifest.iter_manifest` or
        :func:`~vllm_kvtier.tiers.s3.manifest.signed_body` raise. It raises
        DeadlineExceeded once ``late()`` between two pieces.

        With a key, a name whose tag does not verify is refused (ChunkFormatError) with no
        GET. With ``writer_id`` given, the name is not checked. That is an earlier build's
        name of that writer (see :meth:`~vllm_kvtier.tiers.s3.store.S3Store.flush_manifest`).
        The whole manifest is verified before a byte of it is decoded. Its signature must
        be for this namespace, rank and that writer id. A forged one costs one GET and one
        HMAC pass, never a decode. A manifest of up to :data:`MANIFEST_HOLD_BYTES` is held
        while it is verified. A longer one is read twice and decoded as it arrives. The
        second GET asks for the version verified, by its ETag. Without a key it is decoded
        as it arrives; its CRC is checked at the end."""
        return self._read(key, keep, late, _Tally(), writer_id)

    def _read(self, key: str, keep: Container[str] | None, late: Callable[[], bool],
              tally: _Tally, writer_id: str | None = None) -> dict[str, ChunkHeader]:
        def in_time(pieces: Iterable[memoryview]) -> Iterator[memoryview]:
            for piece in pieces:
                if late():
                    raise DeadlineExceeded(f"manifest {key}: the scan's deadline passed")
                yield piece

        limit = self.limit_bytes()
        if self.auth is None:
            with self.medium.open_bounded(key, limit) as body:
                return self._decode(signed_body(in_time(body), None), keep, tally)
        writer, why = manifest_name_refusal(key.rsplit("/", 1)[-1], self.auth, self.medium.namespace, self.medium.rank)
        if writer_id is not None:
            writer = writer_id
        elif why is not None:
            raise ChunkFormatError(f"manifest {key}: its name's tag does not verify", why)
        held: bytearray | None = bytearray()
        with self.medium.open_bounded(key, limit) as body:
            etag = body.etag
            for piece in signed_body(in_time(body), self.auth.manifest_hashers(self.medium.namespace, self.medium.rank, writer)):
                if held is not None and len(held) + piece.nbytes <= MANIFEST_HOLD_BYTES:
                    held += piece
                else:
                    held = None
        if held is not None:  # verified: the loop above ends only if the signature does
            return self._decode([held], keep, tally)
        hashers = self.auth.manifest_hashers(self.medium.namespace, self.medium.rank, writer)
        with self.medium.open_bounded(key, limit, if_match=etag) as body:
            return self._decode(signed_body(in_time(body), hashers), keep, tally)

    def _decode(self, pieces: Iterable[bytes | bytearray | memoryview], keep: Container[str] | None,
                tally: _Tally) -> dict[str, ChunkHeader]:
        def counted() -> Iterator[bytes | bytearray | memoryview]:
            for piece in pieces:
                tally.nbytes += memoryview(piece).nbytes
                yield piece

        tally.manifests += 1
        return dict(iter_manifest(counted(), self.medium.namespace, max_blocks=self.max_chunk_blocks,
                                  max_entries=self.medium.config.manifest_max_entries, block_bytes=self.block_bytes,
                                  keep=keep))

    def _read_listed(self, key: str, keep: Container[str],
                     late: Callable[[], bool]) -> tuple[dict[str, ChunkHeader] | FailureReason, _Tally]:
        tally = _Tally()
        if late():
            return FailureReason.DEADLINE, tally
        try:
            return self._read(key, keep, late, tally), tally
        except Exception as e:
            logger.warning("kvtier s3: ignoring manifest %s: %s", key, e)
            return error_reason(e), tally
