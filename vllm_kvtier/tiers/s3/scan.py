"""The S3 store's start-up listing and rescans (:class:`S3Scanner`, behind
:meth:`~vllm_kvtier.tiers.s3.store.S3Store.scan`).

Who calls it: the store, on the thread that calls its ``scan``; a scan blocks that thread.
Its manifest and header GETs run on a pool of ``io_threads`` threads of its own.

Cost: a scan lists the rank's prefix, one LIST request per 1,000 keys. It needs every
listed object's header. It makes one GET per manifest whose ETag changed since this store's
last scan (with a key, none for a name whose tag does not verify). It makes one ranged GET
(the first 4 KiB) per object that neither a manifest nor the header cache covers. The
header cache holds the headers of earlier scans (``header_cache_entries``, LRU, listed
objects only).

Trust: the listing is the truth. A manifest entry is used only for an object the listing
shows. So a stale or lost manifest costs requests, never correctness. Every size in a
listed header or a manifest is bounded by what this engine could have written
(``max_chunk_blocks`` blocks of ``block_bytes``) before it sizes anything. A manifest is
hostile input. One longer than ``manifest_max_entries`` entries can need is refused by its
listed size, before a GET (:meth:`S3Scanner.manifest_limit_bytes`). With a key, its name
must carry a tag only a key holder makes, checked from the listing alone
(:func:`~vllm_kvtier.tiers.s3.manifest.manifest_name_refusal`): a forged name costs no GET.
Its signature is then checked over the raw bytes before any is decoded. Without a key, it
is decoded as its body arrives, and a payload that inflates past
:data:`~vllm_kvtier.tiers.s3.manifest.MAX_INFLATION` times its size is refused. Only the
entries of listed objects are kept (:func:`~vllm_kvtier.tiers.s3.manifest.iter_manifest`).

Manifest budget: a scan reads at most :data:`MANIFEST_READS_PER_SCAN` manifests, and a
bounded number of their bytes; the rest wait for the next scans. A manifest refused for
its bytes is remembered by ETag and size (``manifests_refused``): it is not read again
while unchanged. So a bucket full of forged manifests costs each scan a bounded amount.

Collection: a live instance's rescans (``collect``) delete other writers' manifests. They
delete those not rewritten for ``manifest_max_age_s`` and those covering no listed object.

Deadline: the start-up scan has an overall deadline (``scan(deadline=)``,
``s3.scan_deadline_s``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm_kvtier.chunkformat import (
    FIXED_BYTES,
    ChunkFormatError,
    ChunkHeader,
    bounded_header_bytes,
    decode_header,
    header_memory_bytes,
    max_chunk_bytes,
)
from vllm_kvtier.errors import FailureReason
from vllm_kvtier.tiers.auth import ChunkAuth
from vllm_kvtier.tiers.base import ScanResult
from vllm_kvtier.tiers.resilience import DeadlineExceeded
from vllm_kvtier.tiers.s3.config import HEAD_PROBE_BYTES, MANIFEST_SUFFIX, SUFFIX, error_reason
from vllm_kvtier.tiers.s3.manifest import (
    SIG_BYTES,
    iter_manifest,
    manifest_name_refusal,
    max_manifest_bytes,
    signed_body,
)
from vllm_kvtier.tiers.s3.medium import S3Medium

__all__ = ["MANIFEST_READS_PER_SCAN", "MAX_MANIFEST_BYTES", "ManifestWork", "S3Scanner", "ScanReport"]

# The S3 tier logs under one name, whichever of its modules speaks.
logger = logging.getLogger("vllm_kvtier.tiers.s3.store")

#: Why an object's own header was refused that the same bytes will always give: remembered
#: (by listed size) so that a rescan does not fetch it again.
_STABLE_REFUSALS = frozenset({FailureReason.UNAUTHENTICATED, FailureReason.AUTH_FAILED, FailureReason.KEY_MISMATCH,
                              FailureReason.FORMAT, FailureReason.NAMESPACE, FailureReason.TOO_LARGE})

#: The largest manifest object a scan reads, whatever the config: a store refuses one
#: above :meth:`S3Scanner.manifest_limit_bytes` (what ``manifest_max_entries`` entries of
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
#: then decoded; a longer one is read twice (see :meth:`S3Scanner.read_manifest`).
MANIFEST_HOLD_BYTES = 4 << 20
#: Manifests refused for their bytes remembered at most (by ETag and size): one listed
#: unchanged is not read again.
MAX_REFUSED_MANIFESTS = 4096
#: Manifest names whose tag was checked, remembered at most (with a key; one listed again
#: is not checked again, nor counted refused again).
MAX_CHECKED_MANIFEST_NAMES = 16384
#: Why a manifest was refused that the same bytes will always give.
_STABLE_MANIFEST_REFUSALS = _STABLE_REFUSALS | {FailureReason.CHECKSUM}


@dataclass
class _Tally:
    """What one manifest read decoded: manifests given to the decoder, and their bytes."""

    manifests: int = 0
    nbytes: int = 0


@dataclass
class ManifestWork:
    """What a scan spent on manifests (see :class:`ScanReport`)."""

    gets: int = 0
    refused: int = 0
    deferred: int = 0
    decoded: int = 0
    decoded_bytes: int = 0


@dataclass
class _Listing:
    #: object_id -> (size, LastModified as a timestamp, key)
    objects: dict[str, tuple[int, float, str]] = field(default_factory=dict)
    #: manifest key -> (ETag, LastModified as a timestamp, size)
    manifests: dict[str, tuple[str, float, int]] = field(default_factory=dict)
    requests: int = 0
    #: the scan's deadline passed before the last page
    cut: bool = False


@dataclass(frozen=True)
class ScanReport:
    """What the last :meth:`~vllm_kvtier.tiers.s3.store.S3Store.scan` found and what it cost
    in requests."""

    objects: int = 0
    list_requests: int = 0
    manifest_gets: int = 0
    header_gets: int = 0
    #: objects whose header came from a manifest (no GET needed)
    from_manifests: int = 0
    #: problem -> count (unverifiable objects or manifests, a failed listing...)
    problems: dict[str, int] = field(default_factory=dict)
    #: objects whose header came from this store's cache of earlier scans (no GET)
    from_cache: int = 0
    #: manifests not fetched because their ETag had not changed since the last scan
    manifests_unchanged: int = 0
    #: manifests deleted: not rewritten for ``manifest_max_age_s``, or covering no object
    manifests_collected: int = 0
    #: False when the listing failed or was cut short: ``found`` is then not what the bucket holds
    complete: bool = True
    #: the scan's ``deadline`` passed: the listing, manifests or header GETs not done by
    #: then were skipped (``problems["deadline"]`` counts the objects left out)
    cut_short: bool = False
    #: manifests refused this scan, with a key by a name whose tag does not verify (no
    #: GET), or for their bytes (a bad signature, size or format): not read again while
    #: listed unchanged
    manifests_refused: int = 0
    #: changed manifests left to the next scans (this scan's budget was spent)
    manifests_deferred: int = 0
    #: manifests whose bytes reached the decoder, and how many bytes did (with a key,
    #: only manifests whose signature verified)
    manifests_decoded: int = 0
    manifest_bytes_decoded: int = 0


class S3Scanner:
    """The listing state of one :class:`~vllm_kvtier.tiers.s3.store.S3Store`.

    It holds the header cache, the refusals and the manifest ETags of earlier scans. It
    holds the last scan's report. The store makes one and forwards ``scan`` and the
    figures to it. ``refuses`` is the store's trust check of a header
    (:meth:`~vllm_kvtier.tiers.kernel.StoreKernel.refuses`). ``own_manifest_key`` is the
    key of this store's writer's manifest. One scan runs at a time (the store's caller's
    thread). :meth:`read_manifest` may run on any thread."""

    def __init__(self, medium: S3Medium, *, block_bytes: int, max_chunk_blocks: int, auth: ChunkAuth | None,
                 refuses: Callable[[str, ChunkHeader], FailureReason | None], own_manifest_key: str) -> None:
        self.medium = medium
        self.config = medium.config
        self.namespace = medium.namespace
        self.rank = medium.rank
        self.block_bytes = block_bytes
        self.max_chunk_blocks = max_chunk_blocks
        self.auth = auth
        self.own_manifest_key = own_manifest_key
        self._refuses = refuses
        self.last_scan = ScanReport()
        #: object id -> (listed size, verified header, its memory) of earlier scans, LRU (at
        #: most ``header_cache_entries`` and ``header_cache_bytes`` of headers; only objects
        #: the last listing showed)
        self._headers: OrderedDict[str, tuple[int, ChunkHeader, int]] = OrderedDict()
        self._headers_bytes = 0
        self._headers_overflowed = False  # the last scan's headers did not all fit
        #: object id -> (listed size, why) of objects whose own header a read would refuse
        #: (a key not accepted, another rank, an old format version): not fetched again
        #: while listed at that size (LRU, at most ``header_cache_entries``)
        self._refused: OrderedDict[str, tuple[int, FailureReason]] = OrderedDict()
        #: manifest key -> ETag when last read (only manifests the last listing showed)
        self._manifest_etags: dict[str, str] = {}
        #: manifest key -> (ETag, size, why) of manifests refused for their bytes: not read
        #: again while listed unchanged (LRU, at most :data:`MAX_REFUSED_MANIFESTS`)
        self._refused_manifests: OrderedDict[str, tuple[str, int, FailureReason]] = OrderedDict()
        #: manifest key -> why its name is refused (None: it verifies), with a key only (LRU,
        #: at most :data:`MAX_CHECKED_MANIFEST_NAMES`; only manifests the last listing showed)
        self._checked_names: OrderedDict[str, FailureReason | None] = OrderedDict()
        #: listed objects that this writer id's manifest names, see :meth:`take_own_objects`
        self._own_objects: frozenset[str] = frozenset()

    def take_own_objects(self) -> frozenset[str]:
        """:meth:`~vllm_kvtier.tiers.s3.store.S3Store.take_own_objects`: the set is handed
        out once, then dropped."""
        out, self._own_objects = self._own_objects, frozenset()
        return out

    def header_cache_entries(self) -> int:
        """Headers kept from earlier scans (at most ``header_cache_entries``)."""
        return len(self._headers)

    def header_cache_bytes(self) -> int:
        """Memory the headers kept from earlier scans hold (at most ``header_cache_bytes``,
        as :func:`~vllm_kvtier.chunkformat.header_memory_bytes` counts it)."""
        return self._headers_bytes

    def scan(self, *, cleanup: bool = False, collect: bool = False, deadline: float | None = None) -> ScanResult:
        """:meth:`~vllm_kvtier.tiers.s3.store.S3Store.scan`, whose docstring is the contract.
        Its report goes to :attr:`last_scan`."""
        problems: dict[str, int] = {}
        late = (lambda: False) if deadline is None else (lambda: time.monotonic() >= deadline)

        def problem(what: str) -> None:
            problems[what] = problems.get(what, 0) + 1

        listing = _Listing()
        try:
            self._list_rank(listing, problem, late)
        except Exception as e:
            problem(f"list_{error_reason(e)}")
            logger.warning("kvtier s3: listing %s failed: %s", self.medium.prefix, e)
            self.last_scan = ScanReport(0, listing.requests, 0, 0, 0, problems, complete=False)
            return ScanResult({}, problems)
        if listing.cut:
            problem("list_deadline")
            cleanup = collect = False  # a partial listing: what it does not show may exist
        objects = listing.objects
        found: dict[str, ChunkHeader] = {}
        doomed: list[str] = []
        from_cache = 0
        with ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="kvtier-s3-scan") as pool:
            # An unchanged manifest's entries are in the header cache, unless it overflowed.
            full = self._headers_overflowed
            fresh = [m for m, (etag, _, _) in listing.manifests.items()
                     if full or self._manifest_etags.get(m) != etag]
            work = ManifestWork()
            covered = self._manifest_headers(pool, listing, fresh, cleanup or collect, problem, doomed, late, work)
            todo = []
            for oid, (size, _, key) in objects.items():
                cached = self._headers.get(oid)
                hit = cached is not None and cached[0] == size
                h = cached[1] if cached is not None and hit else covered.get(oid)
                refused = self._refused.get(oid)
                if refused is not None and refused[0] == size and h is None:
                    problem(refused[1])  # its own header was refused before: not fetched again
                    continue
                # A cached header was checked when it was first found; a manifest's entry is
                # checked here (one HMAC over the header), and if refused the object's own
                # header decides (a manifest entry never hides a good object).
                if (h is not None and h.block_bytes == self.block_bytes and size >= h.total_bytes
                        and (hit or self._refuses(oid, h) is None)):
                    found[oid] = h
                    from_cache += hit
                else:
                    todo.append((oid, size, key))
            probe = functools.partial(self._scan_header, late=late)
            for (oid, size, key), got in zip(todo, pool.map(probe, todo), strict=True):
                if isinstance(got, ChunkHeader):
                    found[oid] = got
                    continue
                problem(got)
                if got in _STABLE_REFUSALS:
                    self._refused[oid] = (size, got)
                    self._refused.move_to_end(oid)
                if cleanup and got.damaged and got is not FailureReason.MISSING:
                    doomed.append(key)
            list(pool.map(self.delete_quietly, doomed))
        self._remember(found, objects, listing)
        from_manifests = len(found) - from_cache - sum(1 for oid, _, _ in todo if oid in found)
        cut = listing.cut or late()
        self.last_scan = ScanReport(len(found), listing.requests, work.gets, len(todo), from_manifests, problems,
                                    from_cache=from_cache, manifests_unchanged=len(listing.manifests) - len(fresh),
                                    manifests_collected=sum(1 for k in doomed if k.endswith(MANIFEST_SUFFIX)),
                                    complete=not listing.cut, cut_short=cut, manifests_refused=work.refused,
                                    manifests_deferred=work.deferred, manifests_decoded=work.decoded,
                                    manifest_bytes_decoded=work.decoded_bytes)
        return ScanResult({oid: found[oid] for oid in sorted(found, key=lambda oid: objects[oid][1])}, problems)

    def _remember(self, found: dict[str, ChunkHeader], objects: dict[str, tuple[int, float, str]],
                  listing: _Listing) -> None:
        """Keep the headers of this scan for the next one (LRU, bounded).

        Keep the ETags of the manifests it read. Forget what the listing no longer shows."""
        cache = self._headers
        for oid in [o for o in cache if o not in objects]:
            self._headers_bytes -= cache.pop(oid)[2]
        refused = self._refused
        for oid in [o for o in refused if o not in objects or o in found]:
            del refused[oid]
        while len(refused) > self.config.header_cache_entries:
            refused.popitem(last=False)
        for oid, h in found.items():
            old = cache.get(oid)
            cost = old[2] if old is not None and old[1] is h else header_memory_bytes(h)
            self._headers_bytes += cost - (old[2] if old is not None else 0)
            cache[oid] = (objects[oid][0], h, cost)
            cache.move_to_end(oid)
        self._headers_overflowed = False
        while cache and (len(cache) > self.config.header_cache_entries
                         or self._headers_bytes > self.config.header_cache_bytes):
            self._headers_bytes -= cache.popitem(last=False)[1][2]
            self._headers_overflowed = True
        self._manifest_etags = {m: e for m, e in self._manifest_etags.items() if m in listing.manifests}
        for m in [m for m in self._refused_manifests if m not in listing.manifests]:
            del self._refused_manifests[m]
        for m in [m for m in self._checked_names if m not in listing.manifests]:
            del self._checked_names[m]

    def _list_rank(self, out: _Listing, problem: Callable[[str], None], late: Callable[[], bool]) -> None:
        """LIST the rank's prefix, sorting keys into chunks and manifests; no page asked
        for once ``late()`` (``out.cut``)."""
        root = self.medium.prefix
        for page in self.medium.list_pages():
            out.requests += 1
            for o in page.get("Contents", []):
                key, rel = o["Key"], o["Key"][len(root) :]
                oid = rel.rsplit("/", 1)[-1][: -len(SUFFIX)]
                if rel.startswith("manifest/") and rel.endswith(MANIFEST_SUFFIX):
                    out.manifests[key] = (str(o.get("ETag", "")), o["LastModified"].timestamp(), int(o["Size"]))
                elif rel.endswith(SUFFIX) and key == self.medium.key(oid):
                    out.objects[oid] = (o["Size"], o["LastModified"].timestamp(), key)
                else:
                    problem("unknown_key")
            if page.get("IsTruncated") and late():
                out.cut = True
                return

    def _manifest_headers(self, pool: ThreadPoolExecutor, listing: _Listing, fresh: list[str], collect: bool,
                          problem: Callable[[str], None], doomed: list[str], late: Callable[[], bool],
                          work: ManifestWork) -> dict[str, ChunkHeader]:
        """Headers from the manifests in ``fresh`` (changed since the last scan).

        Only the objects the listing shows count. With ``collect``, some other writers'
        manifests go to ``doomed``. Those are stale ones (not rewritten for
        ``manifest_max_age_s``) and ones that cover nothing. What it read, refused,
        deferred and decoded goes to ``work``."""
        covered: dict[str, ChunkHeader] = {}
        own = self.own_manifest_key
        too_old = time.time() - self.config.manifest_max_age_s
        chosen = self._choose_manifests(listing, fresh, problem, work)
        read = functools.partial(self._scan_manifest, keep=listing.objects, late=late)
        for mkey, (got, tally) in zip(chosen, pool.map(read, chosen), strict=True):
            work.gets += 1
            work.decoded += tally.manifests
            work.decoded_bytes += tally.nbytes
            if isinstance(got, FailureReason):
                problem(f"manifest_{got}")
                if got in _STABLE_MANIFEST_REFUSALS:  # the same bytes are refused again: not read again
                    self._refuse_manifest(mkey, listing, got, work)
                continue
            self._manifest_etags[mkey] = listing.manifests[mkey][0]
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

    def _choose_manifests(self, listing: _Listing, fresh: list[str], problem: Callable[[str], None],
                          work: ManifestWork) -> list[str]:
        """The manifests of ``fresh`` this scan reads.

        Some are not read. With a key, one whose name does not verify
        (:meth:`_name_refusal`). One refused before and listed unchanged (same ETag and
        size). One listed larger than :meth:`manifest_limit_bytes` (refused). And those past
        this scan's budget: :data:`MANIFEST_READS_PER_SCAN`,
        :data:`MANIFEST_BYTES_PER_SCAN`, or without a key
        :data:`UNSIGNED_MANIFEST_BYTES_PER_SCAN`. Those are left to the next scans
        (``manifest_deferred``). This writer's own comes first, then those of writers read
        before, then the oldest."""
        limit = self.manifest_limit_bytes()
        todo = []
        for m in fresh:
            why = self._name_refusal(m, work)
            if why is not None:
                problem(f"manifest_{why}")
                continue
            etag, _, size = listing.manifests[m]
            old = self._refused_manifests.get(m)
            if old is not None and old[:2] == (etag, size):
                problem(f"manifest_{old[2]}")
                continue
            if size > limit:
                problem(f"manifest_{FailureReason.TOO_LARGE}")
                self._refuse_manifest(m, listing, FailureReason.TOO_LARGE, work)
                continue
            todo.append(m)
        known = self._manifest_etags
        # Oldest first among the rest: a flood of forged manifests comes after the writers it
        # targets, so it cannot push theirs back past the budget.
        todo.sort(key=lambda m: (m != self.own_manifest_key, m not in known, listing.manifests[m][1]))
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
        _, why = manifest_name_refusal(key.rsplit("/", 1)[-1], self.auth, self.namespace, self.rank)
        checked[key] = why
        while len(checked) > MAX_CHECKED_MANIFEST_NAMES:
            checked.popitem(last=False)
        if why is not None:
            work.refused += 1
        return why

    def _refuse_manifest(self, key: str, listing: _Listing, why: FailureReason, work: ManifestWork) -> None:
        etag, _, size = listing.manifests[key]
        self._manifest_etags.pop(key, None)
        self._refused_manifests[key] = (etag, size, why)
        self._refused_manifests.move_to_end(key)
        while len(self._refused_manifests) > MAX_REFUSED_MANIFESTS:
            self._refused_manifests.popitem(last=False)
        work.refused += 1

    def manifest_limit_bytes(self) -> int:
        """The largest manifest this scanner reads: ``manifest_max_entries`` entries of
        ``chunk_blocks``-block headers and a signature, at most :data:`MAX_MANIFEST_BYTES`."""
        return min(MAX_MANIFEST_BYTES,
                   max_manifest_bytes(self.config.manifest_max_entries, self.max_chunk_blocks) + SIG_BYTES)

    def read_manifest(self, key: str, keep: Container[str] | None, late: Callable[[], bool] = lambda: False,
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
        return self._read_manifest(key, keep, late, _Tally(), writer_id)

    def _read_manifest(self, key: str, keep: Container[str] | None, late: Callable[[], bool],
                       tally: _Tally, writer_id: str | None = None) -> dict[str, ChunkHeader]:
        def in_time(pieces: Iterable[memoryview]) -> Iterator[memoryview]:
            for piece in pieces:
                if late():
                    raise DeadlineExceeded(f"manifest {key}: the scan's deadline passed")
                yield piece

        limit = self.manifest_limit_bytes()
        if self.auth is None:
            with self.medium.open_bounded(key, limit) as body:
                return self._decode(signed_body(in_time(body), None), keep, tally)
        writer, why = manifest_name_refusal(key.rsplit("/", 1)[-1], self.auth, self.namespace, self.rank)
        if writer_id is not None:
            writer = writer_id
        elif why is not None:
            raise ChunkFormatError(f"manifest {key}: its name's tag does not verify", why)
        held: bytearray | None = bytearray()
        with self.medium.open_bounded(key, limit) as body:
            etag = body.etag
            for piece in signed_body(in_time(body), self.auth.manifest_hashers(self.namespace, self.rank, writer)):
                if held is not None and len(held) + piece.nbytes <= MANIFEST_HOLD_BYTES:
                    held += piece
                else:
                    held = None
        if held is not None:  # verified: the loop above ends only if the signature does
            return self._decode([held], keep, tally)
        hashers = self.auth.manifest_hashers(self.namespace, self.rank, writer)
        with self.medium.open_bounded(key, limit, if_match=etag) as body:
            return self._decode(signed_body(in_time(body), hashers), keep, tally)

    def _decode(self, pieces: Iterable[bytes | bytearray | memoryview], keep: Container[str] | None,
                tally: _Tally) -> dict[str, ChunkHeader]:
        def counted() -> Iterator[bytes | bytearray | memoryview]:
            for piece in pieces:
                tally.nbytes += memoryview(piece).nbytes
                yield piece

        tally.manifests += 1
        return dict(iter_manifest(counted(), self.namespace, max_blocks=self.max_chunk_blocks,
                                  max_entries=self.config.manifest_max_entries, block_bytes=self.block_bytes,
                                  keep=keep))

    def _scan_manifest(self, key: str, keep: Container[str],
                       late: Callable[[], bool]) -> tuple[dict[str, ChunkHeader] | FailureReason, _Tally]:
        tally = _Tally()
        if late():
            return FailureReason.DEADLINE, tally
        try:
            return self._read_manifest(key, keep, late, tally), tally
        except Exception as e:
            logger.warning("kvtier s3: ignoring manifest %s: %s", key, e)
            return error_reason(e), tally

    def _scan_header(self, item: tuple[str, int, str],
                     late: Callable[[], bool] = lambda: False) -> ChunkHeader | FailureReason:
        """The verified header of one listed object.

        It takes one ranged GET, two for a header longer than 4 KiB. Every size in it is
        bounded before it sizes a read: by what this store writes, and by the listed size.
        ``deadline`` without a request once ``late()``."""
        _, size, key = item
        if late():
            return FailureReason.DEADLINE
        deadline = self.medium.soon()
        try:
            if size < FIXED_BYTES:
                raise ChunkFormatError(f"truncated: an object of {size} B", FailureReason.TRUNCATED)
            limit = max_chunk_bytes(self.max_chunk_blocks, self.block_bytes)
            if size > limit:
                raise ChunkFormatError(f"too large: an object of {size} B, at most {limit}", FailureReason.TOO_LARGE)
            head = bytearray(min(size, HEAD_PROBE_BYTES))
            self.medium.get_range(key, 0, memoryview(head), deadline)
            need = bounded_header_bytes(head, max_blocks=self.max_chunk_blocks,
                                        block_bytes=self.block_bytes)
            if need > size:
                raise ChunkFormatError(f"truncated header: {size} of {need} bytes", FailureReason.TRUNCATED)
            if need > len(head):
                rest = bytearray(need - len(head))
                self.medium.get_range(key, len(head), memoryview(rest), deadline)
                head += rest
            h = decode_header(bytes(head[:need]), self.namespace, rank=self.rank)
            if size < h.total_bytes:
                raise ChunkFormatError(f"truncated: {size} of {h.total_bytes} bytes", FailureReason.TRUNCATED)
            why = self._refuses(item[0], h)
            if why is not None:  # what a read would refuse is never indexed (nor offered again)
                raise ChunkFormatError(f"not trusted: {why}", why)
            return h
        except Exception as e:
            logger.warning("kvtier s3: ignoring %s: %s", key, e)
            return error_reason(e)

    def delete_quietly(self, key: str) -> None:
        """Delete ``key`` of this prefix; a failure is logged, never raised."""
        try:
            self.medium.delete_key(key)
        except Exception as e:
            logger.warning("kvtier s3: delete of %s failed (%s): %s", key, error_reason(e), e)
