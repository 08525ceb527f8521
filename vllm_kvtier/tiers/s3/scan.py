"""The S3 store's start-up listing and rescans (:class:`S3Scanner`, behind
:meth:`~vllm_kvtier.tiers.s3.store.S3Store.scan`). Manifests are read by
:mod:`~vllm_kvtier.tiers.s3.manifest_scan`.

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
from collections.abc import Callable, Container
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
from vllm_kvtier.tiers.s3.config import HEAD_PROBE_BYTES, MANIFEST_SUFFIX, SUFFIX, error_reason
from vllm_kvtier.tiers.s3.manifest_scan import (
    MANIFEST_READS_PER_SCAN,
    MAX_MANIFEST_BYTES,
    STABLE_REFUSALS,
    BucketListing,
    ManifestReader,
    ManifestWork,
)
from vllm_kvtier.tiers.s3.medium import S3Medium

__all__ = ["MANIFEST_READS_PER_SCAN", "MAX_MANIFEST_BYTES", "ManifestWork", "S3Scanner", "ScanReport"]

# The S3 tier logs under one name, whichever of its modules speaks.
logger = logging.getLogger("vllm_kvtier.tiers.s3.store")

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

    It holds the header cache and the refusals of earlier scans, and the last scan's
    report. Its :class:`~.manifest_scan.ManifestReader` holds what it knows of manifests.
    The store makes one and forwards ``scan`` and the figures to it. ``refuses`` is the store's trust check of a header
    (:meth:`~vllm_kvtier.tiers.kernel.StoreKernel.refuses`). ``own_manifest_key`` is the
    key of this store's writer's manifest. One scan runs at a time (the store's caller's
    thread). :meth:`read_manifest` may run on any thread."""

    def __init__(self, medium: S3Medium, *, block_bytes: int, max_chunk_blocks: int, auth: ChunkAuth | None,
                 refuses: Callable[[str, ChunkHeader], FailureReason | None], own_manifest_key: str) -> None:
        self.medium = medium
        self.block_bytes = block_bytes
        self.max_chunk_blocks = max_chunk_blocks
        self._refuses = refuses
        self._manifests = ManifestReader(medium, block_bytes=block_bytes, max_chunk_blocks=max_chunk_blocks,
                                         auth=auth, own_key=own_manifest_key)
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

    def take_own_objects(self) -> frozenset[str]:
        """:meth:`~vllm_kvtier.tiers.s3.store.S3Store.take_own_objects`: the set is handed
        out once, then dropped."""
        return self._manifests.take_own_objects()

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

        listing = BucketListing()
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
        with ThreadPoolExecutor(self.medium.config.io_threads, thread_name_prefix="kvtier-s3-scan") as pool:
            # An unchanged manifest's entries are in the header cache, unless it overflowed.
            fresh = self._manifests.fresh(listing, all_listed=self._headers_overflowed)
            work = ManifestWork()
            covered = self._manifests.headers(pool, listing, fresh, cleanup or collect, problem, doomed, late, work)
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
                if got in STABLE_REFUSALS:
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
                  listing: BucketListing) -> None:
        """Keep the headers of this scan for the next one (LRU, bounded).

        Keep the ETags of the manifests it read. Forget what the listing no longer shows."""
        cache = self._headers
        for oid in [o for o in cache if o not in objects]:
            self._headers_bytes -= cache.pop(oid)[2]
        refused = self._refused
        for oid in [o for o in refused if o not in objects or o in found]:
            del refused[oid]
        config = self.medium.config
        while len(refused) > config.header_cache_entries:
            refused.popitem(last=False)
        for oid, h in found.items():
            old = cache.get(oid)
            cost = old[2] if old is not None and old[1] is h else header_memory_bytes(h)
            self._headers_bytes += cost - (old[2] if old is not None else 0)
            cache[oid] = (objects[oid][0], h, cost)
            cache.move_to_end(oid)
        self._headers_overflowed = False
        while cache and (len(cache) > config.header_cache_entries
                         or self._headers_bytes > config.header_cache_bytes):
            self._headers_bytes -= cache.popitem(last=False)[1][2]
            self._headers_overflowed = True
        self._manifests.forget_unlisted(listing)

    def _list_rank(self, out: BucketListing, problem: Callable[[str], None], late: Callable[[], bool]) -> None:
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

    def manifest_limit_bytes(self) -> int:
        """:meth:`ManifestReader.limit_bytes`: the largest manifest this scanner reads."""
        return self._manifests.limit_bytes()

    def read_manifest(self, key: str, keep: Container[str] | None, late: Callable[[], bool] = lambda: False,
                      *, writer_id: str | None = None) -> dict[str, ChunkHeader]:
        """:meth:`ManifestReader.read`: the entries of manifest ``key`` whose object is in
        ``keep`` (None: all), bounded and verified before any is decoded."""
        return self._manifests.read(key, keep, late, writer_id=writer_id)

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
            h = decode_header(bytes(head[:need]), self.medium.namespace, rank=self.medium.rank)
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
